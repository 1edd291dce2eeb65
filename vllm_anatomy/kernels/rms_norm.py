"""rms_norm: RMSNorm, optionally fused with the residual add, in one launch.

Mirrors vLLM's rms_norm / fused_add_rms_norm (csrc/layernorm_kernels.cu), which
v0.27.1's RMSNorm reaches through its vllm/ir op (vllm/kernels/vllm_c.py), with
the numerics of our torch layer
(vllm_anatomy/model_executor/layers/layernorm.py, RMSNorm.forward_native):

    s      = x + residual              rounded to x.dtype   (only with a residual)
    var    = mean(s.float() ** 2)      fp32
    xn     = (s.float() * rsqrt(var + eps)).to(x.dtype)     rounded *before* the weight
    out    = (weight.float() * xn.float()).to(out dtype)    (torch's `weight * xn`)

Memory layout:
    x          [T, D] or [T, H, D]   any token/head strides, last dim contiguous.
               The 3-D form is Qwen3's per-head q/k norm: q is a column slice of
               the packed qkv output viewed as [T, heads, head_dim], so rows are
               not contiguous and no copy is made.
    residual   same shape as x, any strides, last dim contiguous (optional)
    weight     [D] contiguous
    out        NEW contiguous tensor of x's shape (torch's result is contiguous
               too); dtype = promote(x.dtype, weight.dtype), as `weight * xn`.
    residual   NEW contiguous tensor of x's shape holding the rounded sum
    out        (returned as the new residual). Inputs are never written.

Grid: (cdiv(T * H, BLOCK_R),). A row is one (token, head) pair of D values;
one program normalizes BLOCK_R rows: one [BLOCK_R, D] tile loaded once, summed
along D in registers, scaled and stored (plus the sum, with a residual).

NOTE: why this exists. GPU profiling of a decode step (Qwen3-0.6B shape,
batch 256, inside a CUDA graph) found ~59 kernels per decoder layer (1,656 per
step; 26,496 over 16 steps; 9.1 ms of GPU busy time per step). Most were tiny
elementwise ops of the plain-torch norm (add, float, pow, mean, add, rsqrt,
mul, cast, mul: 9 launches per norm, 4 norms per Qwen3 layer), each costing a
few microseconds even inside a graph. This kernel does each norm in one
launch; with the RoPE and SiLU*mul kernels a step fell to 361 kernels and
6.3 ms of GPU busy time (bench/results/step_overhead_h200.json).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.launch import check_launchable
from vllm_anatomy.kernels.pdl import pdl_launch_dependents, pdl_wait, use_pdl


@triton.jit(do_not_specialize=["num_rows"])   # per-step sizes: see launch.py
def _rms_norm_kernel(
    x_ptr,                         # [T, H, D] strided, last dim contiguous
    residual_ptr,                  # [T, H, D] strided (unused without residual)
    weight_ptr,                    # [D]
    out_ptr,                       # [T * H, D] contiguous
    residual_out_ptr,              # [T * H, D] contiguous (unused without residual)
    num_rows,                      # T * H
    eps,
    stride_x_tok, stride_x_head,
    stride_r_tok, stride_r_head,
    NUM_HEADS: tl.constexpr,       # H (1 for a 2-D x)
    HIDDEN: tl.constexpr,          # D
    HIDDEN_PADDED: tl.constexpr,   # next_pow2(D)
    BLOCK_R: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,         # launched with PDL (pdl.py): wait before any load or store
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)               # [R]
    row_mask = row < num_rows
    row64 = row.to(tl.int64)
    tok = row64 // NUM_HEADS
    head = row64 % NUM_HEADS
    dim = tl.arange(0, HIDDEN_PADDED)                                      # [D]
    dim_mask = dim < HIDDEN
    mask = row_mask[:, None] & dim_mask[None, :]
    out_off = row64[:, None] * HIDDEN + dim[None, :]                       # contiguous out

    # NOTE: loads are upcast to fp32 at once; masked lanes read 0 and so add
    # nothing to the sum of squares.
    x = tl.load(x_ptr + (tok * stride_x_tok + head * stride_x_head)[:, None] + dim[None, :],
                mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + (tok * stride_r_tok + head * stride_r_head)[:, None]
                    + dim[None, :], mask=mask, other=0.0).to(tl.float32)
        # torch adds in x's dtype: the sum is rounded before it is normalized,
        # and that rounded sum is the new residual.
        s = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + out_off, s, mask=mask)
        x = s.to(tl.float32)
    pdl_launch_dependents(USE_PDL)     # the inputs are read: the next kernel may launch
    variance = tl.sum(x * x, axis=1) / HIDDEN                              # [R] fp32
    xn = x * tl.rsqrt(variance + eps)[:, None]
    # Rounded to the activation dtype *before* the weight (transformers' order).
    if HAS_RESIDUAL:
        xn = xn.to(residual_out_ptr.dtype.element_ty).to(tl.float32)
    else:
        xn = xn.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + dim, mask=dim_mask, other=0.0).to(tl.float32)
    out = w[None, :] * xn
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_per_program(hidden: int) -> int:
    # NOTE: ~2 K elements per program: one row of a 1024-wide hidden norm gives
    # 2 rows per program (128 programs for a batch of 256, about one per SM of
    # an H200); a 128-wide head norm gives 16 (q of Qwen3-0.6B: 256 programs).
    return max(1, min(64, 2048 // triton.next_power_of_2(hidden)))


def launch_grid(num_rows: int, hidden: int) -> tuple[int]:
    """One program per BLOCK_R rows (for tracing)."""
    return (triton.cdiv(num_rows, _rows_per_program(hidden)),)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, pdl: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x ([T, D] or [T, H, D], strided; others are reshaped).

    Returns out, or (out, new_residual) when residual is given; both are new
    contiguous tensors of x's shape. x, residual and weight are not modified.
    pdl: the VLLM_ANATOMY_PDL switch as the caller read it (kernels/pdl.py; same results).
    """
    orig_shape = x.shape
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} for hidden size {hidden}"
    if x.dim() not in (2, 3):
        x = x.reshape(-1, hidden)
    if x.stride(-1) != 1:
        x = x.contiguous()             # NOTE: never the case for the model's inputs
    if residual is not None:
        assert residual.shape == orig_shape, "residual must have x's shape"
        residual = residual.reshape(x.shape)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    weight = weight.contiguous()

    check_launchable(x, _rms_norm_kernel)
    norm_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(orig_shape, dtype=torch.promote_types(norm_dtype, weight.dtype),
                      device=x.device)
    # (out when there is no residual: never written, HAS_RESIDUAL is off)
    residual_out = torch.empty(orig_shape, dtype=norm_dtype, device=x.device) if residual is not None else out
    if x.dim() == 3:
        num_tokens, num_heads, _ = x.shape
        stride_x = (x.stride(0), x.stride(1))
        stride_r = (residual.stride(0), residual.stride(1)) if residual is not None else (0, 0)
    else:
        num_tokens, num_heads = x.shape[0], 1
        stride_x = (x.stride(0), 0)
        stride_r = (residual.stride(0), 0) if residual is not None else (0, 0)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out if residual is None else (out, residual_out)

    hidden_padded = triton.next_power_of_2(hidden)
    block_r = _rows_per_program(hidden)
    grid = (triton.cdiv(num_rows, block_r),)
    on = use_pdl(x, pdl)
    _rms_norm_kernel[grid](
        x, residual if residual is not None else x, weight, out,
        residual_out,
        num_rows, eps, stride_x[0], stride_x[1], stride_r[0], stride_r[1],
        NUM_HEADS=num_heads, HIDDEN=hidden, HIDDEN_PADDED=hidden_padded, BLOCK_R=block_r,
        HAS_RESIDUAL=residual is not None, USE_PDL=on,
        num_warps=4 if block_r * hidden_padded <= 4096 else 8, launch_pdl=on)
    return out if residual is None else (out, residual_out)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, the same ops as RMSNorm.forward_native."""
    if residual is not None:
        x = x + residual
        residual = x
    orig_dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    x = (x32 * torch.rsqrt(variance + eps)).to(orig_dtype)
    x = weight * x
    return x if residual is None else (x, residual)
