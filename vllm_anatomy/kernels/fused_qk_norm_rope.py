"""fused_qk_norm_rope: Qwen3's per-head q/k RMSNorm and RoPE, in place on the qkv output, in one launch.

Mirrors vLLM's fused_qk_norm_rope op (vllm/_custom_ops.py, CUDA source
csrc/fused_qknorm_rope_kernel.cu; the Helion version
vllm/kernels/helion/ops/fused_qk_norm_rope.py states its semantics), which
v0.27.1's QKNormRoPEFusionPass (vllm/compilation/passes/fusion/
qk_norm_rope_fusion.py) substitutes for `split -> q_norm -> k_norm ->
rotary_embedding` when `pass_config.enable_qk_norm_rope_fusion` is on. Same
signature and contract: qkv is written in place (q and k columns; v untouched),
nothing is returned.

Numerics: those of our unfused path, op for op (vllm_anatomy/kernels/rms_norm.py then
vllm_anatomy/kernels/rotary_embedding.py; the torch layers' forward_native), so the fused
and unfused results differ only by the order of the fp32 sum of squares:

    var = mean(x.float() ** 2)                          fp32, per (token, head)
    xn  = (x.float() * rsqrt(var + eps)).to(dtype)      rounded *before* the weight
    y   = (w.float() * xn.float()).to(dtype)            what q_norm / k_norm hand over
    cos, sin = cos_sin_cache[pos].to(dtype)             the table is fp32
    out1 = round(round(y1 * cos) - round(y2 * sin))     (y1, y2) a rotated pair
    out2 = round(round(y2 * cos) + round(y1 * sin))

Pairs: neox style (y[i], y[i + rotary_dim / 2]); GPT-J style (y[2i], y[2i + 1]);
i < rotary_dim / 2. Dims from rotary_dim to head_dim are normalized and not
rotated (partial rotary; our get_rope builds rotary_dim == head_dim only).

Memory layout:
    qkv            [T, (nq + nk + nv) * hd]   any row stride, last dim contiguous;
                   q heads at columns [0, nq*hd), k heads at [nq*hd, (nq+nk)*hd)
    q_weight       [hd], k_weight [hd]        qkv's dtype
    cos_sin_cache  [max_position, rotary_dim] = [cos | sin], fp32, rows contiguous
    position_ids   [T] int

Grid: (cdiv(T, BLOCK_T),). One program takes BLOCK_T tokens: it loads their
cos/sin rows once, then for all q heads and then all k heads loads the two
halves of each head ([BLOCK_T, heads, rotary_dim / 2] tiles x1 and x2, plus
the unrotated tail if any), sums their squares for the norm, scales, rotates
and stores them back where they came from. Each element is read once and
written once (the unfused path reads q/k twice and writes them twice, into two
new tensors).

NOTE: why this exists. A profiled 256-sequence Qwen3-0.6B run on an H200
launched 113 `_rms_norm_kernel`s per step (28 layers x input, post-attention,
q_norm, k_norm, + the final norm; ~2 us each, launch-bound) and 28
`_rotary_embedding_kernel`s: q_norm, k_norm and RoPE are three launches per
layer on tiny tensors. This is one (84 -> 28 launches per step).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.launch import check_launchable
from vllm_anatomy.kernels.pdl import pdl_launch_dependents, pdl_wait, use_pdl
from vllm_anatomy.kernels.rotary_embedding import _token_cos_sin


@triton.jit
def _norm_rope_heads(
    x_ptr,                             # first column of these heads in the token's qkv row
    w_ptr,                             # [HEAD_SIZE] norm weight
    tok64, tok_mask, stride_tok, eps,
    cos, sin,                          # [BLOCK_T, 1, ROT_HALF_PADDED] fp32 (rounded to dtype)
    NUM_HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr,
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, ROT_HALF_PADDED: tl.constexpr,
    PASS_PADDED: tl.constexpr,         # next_pow2(HEAD_SIZE - 2 * ROT_HALF), 0 if none
    IS_NEOX: tl.constexpr,
    cache_ptr, stride_cache_head,      # WRITE_CACHE only: [BLOCK_T, 1, 1] each token's cache row
    cache_mask,                        # [BLOCK_T]: tokens with a slot (not -1)
    WRITE_CACHE: tl.constexpr,         # also store the results there (fused_qk_norm_rope_kvcache.py)
    APPLY_NORM: tl.constexpr,          # False: RoPE only, w_ptr and eps unused (fused_rope_kvcache.py)
):
    head = tl.arange(0, HEADS_PADDED)[None, :, None]                       # [1, H, 1]
    i = tl.arange(0, ROT_HALF_PADDED)[None, None, :]                       # [1, 1, R]
    if IS_NEOX:
        d1 = i
        d2 = i + ROT_HALF
    else:
        d1 = 2 * i
        d2 = 2 * i + 1
    head_mask = tok_mask[:, None, None] & (head < NUM_HEADS)
    rot_mask = i < ROT_HALF
    mask = head_mask & rot_mask
    base = x_ptr + tok64[:, None, None] * stride_tok + head * HEAD_SIZE   # [T, H, 1]
    dtype = x_ptr.dtype.element_ty
    # NOTE: upcast at the load (the interpreter's bf16 arithmetic is wrong,
    # and the norm sums in fp32 anyway). Masked lanes read 0: they add nothing.
    x1 = tl.load(base + d1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + d2, mask=mask, other=0.0).to(tl.float32)
    if PASS_PADDED > 0:    # dims past rotary_dim: normalized (if APPLY_NORM), not rotated
        p = 2 * ROT_HALF + tl.arange(0, PASS_PADDED)[None, None, :]
        pmask = head_mask & (p < HEAD_SIZE)
        x3 = tl.load(base + p, mask=pmask, other=0.0).to(tl.float32)
    if APPLY_NORM:
        sum_sq = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)        # [T, H]
        if PASS_PADDED > 0:
            sum_sq += tl.sum(x3 * x3, axis=2)
        rstd = tl.rsqrt(sum_sq / HEAD_SIZE + eps)[:, :, None]             # [T, H, 1]
        # RMSNorm, rounded as the torch layer rounds: to dtype before the weight, then after.
        w1 = tl.load(w_ptr + d1, mask=rot_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + d2, mask=rot_mask, other=0.0).to(tl.float32)
        y1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        y2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    else:
        # NOTE: RoPE only (Llama): x1, x2 are the loaded dtype values, exact in fp32, so the
        # rotation below is rotary_embedding.py's _rotate_heads, op for op.
        y1 = x1
        y2 = x2
    # RoPE: each product rounded to dtype before the sum, as torch's separate ops round it.
    o1 = (y1 * cos).to(dtype).to(tl.float32) - (y2 * sin).to(dtype).to(tl.float32)
    o2 = (y2 * cos).to(dtype).to(tl.float32) + (y1 * sin).to(dtype).to(tl.float32)
    tl.store(base + d1, o1.to(dtype), mask=mask)
    tl.store(base + d2, o2.to(dtype), mask=mask)
    if WRITE_CACHE:    # the same rounded values, converted as reshape_and_cache converts them
        cache_dtype = cache_ptr.dtype.element_ty
        cache_row = cache_ptr + head * stride_cache_head                   # [T, H, 1]
        cmask = mask & cache_mask[:, None, None]
        tl.store(cache_row + d1, o1.to(dtype).to(cache_dtype), mask=cmask)
        tl.store(cache_row + d2, o2.to(dtype).to(cache_dtype), mask=cmask)
    if PASS_PADDED > 0:
        if APPLY_NORM:
            w3 = tl.load(w_ptr + p, mask=p < HEAD_SIZE, other=0.0).to(tl.float32)
            y3 = w3 * (x3 * rstd).to(dtype).to(tl.float32)
            tl.store(base + p, y3.to(dtype), mask=pmask)
        else:              # unchanged in qkv: only the cache gets a copy
            y3 = x3
        if WRITE_CACHE:
            tl.store(cache_row + p, y3.to(dtype).to(cache_dtype), mask=pmask & cache_mask[:, None, None])


@triton.jit(do_not_specialize=["num_tokens"])   # per-step sizes: see launch.py
def _fused_qk_norm_rope_kernel(
    qkv_ptr,                           # [T, (nq + nk + nv) * hd], row stride below
    positions_ptr,                     # [T]
    q_weight_ptr, k_weight_ptr,        # [hd] each
    cos_sin_ptr,                       # [max_position, 2 * ROT_HALF] fp32
    num_tokens, eps,
    stride_qkv_tok, stride_cos_sin,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PADDED: tl.constexpr,
    NUM_K_HEADS: tl.constexpr, K_HEADS_PADDED: tl.constexpr,
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, ROT_HALF_PADDED: tl.constexpr,
    PASS_PADDED: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,             # launched with PDL (pdl.py): wait before any load or store
):
    pdl_wait(USE_PDL)
    tok64, tok_mask, cos, sin = _token_cos_sin(positions_ptr, cos_sin_ptr, num_tokens, stride_cos_sin,
                                               qkv_ptr, ROT_HALF, ROT_HALF_PADDED, BLOCK_T)
    _norm_rope_heads(qkv_ptr, q_weight_ptr, tok64, tok_mask, stride_qkv_tok, eps, cos, sin,
                     NUM_Q_HEADS, Q_HEADS_PADDED, HEAD_SIZE, ROT_HALF, ROT_HALF_PADDED,
                     PASS_PADDED, IS_NEOX, qkv_ptr, 0, tok_mask, False, True)
    pdl_launch_dependents(USE_PDL)     # q done, k left: the next kernel may launch
    _norm_rope_heads(qkv_ptr + NUM_Q_HEADS * HEAD_SIZE, k_weight_ptr, tok64, tok_mask,
                     stride_qkv_tok, eps, cos, sin,
                     NUM_K_HEADS, K_HEADS_PADDED, HEAD_SIZE, ROT_HALF, ROT_HALF_PADDED,
                     PASS_PADDED, IS_NEOX, qkv_ptr, 0, tok_mask, False, True)


def _tokens_per_program(num_heads_q: int, num_heads_k: int, head_dim: int) -> int:
    # NOTE: ~4 K elements of q and k per program, a power of two (as
    # vllm_anatomy/kernels/rotary_embedding.py). Qwen3-0.6B (16 + 8 heads of 128): one
    # token per program, 256 programs for a batch of 256.
    row = (triton.next_power_of_2(num_heads_q) + triton.next_power_of_2(num_heads_k)) \
        * triton.next_power_of_2(head_dim)
    n = max(1, min(64, 4096 // row))
    return 1 << (n.bit_length() - 1)


def launch_grid(num_tokens: int, num_heads_q: int, num_heads_k: int, head_dim: int) -> tuple[int]:
    """One program per BLOCK_T tokens (for tracing)."""
    return (triton.cdiv(num_tokens, _tokens_per_program(num_heads_q, num_heads_k, head_dim)),)


def fused_qk_norm_rope(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                       head_dim: int, eps: float, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       cos_sin_cache: torch.Tensor, is_neox: bool,
                       position_ids: torch.Tensor, *, pdl: bool = False) -> None:
    """RMSNorm each q and k head of qkv [T, (nq + nk + nv) * head_dim], then RoPE them; in place.

    vLLM's signature (vllm/_custom_ops.py fused_qk_norm_rope, less its
    forced_token_heads_per_warp tuning knob). v is not touched.
    pdl: the VLLM_ANATOMY_PDL switch as the caller read it (kernels/pdl.py; same results).
    """
    args = _checked_args(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                         cos_sin_cache, is_neox, position_ids, _fused_qk_norm_rope_kernel)
    if args is None:
        return
    grid, tensors, constexprs = args
    position_ids, q_w, k_w, cos_sin_cache = tensors
    _fused_qk_norm_rope_kernel[grid](
        qkv, position_ids, q_w, k_w, cos_sin_cache, qkv.shape[0], eps,
        qkv.stride(0), cos_sin_cache.stride(0), **constexprs, **pdl_args(qkv, pdl), num_warps=4)


def pdl_args(qkv: torch.Tensor, pdl: bool) -> dict:
    """USE_PDL and launch_pdl for a launch on qkv (kernels/pdl.py), shared with the KV-cache kernel."""
    on = use_pdl(qkv, pdl)
    return dict(USE_PDL=on, launch_pdl=on)


def _checked_args(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                  head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                  cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor, kernel
                  ) -> tuple[tuple[int], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                               torch.Tensor], dict] | None:
    """Check the arguments; (grid, (position_ids, q_weight, k_weight, cos_sin_cache) made
    contiguous, the kernel's constexprs), or None for an empty batch. Shared with
    fused_qk_norm_rope_kvcache.py, whose kernel takes the same norm/RoPE constexprs (there
    both weights may be None: RoPE only, for fused_rope_kvcache.py)."""
    assert qkv.dim() == 2, "qkv must be [num_tokens, (nq + nk + nv) * head_dim]"
    num_tokens = qkv.shape[0]
    assert qkv.shape[1] == (num_heads_q + num_heads_k + num_heads_v) * head_dim
    assert qkv.stride(-1) == 1, "qkv's last dim must be contiguous (it is written in place)"
    assert position_ids.dim() == 1 and position_ids.shape[0] == num_tokens
    assert (q_weight is None) == (k_weight is None), "both norm weights, or neither (RoPE only)"
    if q_weight is not None and k_weight is not None:
        assert q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,)
        assert q_weight.dtype == qkv.dtype and k_weight.dtype == qkv.dtype, \
            "norm weights must be in qkv's dtype (the result is written back into qkv)"
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    assert cos_sin_cache.dim() == 2
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    check_launchable(qkv, kernel)
    if num_tokens == 0:
        return None
    position_ids = position_ids.contiguous()     # a slice of the runner's buffer: already is
    cos_sin_cache = cos_sin_cache.contiguous()
    rot_half = rotary_dim // 2
    pass_dims = head_dim - rotary_dim
    block_t = _tokens_per_program(num_heads_q, num_heads_k, head_dim)
    constexprs = dict(
        NUM_Q_HEADS=num_heads_q, Q_HEADS_PADDED=triton.next_power_of_2(num_heads_q),
        NUM_K_HEADS=num_heads_k, K_HEADS_PADDED=triton.next_power_of_2(num_heads_k),
        HEAD_SIZE=head_dim, ROT_HALF=rot_half, ROT_HALF_PADDED=triton.next_power_of_2(rot_half),
        PASS_PADDED=triton.next_power_of_2(pass_dims) if pass_dims > 0 else 0,
        IS_NEOX=is_neox, BLOCK_T=block_t)
    return (triton.cdiv(num_tokens, block_t),), (position_ids, q_weight, k_weight, cos_sin_cache), constexprs


def fused_qk_norm_rope_ref(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int,
                           num_heads_v: int, head_dim: int, eps: float, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool,
                           position_ids: torch.Tensor) -> None:
    """Plain torch, in place: the unfused ops (RMSNorm.forward_native on each head,
    then RotaryEmbedding.forward_native), copied back into qkv as vLLM's baseline does."""
    from vllm_anatomy.kernels.rms_norm import rms_norm_ref
    from vllm_anatomy.kernels.rotary_embedding import rotary_embedding_ref
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads_q * head_dim, num_heads_k * head_dim
    q, k, _ = qkv.split([q_size, kv_size, num_heads_v * head_dim], dim=-1)
    q_normed = rms_norm_ref(q.view(num_tokens, num_heads_q, head_dim), q_weight, eps)
    k_normed = rms_norm_ref(k.view(num_tokens, num_heads_k, head_dim), k_weight, eps)
    assert isinstance(q_normed, torch.Tensor) and isinstance(k_normed, torch.Tensor)
    q_out, k_out = rotary_embedding_ref(position_ids, q_normed.reshape(num_tokens, q_size),
                                        k_normed.reshape(num_tokens, kv_size), cos_sin_cache,
                                        head_dim, is_neox)
    q.copy_(q_out)
    k.copy_(k_out)
