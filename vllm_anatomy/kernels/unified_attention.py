"""unified_attention: one launch for a flat batch of prefill chunks and decodes.

Mirrors vllm/v1/attention/ops/triton_unified_attention.py (the 2D kernel).
Nothing distinguishes prefill from decode: request i owns query tokens
query_start_loc[i] .. query_start_loc[i+1]-1 (query_len of them) and has
seq_len = seq_lens[i] tokens of K/V in the paged cache (context_len =
seq_len - query_len written by earlier steps, then this step's query_len).
Query token j of the request sits at position context_len + j and sees keys
0 .. context_len + j (causal). A decode is query_len == 1.

Memory layout:
    query, output   [T, num_heads, head_dim]        last dim contiguous
    key_cache,      [num_blocks, block_size, num_kv_heads, head_dim] each
    value_cache     (kv_cache[0] / kv_cache[1] of abstract.py's layout)
    block_table     [num_seqs, max_blocks_per_seq] int32 physical block ids
    query_start_loc [num_seqs + 1] int32;  seq_lens [num_seqs] int32

GQA packing: the num_queries_per_kv query heads that share one KV head are
computed together, so each K/V tile is loaded once for all of them. A program's
BLOCK_M rows are BLOCK_Q query tokens x num_queries_per_kv heads
(row m -> token m // num_queries_per_kv, head m % num_queries_per_kv).

Grid: (num_kv_heads, T // BLOCK_Q + num_seqs). Axis 1 counts query blocks over
the whole batch; T // BLOCK_Q + num_seqs is an upper bound on
sum_i cdiv(query_len_i, BLOCK_Q) that needs no device->host read. Program
(h, b) finds its request by binary search over query_start_loc (request i's
blocks start at query_start_loc[i] // BLOCK_Q + i), exits if the request has
fewer query blocks, then walks the request's keys TILE_SIZE at a time through
block_table, up to the last key its last query token may see, with an online
softmax (running max M, running sum L, accumulator acc; all fp32). Tiles that
every row sees whole skip the masks; only the tiles on the causal diagonal
(and the sequence's ragged end) pay for them.

Decode-only batches in a given order (seq_order, not vLLM's): the grid is
(num_kv_heads, num_seqs) and program (h, p) serves request seq_order[p], no
search; the caller passes the longest contexts first (why:
attention/backends/decode_order.py).

Split-KV ("3D") decode, vLLM's IS_3D path: see the section "3D: split-KV
decode" below. unified_attention picks it, as vLLM does, only for decode-only
batches (max_seqlen_q == 1) of at most seq_threshold_3D requests, when the
caller hands over the softmax_segm_* buffers (the Triton backend allocates
them once); every other batch runs the 2D kernel above.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.launch import check_launchable, is_interpreted
from vllm_anatomy.kernels.pdl import pdl_launch_dependents, pdl_wait, use_pdl

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq_idx(query_start_loc_ptr, target_idx, num_seqs, BLOCK_Q: tl.constexpr,
                  use_q_block_mode: tl.constexpr):
    """The last request i whose first query block (use_q_block_mode: request i's
    blocks start at query_start_loc[i] // BLOCK_Q + i) or first query token
    (otherwise: query_start_loc[i]) is <= target_idx."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if use_q_block_mode:
            start = start // BLOCK_Q + mid
        if start <= target_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _attend_tile(acc, m_i, l_i, q, tile_start, num_keys, causal_limit,
                 bt_row, k_base, v_base, offs_d, d_mask,
                 stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off, scale_log2,
                 BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr, PAD_D: tl.constexpr,
                 MASKED: tl.constexpr, DOT_FP32: tl.constexpr):
    """One KV tile: keys tile_start .. tile_start + TILE_SIZE - 1 -> updated (acc, M, L).

    MASKED=False is for tiles every row of the block may see entirely (below
    the causal diagonal, inside the sequence): no bounds or causal mask.
    """
    key_pos = tile_start + tl.arange(0, TILE_SIZE)                         # [TILE]
    if MASKED:
        tile_mask = key_pos < num_keys
    else:
        tile_mask = key_pos >= 0                                           # all true
    # NOTE: masked, because reading block_table past the request's last
    # block could run off the end of the table; masked keys load as 0 so no
    # uninitialised cache memory (possibly NaN bits) reaches the dots.
    block = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=tile_mask, other=0).to(tl.int64)
    off = key_pos % BLOCK_SIZE
    # K and V tiles both as [TILE, D]: each key's head_dim values are contiguous
    # in the cache (16-byte vector loads); QK^T takes K transposed (tl.trans).
    k_ptrs = k_base + (block * stride_kc_block + off * stride_kc_off)[:, None] + offs_d[None, :]
    v_ptrs = v_base + (block * stride_vc_block + off * stride_vc_off)[:, None] + offs_d[None, :]
    if MASKED or PAD_D:
        kv_mask = tile_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)                      # [TILE, D]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)                      # [TILE, D]
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if DOT_FP32:
        # NOTE: the Triton interpreter computes bf16 arithmetic wrongly; upcast
        # right after the load (fp32 inputs stay fp32, dots in IEEE fp32).
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")                # [BLOCK_M, TILE]
    else:
        s = tl.dot(q, tl.trans(k))                                         # bf16/fp16 in, fp32 out
    s = s * scale_log2
    if MASKED:
        visible = tile_mask[None, :] & (key_pos[None, :] <= causal_limit[:, None])
        s = tl.where(visible, s, float("-inf"))

    # Online softmax (base 2): rescale what was accumulated so far to the new max.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # NOTE: a row that has seen no visible key yet has max -inf; keep it
    # finite so that exp2(-inf - m) is 0 and not NaN (-inf - -inf).
    m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        # NOTE: P in the value dtype for the tensor cores (as FlashAttention
        # does); the sum L above was taken from the fp32 P.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, tile_lo, tile_hi, num_unmasked_tiles, num_keys, causal_limit,
                  bt_row, k_base, v_base, offs_d, d_mask,
                  stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off, scale_log2,
                  BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr, PAD_D: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """Tiles tile_lo .. tile_hi - 1: first those every row sees whole (no masks), then the rest."""
    for t in range(tile_lo, tl.minimum(tile_hi, num_unmasked_tiles)):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, t * TILE_SIZE, num_keys, causal_limit, bt_row, k_base, v_base,
            offs_d, d_mask, stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
            scale_log2, BLOCK_SIZE, TILE_SIZE, PAD_D, False, DOT_FP32)
    for t in range(tl.maximum(tile_lo, num_unmasked_tiles), tile_hi):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, t * TILE_SIZE, num_keys, causal_limit, bt_row, k_base, v_base,
            offs_d, d_mask, stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off,
            scale_log2, BLOCK_SIZE, TILE_SIZE, PAD_D, True, DOT_FP32)
    return acc, m_i, l_i


