"""reshape_and_cache: scatter the step's new keys and values into the paged KV cache.

Mirrors vLLM's reshape_and_cache_flash (csrc/cache_kernels.cu) and its Triton
twin triton_reshape_and_cache_flash (in vllm/v1/attention/ops/), which the
FlashAttention and Triton backends call in do_kv_cache_update before attention.

Memory layout:
    key, value   [T, num_kv_heads, head_dim]   any strides, last dim contiguous
                 (they are usually views into the fused qkv projection output)
    key_cache,   [num_blocks, block_size, num_kv_heads, head_dim] each
    value_cache  (= kv_cache[0], kv_cache[1] of the [2, ...] cache in abstract.py;
                 any strides, last dim contiguous)
    slot_mapping [>= T] int64; token t goes to block slot // block_size,
                 offset slot % block_size; slot -1 (padding) is skipped.

Grid: (cdiv(T, BLOCK_T),). One program copies BLOCK_T tokens: for each, one
row of num_kv_heads * head_dim elements of K and of V (contiguous in the cache:
one slot holds all heads of one token), i.e. two [BLOCK_T, heads, head_dim] tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.launch import check_launchable


@triton.jit(do_not_specialize=["num_tokens"])   # per-step sizes: see launch.py
def _reshape_and_cache_kernel(
    key_ptr, value_ptr,                   # [T, nkv, hd]
    key_cache_ptr, value_cache_ptr,       # [num_blocks, block_size, nkv, hd]
    slot_mapping_ptr,                     # [>= T] int64
    num_tokens,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr,           # next_pow2(NUM_KV_HEADS)
    HEAD_DIM_PADDED: tl.constexpr,        # next_pow2(HEAD_DIM)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)              # [BLOCK_T]
    tok_mask = tok < num_tokens
    slot = tl.load(slot_mapping_ptr + tok, mask=tok_mask, other=-1).to(tl.int64)
    # NOTE: -1 marks padding tokens (a CUDA-graph-sized batch). Writing them
    # would land in a real slot (Python's -1 wraps; here it would be an
    # out-of-bounds address), so they are masked off, never written.
    valid = tok_mask & (slot >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    # A [BLOCK_T, heads, head_dim] tile. NOTE: head and dim stay separate axes
    # (not one flattened row index e -> e // HEAD_DIM, e % HEAD_DIM): with
    # tl.arange on the contiguous last axis the compiler can prove 16-byte
    # contiguity and issue vector loads/stores. (This form moves 3.75 TB/s on
    # an H200, 89 % of a device copy; bench/results/kernels_h200.json.)
    head = tl.arange(0, HEADS_PADDED)[None, :, None]                       # [1, H, 1]
    dim = tl.arange(0, HEAD_DIM_PADDED)[None, None, :]                     # [1, 1, D]
    mask = valid[:, None, None] & (head < NUM_KV_HEADS) & (dim < HEAD_DIM)
    tok64 = tok.to(tl.int64)[:, None, None]
    k = tl.load(key_ptr + tok64 * stride_k_tok + head * stride_k_head + dim, mask=mask)
    v = tl.load(value_ptr + tok64 * stride_v_tok + head * stride_v_head + dim, mask=mask)
    block = block[:, None, None]
    offset = offset[:, None, None]
    kc = key_cache_ptr + block * stride_kc_block + offset * stride_kc_off + head * stride_kc_head + dim
    vc = value_cache_ptr + block * stride_vc_block + offset * stride_vc_off + head * stride_vc_head + dim
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _tokens_per_program(num_kv_heads: int, head_dim: int) -> int:
    # NOTE: ~8 K elements (16 KB of bf16 per tensor) per program: large enough
    # that each program keeps many 16-byte loads in flight, small enough that a
    # decode batch still gives every multiprocessor work.
    row_padded = triton.next_power_of_2(num_kv_heads) * triton.next_power_of_2(head_dim)
    return max(1, min(64, 8192 // row_padded))


def launch_grid(num_tokens: int, num_kv_heads: int, head_dim: int) -> tuple[int]:
    """One program per BLOCK_T tokens (for tracing)."""
    return (triton.cdiv(num_tokens, _tokens_per_program(num_kv_heads, head_dim)),)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, nkv, hd] into key_cache/value_cache at slot_mapping[:T] (skip -1)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = key_cache.shape[1]
    for t in (key, value, key_cache, value_cache):
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
    assert key_cache.shape[2:] == (num_kv_heads, head_dim)
    assert slot_mapping.numel() >= num_tokens
    if num_tokens == 0:
        return
    check_launchable(key, _reshape_and_cache_kernel)
    heads_padded = triton.next_power_of_2(num_kv_heads)
    head_dim_padded = triton.next_power_of_2(head_dim)
    block_t = _tokens_per_program(num_kv_heads, head_dim)
    grid = (triton.cdiv(num_tokens, block_t),)
    _reshape_and_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PADDED=heads_padded,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size, BLOCK_T=block_t, num_warps=4)


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Plain torch: index_put into the flattened (block, offset) slot axis."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens]
    valid = slots >= 0
    key_cache.flatten(0, 1)[slots[valid]] = key[valid].to(key_cache.dtype)
    value_cache.flatten(0, 1)[slots[valid]] = value[valid].to(value_cache.dtype)
