"""silu_and_mul: the gated activation of a Llama MLP in one launch.

Mirrors vLLM's silu_and_mul (csrc/activation_kernels.cu), which
SiluAndMul.forward_cuda calls, with the numerics of our torch layer
(vllm_anatomy/model_executor/layers/activation.py, SiluAndMul.forward_native):
math in fp32, and silu(gate) rounded to x's dtype before the product, as
torch's separate F.silu and mul kernels round it (no-op for fp32):

    out = round(round(g / (1 + exp(-g))) * u),   g = x[:, :d], u = x[:, d:]

Memory layout:
    x     [T, 2 * d]   any row stride, last dim contiguous (the gate_up_proj
                       output: gate columns, then up columns)
    out   [T, d]       NEW contiguous tensor, x's dtype

Grid: (cdiv(T, BLOCK_T), cdiv(d, BLOCK_D)). One program computes a
[BLOCK_T, BLOCK_D] tile of out from the matching gate and up tiles.

NOTE: why this exists. GPU profiling of a decode step (Qwen3-0.6B shape,
batch 256, inside a CUDA graph) found ~59 kernels per decoder layer (1,656 per
step; 26,496 over 16 steps; 9.1 ms of GPU busy time per step), most of them
tiny elementwise torch ops (norms, RoPE, and here silu + mul), each a few
microseconds even inside a graph. This is one launch instead of two, and the
[T, d] silu intermediate is never written to memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.launch import check_launchable
from vllm_anatomy.kernels.pdl import pdl_launch_dependents, pdl_wait, use_pdl


@triton.jit(do_not_specialize=["num_tokens"])   # per-step sizes: see launch.py
def _silu_and_mul_kernel(
    x_ptr,                 # [T, 2 * d], row stride stride_x_tok
    out_ptr,               # [T, d] contiguous
    num_tokens, d,
    stride_x_tok,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,     # launched with PDL (pdl.py): wait before any load or store
):
    pdl_wait(USE_PDL)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (tok < num_tokens)[:, None] & (col < d)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    src = x_ptr + tok64 * stride_x_tok + col[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(USE_PDL)     # the inputs are read: the next kernel may launch
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + tok64 * d + col[None, :], (silu * up).to(dtype), mask=mask)


def _blocks(num_cols: int) -> tuple[int, int]:
    # NOTE: ~2 K outputs per program (Qwen3-0.6B, d = 3072: 2 tokens x 1024
    # columns, 384 programs for a batch of 256).
    block_d = min(1024, triton.next_power_of_2(num_cols))
    return max(1, min(64, 2048 // block_d)), block_d


def launch_grid(num_tokens: int, d: int) -> tuple[int, int]:
    """(token blocks, column blocks) (for tracing)."""
    block_t, block_d = _blocks(d)
    return (triton.cdiv(num_tokens, block_t), triton.cdiv(d, block_d))


def silu_and_mul(x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:], a new contiguous [..., d].
    pdl: the VLLM_ANATOMY_PDL switch as the caller read it (kernels/pdl.py; same results)."""
    assert x.shape[-1] % 2 == 0
    d = x.shape[-1] // 2
    out_shape = x.shape[:-1] + (d,)
    if x.dim() != 2:
        x = x.reshape(-1, 2 * d)
    if x.stride(-1) != 1:
        x = x.contiguous()             # NOTE: never the case for the model's inputs
    check_launchable(x, _silu_and_mul_kernel)
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    num_tokens = x.shape[0]
    if num_tokens == 0 or d == 0:
        return out
    block_t, block_d = _blocks(d)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(d, block_d))
    on = use_pdl(x, pdl)
    _silu_and_mul_kernel[grid](x, out, num_tokens, d, x.stride(0),
                               BLOCK_T=block_t, BLOCK_D=block_d, USE_PDL=on, num_warps=4, launch_pdl=on)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch, the ops of SiluAndMul.forward_native."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]