@triton.jit
def _load_query_rows(query_ptr, q_start, q_block_local, query_len, kv_head, stride_q_tok, stride_q_head,
                     NUM_QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PADDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                     DOT_FP32: tl.constexpr):
    """One program's rows: BLOCK_Q query tokens x the NUM_QUERIES_PER_KV query heads of
    `kv_head`, row r = (token r // NUM_QUERIES_PER_KV, head r % NUM_QUERIES_PER_KV).
    Returns Q [BLOCK_M, HEAD_DIM_PADDED] and the indices the epilogue stores with."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    query_pos = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV    # [BLOCK_M] index in the query
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV     # [BLOCK_M] query head
    # NOTE: when NUM_QUERIES_PER_KV is not a power of two, BLOCK_M is padded
    # and the last rows would belong to a token of the next block: mask them.
    row_mask = (query_pos < query_len) & (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV)
    d_mask = offs_d < HEAD_DIM
    q_tok = (q_start + query_pos).to(tl.int64)
    q = tl.load(query_ptr + q_tok[:, None] * stride_q_tok + head[:, None] * stride_q_head
                + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    return q, q_tok, head, query_pos, row_mask, offs_d, d_mask


@triton.jit
def _causal_bounds(context_len, q_block_local, query_len, query_pos,
                   BLOCK_Q: tl.constexpr, TILE_SIZE: tl.constexpr):
    """The last query token of this block sees keys up to context_len + its index:
    no tile past that is needed (the causal bound, per block). The first token sees
    keys 0 .. context_len + its index: tiles wholly below that need no mask.
    Returns (num_keys, num_unmasked_tiles, causal_limit [BLOCK_M] last visible key)."""
    last_q = tl.minimum((q_block_local + 1) * BLOCK_Q, query_len) - 1
    num_keys = context_len + last_q + 1
    num_unmasked_tiles = (context_len + q_block_local * BLOCK_Q + 1) // TILE_SIZE
    return num_keys, num_unmasked_tiles, context_len + query_pos


@triton.jit(do_not_specialize=["num_seqs"])   # per-step sizes: see launch.py
def _unified_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    skip_seq_ptr,                                 # [num_seqs] int32, nonzero: another kernel's (HAS_SKIP)
    seq_order_ptr,                                # [num_seqs] int32, program -> request (USE_SEQ_ORDER)
    scale_log2,                                   # softmax_scale * log2(e): we use exp2
    num_seqs,
    stride_q_tok, stride_q_head,
    stride_o_tok, stride_o_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,                     # KV-cache block size
    BLOCK_M: tl.constexpr,                        # rows per program = BLOCK_Q * NUM_QUERIES_PER_KV (padded)
    BLOCK_Q: tl.constexpr,                        # query tokens per program
    TILE_SIZE: tl.constexpr,                      # keys per loop iteration
    DOT_FP32: tl.constexpr,                       # compute the dots in fp32 (fp32 input, interpreter)
    HAS_SKIP: tl.constexpr,                       # skip_seq given: leave those requests' rows alone
    USE_SEQ_ORDER: tl.constexpr,                  # decode-only batch, one program per request in seq_order
    USE_PDL: tl.constexpr,                        # launched with PDL (pdl.py): wait before anything
):
    # NOTE: first, before the early exits below (pdl.py, NOTE (d)).
    pdl_wait(USE_PDL)
    kv_head = tl.program_id(0)
    if USE_SEQ_ORDER:
        # A decode-only batch (every query one token, or none: a CUDA graph's
        # padding request), one program per (KV head, request): program p of
        # axis 1 serves request seq_order[p], the caller's order (longest
        # context first: attention/backends/decode_order.py says why). No search.
        seq_idx = tl.load(seq_order_ptr + tl.program_id(1))
        q_block_global = 0                        # not read: q_block_local is 0 below (constexpr)
    else:
        # NOTE: query blocks in reverse order, KV heads on the fastest grid axis:
        # the GPU starts programs roughly in id order (axis 0 first), and within a
        # prefill the last query blocks see the most keys. So the heaviest blocks
        # of every head start first and the lightest come last, keeping the
        # multiprocessors busy to the end (longest processing time first); the
        # sum of work is unchanged.
        q_block_global = tl.num_programs(1) - 1 - tl.program_id(1)
        seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q, True)
    if HAS_SKIP:
        if tl.load(skip_seq_ptr + seq_idx) != 0:
            return                                # a fresh prefill the prefill kernel computes
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    if USE_SEQ_ORDER:
        q_block_local = 0                         # a decode's only query block
    else:
        q_block_local = q_block_global - (q_start // BLOCK_Q + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    if q_block_local * BLOCK_Q >= query_len:
        return                                    # a surplus program of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len

    q, q_tok, head, query_pos, row_mask, offs_d, d_mask = _load_query_rows(
        query_ptr, q_start, q_block_local, query_len, kv_head, stride_q_tok, stride_q_head,
        NUM_QUERIES_PER_KV, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_M, BLOCK_Q, DOT_FP32)
    num_keys, num_unmasked_tiles, causal_limit = _causal_bounds(
        context_len, q_block_local, query_len, query_pos, BLOCK_Q, TILE_SIZE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)

    bt_row = block_table_ptr + seq_idx.to(tl.int64) * stride_bt
    k_base = key_cache_ptr + kv_head * stride_kc_head
    v_base = value_cache_ptr + kv_head * stride_vc_head
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, 0, tl.cdiv(num_keys, TILE_SIZE), num_unmasked_tiles, num_keys,
        causal_limit, bt_row, k_base, v_base, offs_d, d_mask,
        stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off, scale_log2,
        BLOCK_SIZE, TILE_SIZE, HEAD_DIM != HEAD_DIM_PADDED, DOT_FP32)
    pdl_launch_dependents(USE_PDL)                # after the main loop (pdl.py, NOTE (b))

    out = acc / l_i[:, None]
    o_ptrs = output_ptr + q_tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, out.to(output_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# =====================================================================================
# 3D: split-KV decode (vLLM's IS_3D path of kernel_unified_attention + reduce_segments)
# =====================================================================================
#
# NOTE: what it replaces, when it wins, why it is exact.
# - Replaces the 2D launch for decode-only batches of few requests. The 2D grid
#   has one program per (query block, KV head): 4 decodes x 8 KV heads = 32
#   programs for the 132 multiprocessors of an H200, each walking its whole
#   context alone, so most of the GPU idles and the K/V reads run far below the
#   copy rate. The 3D grid adds an axis of NUM_SEGMENTS_PER_SEQ segments: the
#   program of segment s covers only tiles s * tiles_per_segment ..
#   (s + 1) * tiles_per_segment - 1 of its request, with tiles_per_segment =
#   cdiv(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE) (segments past the end exit).
# - Wins when (sequences x KV heads) is small against the GPU, and with very
#   uneven contexts (the 2D program with the longest context finishes last,
#   alone). It costs a second launch and a round trip of fp32 partials through
#   memory (segments x head_dim floats per query head, small next to the K/V
#   read), so above seq_threshold_3D requests vLLM keeps the 2D kernel.
# - Exact: each segment runs the same online softmax over its own keys and
#   stores, unnormalised, its running max m_s, its sum L_s = sum exp2(s - m_s)
#   and its accumulator acc_s = sum exp2(s - m_s) v. With M = max_s m_s,
#   softmax(s) @ V = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) L_s: the
#   same rescaling the 2D loop applies after every tile, applied once per
#   segment by reduce_segments. Only the order of the fp32 additions changes.
# vLLM compiles both paths from one kernel_unified_attention (an IS_3D
# constexpr); here the 3D one is a kernel of its own, so the 2D kernel reads
# without branches. They share _attend_tiles (the loop over K/V tiles).

@triton.jit(do_not_specialize=["num_seqs"])   # per-step sizes: see launch.py
def _unified_attention_3d_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr,
    segm_output_ptr, segm_max_ptr, segm_expsum_ptr,   # fp32 partials [T, num_heads, segments(, D)]
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2,
    num_seqs,
    stride_q_tok, stride_q_head,
    stride_so_tok, stride_so_head, stride_so_segm,    # softmax_segm_output
    stride_sm_tok, stride_sm_head,                    # softmax_segm_max / _expsum (segment stride 1)
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    NUM_SEGMENTS_PER_SEQ: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,                        # launched with PDL (pdl.py): wait before anything
):
    pdl_wait(USE_PDL)                             # before the early exits (pdl.py, NOTE (d))
    kv_head = tl.program_id(0)
    q_block_global = tl.program_id(1)
    segm_idx = tl.program_id(2)

    # The same prologue as the 2D kernel: request, query block, rows, Q (_load_query_rows).
    seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q, True)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_block_local = q_block_global - (q_start // BLOCK_Q + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    if q_block_local * BLOCK_Q >= query_len:
        return                                    # a surplus program of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    tiles_per_segment = tl.cdiv(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE)
    if segm_idx * tiles_per_segment * TILE_SIZE >= seq_len:
        return                                    # past the sequence (reduce_segments skips it too)
    context_len = seq_len - query_len

    q, q_tok, head, query_pos, row_mask, offs_d, d_mask = _load_query_rows(
        query_ptr, q_start, q_block_local, query_len, kv_head, stride_q_tok, stride_q_head,
        NUM_QUERIES_PER_KV, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_M, BLOCK_Q, DOT_FP32)
    num_keys, num_unmasked_tiles, causal_limit = _causal_bounds(
        context_len, q_block_local, query_len, query_pos, BLOCK_Q, TILE_SIZE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)

    # Only this segment's tiles (for a decode every key is visible: num_keys == seq_len).
    tile_lo = segm_idx * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, tl.cdiv(num_keys, TILE_SIZE))
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, tile_lo, tile_hi, num_unmasked_tiles, num_keys, causal_limit,
        block_table_ptr + seq_idx.to(tl.int64) * stride_bt,
        key_cache_ptr + kv_head * stride_kc_head, value_cache_ptr + kv_head * stride_vc_head,
        offs_d, d_mask, stride_kc_block, stride_kc_off, stride_vc_block, stride_vc_off, scale_log2,
        BLOCK_SIZE, TILE_SIZE, HEAD_DIM != HEAD_DIM_PADDED, DOT_FP32)
    pdl_launch_dependents(USE_PDL)                # after the main loop (pdl.py, NOTE (b))

    # Partials, not normalised: reduce_segments merges the segments.
    so_ptrs = (segm_output_ptr + q_tok[:, None] * stride_so_tok + head[:, None] * stride_so_head
               + segm_idx * stride_so_segm + offs_d[None, :])
    tl.store(so_ptrs, acc, mask=row_mask[:, None] & d_mask[None, :])
    sm_off = q_tok * stride_sm_tok + head * stride_sm_head + segm_idx
    tl.store(segm_max_ptr + sm_off, m_i, mask=row_mask)
    tl.store(segm_expsum_ptr + sm_off, l_i, mask=row_mask)


@triton.jit(do_not_specialize=["num_seqs"])
def reduce_segments(
    output_ptr, segm_output_ptr, segm_max_ptr, segm_expsum_ptr,
    query_start_loc_ptr, seq_lens_ptr,
    num_seqs,
    stride_o_tok, stride_o_head,
    stride_so_tok, stride_so_head, stride_so_segm,
    stride_sm_tok, stride_sm_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    NUM_SEGMENTS_PER_SEQ: tl.constexpr,
    USE_PDL: tl.constexpr,                        # launched with PDL (pdl.py): wait before anything
):
    """One program per (query token, query head): output = merge of its segments' partials."""
    pdl_wait(USE_PDL)                             # before the early exit (pdl.py, NOTE (d))
    token = tl.program_id(0)
    head = tl.program_id(1)
    seq_idx = _find_seq_idx(query_start_loc_ptr, token, num_seqs, 1, False)
    # NOTE: a padding token of a CUDA-graph-sized batch belongs to no request
    # (the padding requests have query_len 0): the 2D kernel leaves its row
    # alone, and so does this one.
    if token >= tl.load(query_start_loc_ptr + seq_idx + 1):
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    # The segments the attention kernel ran for this request (the others exited).
    tiles_per_segment = tl.cdiv(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE)
    num_segments = tl.cdiv(seq_len, tiles_per_segment * TILE_SIZE)
    offs_s = tl.arange(0, NUM_SEGMENTS_PER_SEQ)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    segm_mask = offs_s < num_segments
    d_mask = offs_d < HEAD_DIM

    sm_off = token.to(tl.int64) * stride_sm_tok + head * stride_sm_head + offs_s
    segm_max = tl.load(segm_max_ptr + sm_off, mask=segm_mask, other=float("-inf"))
    segm_expsum = tl.load(segm_expsum_ptr + sm_off, mask=segm_mask, other=0.0)
    # NOTE: a segment whose keys the row may not see at all (a prefill's causal
    # edge; never a decode) holds L = 0 and a placeholder max: no weight.
    segm_max = tl.where(segm_expsum > 0.0, segm_max, float("-inf"))
    overall_max = tl.max(segm_max, axis=0)
    overall_max = tl.where(overall_max > float("-inf"), overall_max, 0.0)
    weight = tl.exp2(segm_max - overall_max)                              # [SEGMENTS]
    overall_expsum = tl.sum(segm_expsum * weight, axis=0)

    so_ptrs = (segm_output_ptr + token.to(tl.int64) * stride_so_tok + head * stride_so_head
               + offs_s[:, None] * stride_so_segm + offs_d[None, :])
    segm_output = tl.load(so_ptrs, mask=segm_mask[:, None] & d_mask[None, :], other=0.0)
    pdl_launch_dependents(USE_PDL)
    acc = tl.sum(segm_output * weight[:, None], axis=0)                   # [D]
    out = tl.where(overall_expsum == 0.0, 0.0, acc / overall_expsum)
    o_ptrs = output_ptr + token.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(o_ptrs, out.to(output_ptr.dtype.element_ty), mask=d_mask)


