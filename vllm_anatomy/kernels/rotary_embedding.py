"""rotary_embedding: RoPE on the query and key of a step, both in one launch.

Mirrors vLLM's rotary_embedding op (csrc/pos_encoding_kernels.cu), which
RotaryEmbedding.forward_cuda calls, with the numerics of our torch layer
(vllm_anatomy/model_executor/layers/rotary_embedding.py, RotaryEmbedding.forward_native):
cos and sin are looked up in the fp32 table and cast to the query's dtype, and
every product and sum is rounded to that dtype as torch's separate elementwise
ops round it:

    out1 = round(round(x1 * cos) - round(x2 * sin))
    out2 = round(round(x2 * cos) + round(x1 * sin))

Pairs: neox style (x1, x2) = (x[i], x[i + rotary_dim / 2]); GPT-J style
(x[2i], x[2i + 1]); i < rotary_dim / 2. Dims from rotary_dim to head_size are
copied unchanged (vLLM's partial rotary; our torch layer only builds
rotary_dim == head_size, so the layer only calls this kernel in that case).

Memory layout:
    positions      [T] int (int64 from the runner)
    query          [T, nh * hd]   any row stride, last dim contiguous
    key            [T, nkv * hd]  (both usually column slices of the qkv output)
    cos_sin_cache  [max_position, rotary_dim] = [cos | sin], fp32, rows contiguous
    returns        NEW contiguous (query [T, nh * hd], key [T, nkv * hd]) in
                   query's dtype; the inputs are not modified (torch returns
                   new tensors too, so callers need no care).

Grid: (cdiv(T, BLOCK_T),). One program handles BLOCK_T tokens: it loads their
cos/sin rows once ([BLOCK_T, rotary_dim / 2] each) and rotates all query heads
([BLOCK_T, nh, rotary_dim / 2] tiles) and then all key heads with them.

NOTE: why this exists. GPU profiling of a decode step (Qwen3-0.6B shape,
batch 256, inside a CUDA graph) found ~59 kernels per decoder layer (1,656 per
step; 26,496 over 16 steps; 9.1 ms of GPU busy time per step); the plain-torch
RoPE alone is 16 launches per layer (index_select, cast, then mul, mul, sub,
mul, mul, add, cat for q and again for k), each a few microseconds even inside
a graph. This kernel is one launch for q and k together.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.launch import check_launchable


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, tok64, tok_mask, stride_x_tok,
    cos, sin,                          # [BLOCK_T, 1, ROT_HALF_PADDED] fp32 (rounded to dtype)
    NUM_HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr,
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, ROT_HALF_PADDED: tl.constexpr,
    PASS_PADDED: tl.constexpr,         # next_pow2(HEAD_SIZE - 2 * ROT_HALF), 0 if none
    IS_NEOX: tl.constexpr,
):
    head = tl.arange(0, HEADS_PADDED)[None, :, None]                       # [1, H, 1]
    i = tl.arange(0, ROT_HALF_PADDED)[None, None, :]                       # [1, 1, R]
    if IS_NEOX:
        d1 = i
        d2 = i + ROT_HALF
    else:
        d1 = 2 * i
        d2 = 2 * i + 1
    tok_mask = tok_mask[:, None, None]
    head_mask = tok_mask & (head < NUM_HEADS)
    mask = head_mask & (i < ROT_HALF)
    src = x_ptr + tok64[:, None, None] * stride_x_tok + head * HEAD_SIZE
    dst = out_ptr + tok64[:, None, None] * (NUM_HEADS * HEAD_SIZE) + head * HEAD_SIZE
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(src + d1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + d2, mask=mask, other=0.0).to(tl.float32)
    # NOTE: each product is rounded to the activation dtype before the sum,
    # as torch's separate mul and sub kernels round it (no-ops for fp32).
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(dst + d1, o1.to(dtype), mask=mask)
    tl.store(dst + d2, o2.to(dtype), mask=mask)
    if PASS_PADDED > 0:    # dims past rotary_dim: copied through
        p = 2 * ROT_HALF + tl.arange(0, PASS_PADDED)[None, None, :]
        pmask = head_mask & (p < HEAD_SIZE)
        tl.store(dst + p, tl.load(src + p, mask=pmask), mask=pmask)


@triton.jit
def _token_cos_sin(positions_ptr, cos_sin_ptr, num_tokens, stride_cos_sin, like_ptr,
                   ROT_HALF: tl.constexpr, ROT_HALF_PADDED: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's BLOCK_T tokens and the cos, sin rows of their positions,
    [BLOCK_T, 1, ROT_HALF_PADDED] fp32 (a head axis to broadcast over)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)               # [BLOCK_T]
    tok_mask = tok < num_tokens
    pos = tl.load(positions_ptr + tok, mask=tok_mask, other=0).to(tl.int64)
    i = tl.arange(0, ROT_HALF_PADDED)[None, :]
    cs_mask = tok_mask[:, None] & (i < ROT_HALF)
    cs = cos_sin_ptr + pos[:, None] * stride_cos_sin + i                    # [BLOCK_T, R]
    # NOTE: cast to the activations' dtype first, as the torch layer does.
    dtype = like_ptr.dtype.element_ty
    cos = tl.load(cs, mask=cs_mask, other=0.0).to(dtype).to(tl.float32)[:, None, :]
    sin = tl.load(cs + ROT_HALF, mask=cs_mask, other=0.0).to(dtype).to(tl.float32)[:, None, :]
    return tok.to(tl.int64), tok_mask, cos, sin


@triton.jit(do_not_specialize=["num_tokens"])   # per-step sizes: see launch.py
def _rotary_embedding_kernel(
    positions_ptr,                     # [T]
    q_ptr, k_ptr,                      # [T, nh * hd], [T, nkv * hd]; row strides below
    cos_sin_ptr,                       # [max_position, 2 * ROT_HALF] fp32
    q_out_ptr, k_out_ptr,              # contiguous
    num_tokens,
    stride_q_tok, stride_k_tok, stride_cos_sin,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PADDED: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PADDED: tl.constexpr,
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, ROT_HALF_PADDED: tl.constexpr,
    PASS_PADDED: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tok64, tok_mask, cos, sin = _token_cos_sin(positions_ptr, cos_sin_ptr, num_tokens, stride_cos_sin,
                                               q_out_ptr, ROT_HALF, ROT_HALF_PADDED, BLOCK_T)
    _rotate_heads(q_ptr, q_out_ptr, tok64, tok_mask, stride_q_tok, cos, sin,
                  NUM_Q_HEADS, Q_HEADS_PADDED, HEAD_SIZE, ROT_HALF, ROT_HALF_PADDED,
                  PASS_PADDED, IS_NEOX)
    _rotate_heads(k_ptr, k_out_ptr, tok64, tok_mask, stride_k_tok, cos, sin,
                  NUM_KV_HEADS, KV_HEADS_PADDED, HEAD_SIZE, ROT_HALF, ROT_HALF_PADDED,
                  PASS_PADDED, IS_NEOX)


def _tokens_per_program(num_heads: int, num_kv_heads: int, head_size: int) -> int:
    # NOTE: ~4 K elements of q and k per program, rounded down to a power of
    # two. Qwen3-0.6B (16 + 8 heads of 128): one token per program, 256
    # programs for a batch of 256.
    row = (triton.next_power_of_2(num_heads) + triton.next_power_of_2(num_kv_heads)) \
        * triton.next_power_of_2(head_size)
    n = max(1, min(64, 4096 // row))
    return 1 << (n.bit_length() - 1)


def launch_grid(num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int) -> tuple[int]:
    """One program per BLOCK_T tokens (for tracing)."""
    return (triton.cdiv(num_tokens, _tokens_per_program(num_heads, num_kv_heads, head_size)),)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int,
                     is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of query [T, nh * head_size] and key [T, nkv * head_size] -> new (query, key)."""
    assert positions.dim() == 1
    num_tokens = positions.shape[0]
    positions = positions.contiguous()  # a slice of the runner's buffer: already is
    assert query.dim() == 2 and key.dim() == 2
    assert query.shape[0] == num_tokens and key.shape[0] == num_tokens
    assert query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0
    assert query.dtype == key.dtype, "query and key must share a dtype"
    rotary_dim = cos_sin_cache.shape[-1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_size
    if query.stride(-1) != 1:
        query = query.contiguous()     # NOTE: never the case for the model's inputs
    if key.stride(-1) != 1:
        key = key.contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    check_launchable(query, _rotary_embedding_kernel)
    num_heads = query.shape[1] // head_size
    num_kv_heads = key.shape[1] // head_size
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    rot_half = rotary_dim // 2
    pass_dims = head_size - rotary_dim
    block_t = _tokens_per_program(num_heads, num_kv_heads, head_size)
    grid = (triton.cdiv(num_tokens, block_t),)
    _rotary_embedding_kernel[grid](
        positions, query, key, cos_sin_cache, q_out, k_out, num_tokens,
        query.stride(0), key.stride(0), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_heads, Q_HEADS_PADDED=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size, ROT_HALF=rot_half,
        ROT_HALF_PADDED=triton.next_power_of_2(rot_half),
        PASS_PADDED=triton.next_power_of_2(pass_dims) if pass_dims > 0 else 0,
        IS_NEOX=is_neox_style, BLOCK_T=block_t, num_warps=4)
    return q_out, k_out


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_size: int,
                         is_neox_style: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the ops of RotaryEmbedding.forward_native, plus the partial
    rotary case (rotary_dim < head_size: the dims past rotary_dim pass through)."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos_sin = cos_sin_cache.index_select(0, positions)               # [T, rotary_dim]
    cos, sin = cos_sin.to(query.dtype).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                    # [T, 1, rotary_dim / 2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, head_size)
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        if is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1).reshape(num_tokens, -1)

    return rotate(query), rotate(key)
