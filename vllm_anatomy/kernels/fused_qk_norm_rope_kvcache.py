"""fused_qk_norm_rope_kvcache: Qwen3's q/k RMSNorm + RoPE in place on qkv, and the step's K/V into the paged cache, in one launch.

Mirrors what v0.27.1's QkNormRopeKvCacheFusionPass (vllm/compilation/passes/
fusion/qk_norm_rope_kvcache_fusion.py, pass_config.fuse_qk_norm_rope_kvcache)
substitutes for `split -> q_norm -> k_norm -> rotary_embedding ->
unified_kv_cache_update`: the custom op fused_qk_norm_rope_and_unified_kv_cache_update,
which calls the attention impl's do_qk_norm_rope_kvcache_update (there only on
ROCm with AITER, and only for batches of at most rope_kvcache_fusion_max_token_num
= 256 tokens). Here: what fused_qk_norm_rope.py does, and then what
reshape_and_cache.py does with its result, so the results are those of the pair,
bit for bit:

    qkv          q and k columns normalized and rotated in place (v untouched),
                 exactly as fused_qk_norm_rope writes them (the same jit helper);
    key_cache    row of slot_mapping[t] <- token t's k as just written into qkv;
    value_cache  row of slot_mapping[t] <- token t's v columns of qkv;
                 slot -1 (a padding token of a CUDA-graph-sized batch): no write.

Memory layout:
    qkv            [T, (nq + nk + nv) * hd]  any row stride, last dim contiguous
    q_weight, k_weight, cos_sin_cache, position_ids: as fused_qk_norm_rope.py
                   (weights None with APPLY_NORM off: fused_rope_kvcache.py, RoPE only)
    key_cache,     [num_blocks, block_size, nk, hd] each (kv_cache[0], kv_cache[1]
    value_cache    of abstract.py's [2, ...] cache; any strides, last dim contiguous)
    slot_mapping   [>= T] int64; token t -> block slot // block_size, offset slot % block_size

Grid: (cdiv(T, BLOCK_T),), fused_qk_norm_rope's. One program takes BLOCK_T
tokens: it finds their slots, normalizes and rotates their q heads (stored into
qkv) and their k heads (stored into qkv and into the key cache row), then copies
their v heads ([BLOCK_T, nv, hd], read once) into the value cache row.

NOTE: why this exists. After fused_qk_norm_rope, a Qwen3 layer's attention
launched reshape_and_cache to copy the k just written (and v) into the cache: a
second tiny, launch-bound kernel per layer (an H200 profile of the benchmark:
28,896 launches, 71 ms; ~2.5 us each at batch 256) that re-reads what the first
one had in registers. Fused, one launch per layer per step goes, and k is read
once. Who takes it (Qwen3's qk-norm path on CUDA, steps of at most 256 tokens,
VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE) and how the attention layer learns the
write is done: vllm_anatomy/compilation/qk_norm_rope_kvcache_fusion.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.fused_qk_norm_rope import _checked_args, _norm_rope_heads, pdl_args
from vllm_anatomy.kernels.pdl import pdl_launch_dependents, pdl_wait
from vllm_anatomy.kernels.rotary_embedding import _token_cos_sin


@triton.jit
def _copy_heads_to_cache(src_ptr, stride_tok, tok64, cache_row, stride_cache_head, valid,
                         NUM_HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr,
                         HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr):
    """[BLOCK_T, heads, head_dim] from qkv's columns at src_ptr into each valid token's cache row."""
    head = tl.arange(0, HEADS_PADDED)[None, :, None]                       # [1, H, 1]
    dim = tl.arange(0, HEAD_SIZE_PADDED)[None, None, :]                    # [1, 1, D]
    mask = valid[:, None, None] & (head < NUM_HEADS) & (dim < HEAD_SIZE)
    x = tl.load(src_ptr + tok64[:, None, None] * stride_tok + head * HEAD_SIZE + dim, mask=mask)
    tl.store(cache_row + head * stride_cache_head + dim, x.to(cache_row.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])   # per-step sizes: see launch.py
def _fused_qk_norm_rope_kvcache_kernel(
    qkv_ptr,                           # [T, (nq + nk + nv) * hd], row stride below
    positions_ptr,                     # [T]
    q_weight_ptr, k_weight_ptr,        # [hd] each
    cos_sin_ptr,                       # [max_position, 2 * ROT_HALF] fp32
    key_cache_ptr, value_cache_ptr,    # [num_blocks, block_size, nk, hd]
    slot_mapping_ptr,                  # [>= T] int64
    num_tokens, eps,
    stride_qkv_tok, stride_cos_sin,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PADDED: tl.constexpr,
    NUM_K_HEADS: tl.constexpr, K_HEADS_PADDED: tl.constexpr,
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, ROT_HALF_PADDED: tl.constexpr,
    PASS_PADDED: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,          # the cache's tokens per block
    HEAD_SIZE_PADDED: tl.constexpr,    # next_pow2(HEAD_SIZE), for the v copy
    USE_PDL: tl.constexpr,             # launched with PDL (pdl.py): wait before any load or store
    APPLY_NORM: tl.constexpr,          # False: RoPE only, no weights (fused_rope_kvcache.py, Llama)
):
    pdl_wait(USE_PDL)
    tok64, tok_mask, cos, sin = _token_cos_sin(positions_ptr, cos_sin_ptr, num_tokens, stride_cos_sin,
                                               qkv_ptr, ROT_HALF, ROT_HALF_PADDED, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + tok64, mask=tok_mask, other=-1).to(tl.int64)
    # NOTE: -1 marks a padding token: never written (as reshape_and_cache.py); its
    # q and k in qkv are still normalized and rotated, as fused_qk_norm_rope does.
    valid = tok_mask & (slot >= 0)
    block = (slot // BLOCK_SIZE)[:, None, None]
    offset = (slot % BLOCK_SIZE)[:, None, None]
    k_row = key_cache_ptr + block * stride_kc_block + offset * stride_kc_off        # [T, 1, 1]
    v_row = value_cache_ptr + block * stride_vc_block + offset * stride_vc_off
    _norm_rope_heads(qkv_ptr, q_weight_ptr, tok64, tok_mask, stride_qkv_tok, eps, cos, sin,
                     NUM_Q_HEADS, Q_HEADS_PADDED, HEAD_SIZE, ROT_HALF, ROT_HALF_PADDED,
                     PASS_PADDED, IS_NEOX, qkv_ptr, 0, tok_mask, False, APPLY_NORM)
    pdl_launch_dependents(USE_PDL)     # q done, k and v left: the next kernel may launch
    _norm_rope_heads(qkv_ptr + NUM_Q_HEADS * HEAD_SIZE, k_weight_ptr, tok64, tok_mask,
                     stride_qkv_tok, eps, cos, sin,
                     NUM_K_HEADS, K_HEADS_PADDED, HEAD_SIZE, ROT_HALF, ROT_HALF_PADDED,
                     PASS_PADDED, IS_NEOX, k_row, stride_kc_head, valid, True, APPLY_NORM)
    _copy_heads_to_cache(qkv_ptr + (NUM_Q_HEADS + NUM_K_HEADS) * HEAD_SIZE, stride_qkv_tok, tok64,
                         v_row, stride_vc_head, valid,
                         NUM_K_HEADS, K_HEADS_PADDED, HEAD_SIZE, HEAD_SIZE_PADDED)


def fused_qk_norm_rope_kvcache(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                               head_dim: int, eps: float, q_weight: torch.Tensor, k_weight: torch.Tensor,
                               cos_sin_cache: torch.Tensor, is_neox: bool, position_ids: torch.Tensor,
                               key_cache: torch.Tensor, value_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, *, pdl: bool = False) -> None:
    """fused_qk_norm_rope(qkv, ...) in place, then k and v of each token into
    key_cache/value_cache [num_blocks, block_size, nk, hd] at slot_mapping[:T] (-1 skipped).

    vLLM's do_qk_norm_rope_kvcache_update, with fused_qk_norm_rope's arguments
    plus the cache and the slots (its q_out/k_out are qkv itself here).
    pdl: the VLLM_ANATOMY_PDL switch as the caller read it (kernels/pdl.py; same results).
    """
    launch_kvcache_kernel(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
                          cos_sin_cache, is_neox, position_ids, key_cache, value_cache, slot_mapping, pdl)


def launch_kvcache_kernel(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                          head_dim: int, eps: float, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, cos_sin_cache: torch.Tensor, is_neox: bool,
                          position_ids: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, pdl: bool) -> None:
    """The launch behind fused_qk_norm_rope_kvcache and fused_rope_kvcache.py: with both norm
    weights the q/k norm runs (APPLY_NORM), with neither (None) only RoPE and the cache write."""
    assert num_heads_v == num_heads_k, "the cache holds as many v heads as k heads"
    assert key_cache.shape[2:] == (num_heads_k, head_dim) and value_cache.shape == key_cache.shape
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "the head_dim axis must be contiguous"
    assert slot_mapping.numel() >= qkv.shape[0]
    args = _checked_args(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, q_weight, k_weight,
                         cos_sin_cache, is_neox, position_ids, _fused_qk_norm_rope_kvcache_kernel)
    if args is None:
        return
    grid, tensors, constexprs = args
    position_ids, q_weight, k_weight, cos_sin_cache = tensors      # (weights None: RoPE only)
    _fused_qk_norm_rope_kvcache_kernel[grid](
        qkv, position_ids, q_weight, k_weight, cos_sin_cache, key_cache, value_cache, slot_mapping,
        qkv.shape[0], eps, qkv.stride(0), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        **constexprs, BLOCK_SIZE=key_cache.shape[1], HEAD_SIZE_PADDED=triton.next_power_of_2(head_dim),
        APPLY_NORM=q_weight is not None, **pdl_args(qkv, pdl), num_warps=4)


def fused_qk_norm_rope_kvcache_ref(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int,
                                   num_heads_v: int, head_dim: int, eps: float, q_weight: torch.Tensor,
                                   k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool,
                                   position_ids: torch.Tensor, key_cache: torch.Tensor,
                                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The unfused pair it replaces, as the model and the backend launch them:
    fused_qk_norm_rope, then reshape_and_cache of qkv's k and v columns."""
    from vllm_anatomy.kernels.fused_qk_norm_rope import fused_qk_norm_rope
    from vllm_anatomy.kernels.reshape_and_cache import reshape_and_cache
    fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
                       cos_sin_cache, is_neox, position_ids)
    num_tokens, q_size, kv_size = qkv.shape[0], num_heads_q * head_dim, num_heads_k * head_dim
    _, k, v = qkv.split([q_size, kv_size, num_heads_v * head_dim], dim=-1)
    reshape_and_cache(k.view(num_tokens, num_heads_k, head_dim), v.view(num_tokens, num_heads_v, head_dim),
                      key_cache, value_cache, slot_mapping)