# =====================================================================================
# Launch configuration and the host-side wrapper
# =====================================================================================

def pick_config(max_seqlen_q: int, num_queries_per_kv: int, head_dim: int,
                use_3d: bool = False) -> dict:
    """Block shapes for a batch, from host-side ints only (no device read).

    Decode-like batches (short queries): 16 rows per program, the smallest
    tile tl.dot accepts; the kernel is bound by reading K/V and larger row
    blocks would only waste work on absent query tokens. Prefill-heavy
    batches: 64 rows, so each K/V tile feeds a larger matrix product.
    """
    pow2 = triton.next_power_of_2(num_queries_per_kv)
    if use_3d:
        # NOTE: vLLM's decode tile for 16-bit K/V is 16 (_get_tile_size); ours
        # is 64, measured: bench/kernel_bench.py --decode-sweep on an H200
        # (bench/results/decode_split_kv_h200.json), batches 1/4/16 x contexts
        # 1k/4k/8k and 16 decodes of contexts in [100, 2048]: with vLLM's 16
        # segments, tile 64 takes 0.33x the 2D kernel's time (geometric mean),
        # tile 16 0.41x; at 8k x 1 it reads K/V 14x faster than 2D.
        return dict(block_m=max(16, pow2), tile_size=64, num_warps=4, num_stages=2)
    # NOTE: chosen from sweeps on an H200 (bench/kernel_bench.py; Qwen3-0.6B heads,
    # bf16). Decode 256 x 1024: this shape was the fastest in every run.
    # Prefill: 64 x 64 was the fastest for 4 x 4096 tokens and within 7 % of
    # the fastest for 1 x 4096 (which changes from run to run); since heads
    # became the fastest grid axis (heaviest query blocks of all heads first)
    # it reaches 43 % of the matmul rate at 1 x 4096, up from 34 %.
    if max_seqlen_q * num_queries_per_kv <= 16:
        return dict(block_m=max(16, pow2), tile_size=64, num_warps=4, num_stages=2)
    return dict(block_m=max(64, pow2), tile_size=64, num_warps=4, num_stages=2)


def use_3d_kernel(max_seqlen_q: int, num_seqs: int, seq_threshold_3D: int | None) -> bool:
    """vLLM's rule: split-KV only for decode-only batches (every query one token)
    of at most seq_threshold_3D requests. Host ints only."""
    return seq_threshold_3D is not None and max_seqlen_q <= 1 and num_seqs <= seq_threshold_3D


def use_seq_order(max_seqlen_q: int, use_3d: bool, has_seq_order: bool) -> bool:
    """The 2D kernel walks a decode-only batch in the caller's seq_order (host facts only):
    an order was given, the batch is decode-only (every query at most one token: max_seqlen_q,
    exact or an upper bound, is <= 1) and it is not the 3D path's."""
    return has_seq_order and max_seqlen_q <= 1 and not use_3d


def launch_grid(num_tokens: int, num_seqs: int, num_kv_heads: int, block_q: int,
                seq_order: bool = False) -> tuple[int, int]:
    """(KV heads; query blocks, an upper bound needing no device read). With seq_order
    (a decode-only batch walked in a given order): exactly one program per request."""
    return (num_kv_heads, num_seqs if seq_order else num_tokens // block_q + num_seqs)


def default_grid(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, max_seqlen_q: int,
                 num_par_softmax_segments: int | None = None, seq_order: bool = False) -> tuple[int, ...]:
    """The grid unified_attention launches with its default block shapes (for tracing);
    with num_par_softmax_segments (a 3D launch), the segment axis too; seq_order: a
    seq_order was handed over (applied only where use_seq_order says)."""
    num_queries_per_kv = num_heads // num_kv_heads
    use_3d = num_par_softmax_segments is not None
    block_m = pick_config(max_seqlen_q, num_queries_per_kv, head_dim, use_3d)["block_m"]
    grid = launch_grid(num_tokens, num_seqs, num_kv_heads, max(1, block_m // num_queries_per_kv),
                       use_seq_order(max_seqlen_q, use_3d, seq_order))
    return grid + (num_par_softmax_segments,) if num_par_softmax_segments is not None else grid


def unified_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      out: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                      seqused_k: torch.Tensor, max_seqlen_k: int, softmax_scale: float,
                      block_table: torch.Tensor, *,
                      seq_threshold_3D: int | None = None,
                      num_par_softmax_segments: int | None = None,
                      softmax_segm_output: torch.Tensor | None = None,
                      softmax_segm_max: torch.Tensor | None = None,
                      softmax_segm_expsum: torch.Tensor | None = None,
                      skip_seq: torch.Tensor | None = None,
                      seq_order: torch.Tensor | None = None,
                      pdl: bool = False,
                      block_m: int | None = None, tile_size: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Causal paged attention over a flat mixed batch; writes out[:T] (vLLM's argument names).

    q/out [T, nh, hd]; cu_seqlens_q = query_start_loc [R + 1]; seqused_k =
    seq_lens [R]; block_table [R, max_blocks]. max_seqlen_q / max_seqlen_k are
    host ints (vLLM's metadata carries them for the same reason: choosing a
    launch configuration must not read device memory). max_seqlen_k is unused
    here (the loop bound is read per request on the device); kept for the
    signature's sake.

    Split-KV (3D) for a decode-only batch of at most seq_threshold_3D requests,
    as vLLM: with num_par_softmax_segments segments and fp32 buffers
    softmax_segm_output [>= T, nh, >= segments, >= hd] and softmax_segm_max /
    softmax_segm_expsum [>= T, nh, >= segments]. Without them: always 2D.
    skip_seq [R] int32 (2D only): requests with a nonzero entry are left alone
    (their rows not written): the fresh prefills the Triton backend hands to
    the prefill kernel (attention/backends/prefill_split.py); not vLLM's.
    seq_order [>= R] int32 (2D only; not vLLM's): a permutation of 0 .. R-1, the order
    in which a decode-only batch's requests get their programs (the longest context
    first: attention/backends/decode_order.py); ignored unless max_seqlen_q <= 1 and
    the 2D kernel runs. The output does not depend on it.
    pdl: the VLLM_ANATOMY_PDL switch as the caller read it (kernels/pdl.py: every launch
    here with PDL where use_pdl says so; the same results).
    block_m / tile_size / num_warps / num_stages override the chosen path's
    defaults (benchmarks).
    """
    del max_seqlen_k
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = cu_seqlens_q.numel() - 1
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    assert block_table.stride(1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_launchable(q, _unified_attention_kernel)
    interpreted = is_interpreted(_unified_attention_kernel)
    num_queries_per_kv = num_heads // num_kv_heads
    use_3d = (num_par_softmax_segments is not None and softmax_segm_output is not None
              and softmax_segm_max is not None and softmax_segm_expsum is not None
              and skip_seq is None and use_3d_kernel(max_seqlen_q, num_seqs, seq_threshold_3D))
    assert skip_seq is None or (skip_seq.dtype == torch.int32 and skip_seq.numel() >= num_seqs)
    ordered = use_seq_order(max_seqlen_q, use_3d, seq_order is not None)
    assert not ordered or (seq_order is not None and seq_order.dtype == torch.int32
                           and seq_order.numel() >= num_seqs)
    cfg = pick_config(max_seqlen_q, num_queries_per_kv, head_dim, use_3d)
    block_m = block_m or cfg["block_m"]
    tile_size = tile_size or cfg["tile_size"]
    block_q = max(1, block_m // num_queries_per_kv)
    grid = launch_grid(num_tokens, num_seqs, num_kv_heads, block_q, ordered)
    constexprs = dict(
        NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_SIZE=tile_size,
        DOT_FP32=(q.dtype == torch.float32 or interpreted),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"])
    on = use_pdl(q, pdl)
    constexprs.update(USE_PDL=on, launch_pdl=on)
    if not use_3d:
        _unified_attention_kernel[grid](
            q, key_cache, value_cache, out, block_table, cu_seqlens_q, seqused_k,
            skip_seq if skip_seq is not None else seqused_k,
            seq_order if ordered else seqused_k, softmax_scale * LOG2E, num_seqs,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_table.stride(0), HAS_SKIP=skip_seq is not None, USE_SEQ_ORDER=ordered, **constexprs)
        return out

    # 3D: split-KV decode (see the section above), then the merge.
    assert softmax_segm_output is not None and softmax_segm_max is not None \
        and softmax_segm_expsum is not None and num_par_softmax_segments is not None
    segm_output, segm_max, segm_expsum = softmax_segm_output, softmax_segm_max, softmax_segm_expsum
    num_segments = num_par_softmax_segments
    assert num_segments >= 1 and num_segments & (num_segments - 1) == 0, "segments: a power of 2"
    assert segm_output.dtype == segm_max.dtype == segm_expsum.dtype == torch.float32
    assert segm_output.shape[0] >= num_tokens and segm_output.shape[1] == num_heads \
        and segm_output.shape[2] >= num_segments and segm_output.shape[3] >= head_dim
    assert segm_output.stride(3) == 1
    assert segm_max.shape[:2] == segm_output.shape[:2] and segm_max.shape[2] >= num_segments
    assert segm_max.stride() == segm_expsum.stride() and segm_max.stride(2) == 1
    _unified_attention_3d_kernel[grid + (num_segments,)](
        q, key_cache, value_cache, segm_output, segm_max, segm_expsum,
        block_table, cu_seqlens_q, seqused_k,
        softmax_scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1),
        segm_output.stride(0), segm_output.stride(1), segm_output.stride(2),
        segm_max.stride(0), segm_max.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), NUM_SEGMENTS_PER_SEQ=num_segments, **constexprs)
    reduce_segments[(num_tokens, num_heads)](
        out, segm_output, segm_max, segm_expsum, cu_seqlens_q, seqused_k, num_seqs,
        out.stride(0), out.stride(1),
        segm_output.stride(0), segm_output.stride(1), segm_output.stride(2),
        segm_max.stride(0), segm_max.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=constexprs["HEAD_DIM_PADDED"], TILE_SIZE=tile_size,
        NUM_SEGMENTS_PER_SEQ=num_segments, USE_PDL=on, launch_pdl=on)
    return out


def unified_attention_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
                          softmax_scale: float, block_table: torch.Tensor) -> torch.Tensor:
    """Plain torch, one request at a time: gather the request's blocks, causal softmax in fp32."""
    out = torch.zeros_like(q)
    num_heads, block_size = q.shape[1], key_cache.shape[1]
    group = num_heads // key_cache.shape[2]
    qsl, seq_lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    for i, seq_len in enumerate(seq_lens):
        q_start, q_end = qsl[i], qsl[i + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        blocks = block_table[i, :math.ceil(seq_len / block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].float()                # [S, nkv, hd]
        v = value_cache[blocks].flatten(0, 1)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)                                # [S, nh, hd]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), k) * softmax_scale
        query_pos = seq_len - query_len + torch.arange(query_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [nh, q, S]
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
