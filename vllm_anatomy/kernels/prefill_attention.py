"""prefill_attention: causal attention of fresh prefills over their own, contiguous K/V.

Mirrors vllm/v1/attention/ops/triton_prefill_attention.py (context_attention_fwd):
vLLM's op for prompts that have no cached context. A *fresh* prefill is
a request with context_len == 0: all of its K/V is this step's, so it sits in
the step's key/value tensors next to its queries, token for token, and no block
table is needed. Query token j of the request sees keys 0 .. j (causal).
unified_attention.py computes the same thing, reading K/V through the paged
cache; this kernel exists to be faster where prompts are long (see the NOTE in
vllm_anatomy/attention/backends/prefill_split.py for where the engine uses it).

Memory layout (one step's tensors, last dim contiguous, any token/head strides):
    query, output  [T, num_heads, head_dim]
    key, value     [T, num_kv_heads, head_dim]   (the step's new K/V, before or
                                                  after they were written to the cache)
    work_list      [N, 3] int32: (q_start, query_len, q_block) per program row
A request owns tokens q_start .. q_start + query_len - 1 of all four tensors.

Work list (built on the host by prefill_work_list, from host-known lengths):
one item per BLOCK_Q query tokens of one request, sorted by how many keys the
block sees, heaviest first. The grid is (heads, N): heads on the fastest axis,
so the programs of one query block start together and share its K/V through
L2, and the longest blocks of every request start first (longest processing
time first). No surplus programs and no binary search, unlike unified_attention,
whose grid must be bounded without host data.

GQA: packing (pack_gqa=True) computes the NUM_QUERIES_PER_KV query heads of one KV head
in one program (rows = BLOCK_Q tokens x heads, as unified_attention does; each
K/V tile is loaded once for all of them); pack_gqa=False gives every query head
its own programs of BLOCK_M tokens (FlashAttention's choice for long prompts:
larger causal-free blocks; the heads of one KV head share K/V through L2).

Inside a program: the keys of the causal triangle, BLOCK_N at a time, with an
online softmax in base 2 (scale * log2(e) folded into one multiply). Tiles
wholly below the diagonal run without any mask; only the tiles crossing it
pay for the causal mask. TMA picks how K/V tiles are loaded: "off" (the
plain pointer path), "device" (tensor descriptors built in every program,
tl.make_tensor_descriptor) or "host" (descriptors built once per launch on
the host, triton.tools.tensor_descriptor; also loads Q); both go through
Hopper's TMA. WARP_SPECIALIZE lets Triton split the loop into producer
(loads) and consumer (dots) warps; FOLD_SCALE takes the running max on the
raw scores and folds the softmax scale into the exponent's argument (one
FMA per score instead of a multiply and a subtract). All are constexpr
switches beside the plain path, measured by bench/prefill_attention.py.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vllm_anatomy.kernels.launch import check_launchable, is_interpreted

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(key_ptr, value_ptr, k_desc, v_desc, q_start, tile_start, query_len, kv_col,
                  offs_n, offs_d, stride_k_tok, stride_v_tok,
                  MASKED: tl.constexpr, TMA: tl.constexpr, DOT_FP32: tl.constexpr):
    """Keys/values tile_start .. tile_start + BLOCK_N - 1 of the request, each [BLOCK_N, D]."""
    if TMA == "host":
        # NOTE: one descriptor over the whole step ([T, num_kv_heads * D]), so
        # rows past the request's end are the *next* request's keys/values,
        # not zeros. Still exact: the causal mask gives every key_pos >
        # query_pos a zero weight, and rows with query_pos >= query_len are
        # never stored (past T the hardware pads zeros). Only 0 * inf = NaN
        # could leak, from a neighbour whose V overflowed: the diagonal tiles
        # zero the V rows past the end (a select on one or two tiles).
        k = k_desc.load([q_start + tile_start, kv_col])
        v = v_desc.load([q_start + tile_start, kv_col])
        if MASKED:
            v = tl.where((tile_start + offs_n < query_len)[:, None], v, 0.0)
    elif TMA == "device":
        # NOTE: the descriptor's shape ends at the request's last token, so
        # rows past it come back as zeros (the hardware pads), like a masked load.
        k = k_desc.load([q_start + tile_start, 0])
        v = v_desc.load([q_start + tile_start, 0])
    else:
        key_pos = tile_start + offs_n
        tok = (q_start + key_pos).to(tl.int64)
        k_ptrs = key_ptr + tok[:, None] * stride_k_tok + offs_d[None, :]
        v_ptrs = value_ptr + tok[:, None] * stride_v_tok + offs_d[None, :]
        if MASKED:
            # The diagonal tile of the request's last block may run past its last token.
            in_seq = (key_pos < query_len)[:, None]
            k = tl.load(k_ptrs, mask=in_seq, other=0.0)
            v = tl.load(v_ptrs, mask=in_seq, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    if DOT_FP32:   # fp32 input, or the interpreter (its bf16 arithmetic is wrong): upcast after the load
        return k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def _softmax_step(acc, m_i, l_i, q, k, v, scale_log2, tile_start, query_pos, offs_n,
                  MASKED: tl.constexpr, FOLD_SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
    """One tile of the online softmax: (acc, M, L) after keys k / values v."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")               # [BLOCK_M, BLOCK_N]
    else:
        s = tl.dot(q, tl.trans(k))                                        # bf16/fp16 in, fp32 out
    if not FOLD_SCALE:
        s = s * scale_log2
    if MASKED:
        # Causal: row r (query position query_pos[r]) sees key_pos <= query_pos[r].
        # Every row sees key 0, so no row is ever all -inf (no NaN guard needed).
        key_pos = tile_start + offs_n
        s = tl.where(key_pos[None, :] <= query_pos[:, None], s, float("-inf"))
    if FOLD_SCALE:
        # NOTE: scale > 0 keeps the order, so the row max of the raw scores
        # times the scale is the max of the scaled ones, and each score then
        # costs one FMA (s * scale - m) before its exp2 instead of a multiply
        # and a subtract: the softmax, not the dots, bounds Hopper at head_dim 128.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        # NOTE: P in the value dtype for the tensor cores (as FlashAttention
        # does); the sum L above was taken from the fp32 P.
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


# NOTE: no per-step integer argument at all (lengths come through work_list),
# so one compiled variant per config serves every step (see launch.py).
@triton.jit
def _prefill_attention_kernel(
    query_ptr, key_ptr, value_ptr, output_ptr, work_list_ptr,
    q_desc, k_desc, v_desc,                       # TMA == "host": descriptors; else unused (the tensors)
    scale_log2,                                   # softmax_scale * log2(e): we use exp2
    stride_q_tok, stride_q_head,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,                        # rows per program = BLOCK_Q * HEADS_PER_PROGRAM
    BLOCK_Q: tl.constexpr,                        # query tokens per program
    BLOCK_N: tl.constexpr,                        # keys per loop iteration
    HEADS_PER_PROGRAM: tl.constexpr,             # query heads per program (PACK_GQA: the group)
    TMA: tl.constexpr,                            # "off" | "device" | "host"
    Q_DESC: tl.constexpr,                         # load Q through q_desc (host TMA, one head per program)
    WARP_SPECIALIZE: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    item = tl.program_id(1)
    q_start = tl.load(work_list_ptr + item * 3)
    query_len = tl.load(work_list_ptr + item * 3 + 1)
    q_block = tl.load(work_list_ptr + item * 3 + 2)
    # HEADS_PER_PROGRAM: NUM_QUERIES_PER_KV when PACK_GQA, else 1.
    kv_head = tl.program_id(0) * HEADS_PER_PROGRAM // NUM_QUERIES_PER_KV
    first_head = tl.program_id(0) * HEADS_PER_PROGRAM

    # Rows: token m // HEADS_PER_PROGRAM of the block, head first_head + m % HEADS_PER_PROGRAM.
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    query_pos = q_block * BLOCK_Q + offs_m // HEADS_PER_PROGRAM            # [BLOCK_M]
    head = first_head + offs_m % HEADS_PER_PROGRAM                         # [BLOCK_M]
    row_mask = query_pos < query_len
    q_tok = (q_start + query_pos).to(tl.int64)
    if Q_DESC:
        # Rows past the request's end are the next request's queries: their
        # rows are computed (each row on its own) and never stored.
        q = q_desc.load([q_start + q_block * BLOCK_Q, first_head * HEAD_DIM])   # [BLOCK_M, D]
    else:
        q = tl.load(query_ptr + q_tok[:, None] * stride_q_tok + head[:, None] * stride_q_head
                    + offs_d[None, :], mask=row_mask[:, None], other=0.0)     # [BLOCK_M, D]
    if DOT_FP32:
        q = q.to(tl.float32)

    k_base = key_ptr + kv_head * stride_k_head
    v_base = value_ptr + kv_head * stride_v_head
    if TMA == "device":
        k_tiles = tl.make_tensor_descriptor(k_base, shape=[q_start + query_len, HEAD_DIM],
                                            strides=[stride_k_tok, 1], block_shape=[BLOCK_N, HEAD_DIM])
        v_tiles = tl.make_tensor_descriptor(v_base, shape=[q_start + query_len, HEAD_DIM],
                                            strides=[stride_v_tok, 1], block_shape=[BLOCK_N, HEAD_DIM])
    else:
        k_tiles = k_desc   # the host's descriptors, or unused placeholders
        v_tiles = v_desc
    kv_col = kv_head * HEAD_DIM                   # the KV head's columns in the host descriptors' rows

    # Causal bounds of this block: its first token sees keys 0 .. first_q, its
    # last token keys 0 .. last_q. Tiles ending at or before first_q are seen
    # whole by every row (no mask); the ones up to last_q cross the diagonal.
    first_q = q_block * BLOCK_Q
    last_q = tl.minimum(first_q + BLOCK_Q, query_len) - 1
    num_unmasked = (first_q + 1) // BLOCK_N * BLOCK_N
    num_keys = last_q + 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile_start in tl.range(0, num_unmasked, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        tile_start = tl.multiple_of(tile_start, BLOCK_N)
        k, v = _load_kv_tile(k_base, v_base, k_tiles, v_tiles, q_start, tile_start, query_len, kv_col,
                             offs_n, offs_d, stride_k_tok, stride_v_tok, False, TMA, DOT_FP32)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, scale_log2, tile_start, query_pos,
                                      offs_n, False, FOLD_SCALE, DOT_FP32)
    for tile_start in tl.range(num_unmasked, num_keys, BLOCK_N):
        k, v = _load_kv_tile(k_base, v_base, k_tiles, v_tiles, q_start, tile_start, query_len, kv_col,
                             offs_n, offs_d, stride_k_tok, stride_v_tok, True, TMA, DOT_FP32)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, scale_log2, tile_start, query_pos,
                                      offs_n, True, FOLD_SCALE, DOT_FP32)

    # NOTE: the store stays a masked pointer store under every TMA mode: a
    # descriptor store of the request's last block would overwrite the next
    # request's rows (the host descriptor spans the whole step).
    out = acc / l_i[:, None]
    o_ptrs = output_ptr + q_tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, out.to(output_ptr.dtype.element_ty), mask=row_mask[:, None])


# =====================================================================================
# Host side: the work list, the launch configuration, the wrapper
# =====================================================================================

def pick_config(num_queries_per_kv: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Block shapes and switches (host ints only).

    NOTE: one head's block of query rows per program, as FlashAttention's
    forward on Hopper does (with 128-row blocks there); our block shapes are
    what bench/prefill_attention.py measured best (below). fp32
    (tests, the interpreter) uses small tiles: the registers of an fp32
    128 x 128 tile pair would spill.
    """
    if dtype == torch.float32:
        return dict(block_m=32, block_n=32, num_warps=4, num_stages=1, pack_gqa=False,
                    tma="off", warp_specialize=False, fold_scale=False)
    # NOTE: measured on an H200 (bench/prefill_attention.py, bench/results/prefill_attention_h200.json,
    # Qwen3-0.6B heads, bf16, 31 variants): 128 x 128 tiles, 8 warps, 3 stages, K/V (and Q) through
    # host-side tensor descriptors (tma="host") and Triton's warp specialisation reach 63-65 % of the
    # matmul rate at 4k/8k tokens, 1.08x the previous default (64 x 64, 4 warps, device-side
    # descriptors: 58-61 %; unified_attention 42-46 %; cuDNN 54-69 %; vLLM's FlashAttention 3 ran the
    # same 64 x 4096 prefill at ~67 %, bench/results/gpu_breakdown_prefill4096_h200.json). At 512 tokens
    # this shape is worse for a single prompt (10 % against 13-15 %: 128-row blocks leave SMs idle),
    # which is why the backend sends only long fresh prefills here (VLLM_ANATOMY_PREFILL_MIN_LEN).
    # Warp specialisation compiles at 8 warps only (Triton 3.6 and 3.9); TMA needs sm_90 or later.
    if _has_tma():
        return dict(block_m=128, block_n=128, num_warps=8, num_stages=3, pack_gqa=False,
                    tma="host", warp_specialize=True, fold_scale=False)
    return dict(block_m=64, block_n=64, num_warps=4, num_stages=3, pack_gqa=False,
                tma="off", warp_specialize=False, fold_scale=False)


@functools.cache
def _has_tma() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def block_q_of(block_m: int, num_queries_per_kv: int, pack_gqa: bool) -> int:
    """Query tokens per program: BLOCK_M rows of one head, or of the packed group."""
    if not pack_gqa:
        return block_m
    if block_m % num_queries_per_kv:
        raise ValueError(f"pack_gqa needs block_m ({block_m}) divisible by the group ({num_queries_per_kv})")
    return block_m // num_queries_per_kv


def prefill_work_list(b_start_loc: Sequence[int], b_seq_len: Sequence[int], block_q: int) -> torch.Tensor:
    """[N, 3] int32 CPU tensor of (q_start, query_len, q_block), heaviest block first.

    b_start_loc / b_seq_len: host ints, each fresh prefill's first token in the
    step's tensors and its length (vLLM's argument names). Block b of a request
    sees (b + 1) * block_q keys at most; sorting on that (stable: ties keep
    request order) starts the long blocks first."""
    items = [(int(start), int(length), b)
             for start, length in zip(b_start_loc, b_seq_len)
             for b in range(-(-int(length) // block_q))]
    items.sort(key=lambda item: -min((item[2] + 1) * block_q, item[1]))
    return torch.tensor(items, dtype=torch.int32).reshape(-1, 3)


@functools.cache
def default_config(num_queries_per_kv: int, head_dim: int, dtype: torch.dtype) -> Mapping[str, Any]:
    """pick_config for what the kernel will compute in (fp32 in the interpreter), plus its block_q:
    what a caller building the work list ahead of the launch needs (the Triton backend).

    NOTE: asked for by every attention layer of a step with the prefill switch on (the
    backend's split, then context_attention_fwd), always with the same answer for a
    model: computed once, and read-only since it is shared."""
    dot_fp32 = dtype == torch.float32 or is_interpreted(_prefill_attention_kernel)
    cfg = pick_config(num_queries_per_kv, head_dim, torch.float32 if dot_fp32 else dtype)
    return MappingProxyType(dict(cfg, dot_fp32=dot_fp32,
                                 block_q=block_q_of(cfg["block_m"], num_queries_per_kv, cfg["pack_gqa"])))


def launch_grid(num_work_items: int, num_heads: int, num_kv_heads: int, pack_gqa: bool) -> tuple[int, int]:
    """(head programs, work items): KV heads when the group is packed, else query heads."""
    return (num_kv_heads if pack_gqa else num_heads, num_work_items)


TMA_MODES = ("off", "device", "host")

_tma_allocator_set = False


def _ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need scratch memory from a global allocator (set once)."""
    global _tma_allocator_set
    if not _tma_allocator_set:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                         device="cuda"))
        _tma_allocator_set = True


def _check_tma_rows(name: str, t: torch.Tensor, need_packed_heads: bool) -> None:
    """TMA reads rows that start 16-byte aligned (base and token stride); the host descriptors'
    2-D view [tokens, heads * head_dim] also needs each token's heads side by side."""
    if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 or (t.stride(1) * t.element_size()) % 16:
        raise ValueError(f"TMA needs 16-byte aligned {name} rows (data_ptr {t.data_ptr()} , "
                         f"strides {tuple(t.stride())}, {t.element_size()}-byte elements)")
    if need_packed_heads and t.stride(1) != t.shape[2]:
        raise ValueError(f"tma='host' needs {name}'s heads side by side in a token's row "
                         f"(stride(1) == head_dim {t.shape[2]}), got strides {tuple(t.stride())}")


def host_descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int,
                     load_q: bool) -> tuple[Any, TensorDescriptor, TensorDescriptor]:
    """(q_desc, k_desc, v_desc) for tma="host": one descriptor per tensor for the whole launch,
    over its 2-D view [tokens, heads * head_dim] (row stride = the tensor's token stride, e.g.
    the fused qkv row when K/V are its slices); tiles of one head: [block_n or block_m, head_dim].
    q_desc is q itself (an unused placeholder) unless load_q.

    NOTE: why host descriptors. The device-side ones (tma="device") are built by every
    program (two per program, each written to global scratch from triton.set_allocator and
    fenced before its first use); these are encoded once per launch by Triton's launcher on
    the host and passed by value as kernel parameters (a CUDA graph captures them like any
    argument). Their shape spans the whole step, not one request: see _load_kv_tile's NOTE
    for why reading past a request's end stays exact, and why the output store is not one."""
    num_tokens, _, head_dim = k.shape
    for name, t in (("K", k), ("V", v)) + ((("Q", q),) if load_q else ()):
        _check_tma_rows(name, t, need_packed_heads=True)

    def desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
        return TensorDescriptor(t, [t.shape[0], t.shape[1] * head_dim], [t.stride(0), 1], [rows, head_dim])
    return (desc(q, block_m) if load_q else q), desc(k, block_n), desc(v, block_n)


def context_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          b_start_loc: Sequence[int] | None, b_seq_len: Sequence[int] | None,
                          softmax_scale: float, *, work_list: torch.Tensor | None = None,
                          block_m: int | None = None, block_n: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None,
                          pack_gqa: bool | None = None, tma: str | None = None,
                          warp_specialize: bool | None = None, fold_scale: bool | None = None) -> torch.Tensor:
    """Causal attention of each fresh prefill over its own K/V; writes o's rows of those requests.

    q/o [T, nh, hd], k/v [T, nkv, hd] (token and head strides free, last dim
    contiguous; tma="host" also needs the heads of a token side by side). The
    requests: b_start_loc / b_seq_len (host ints; rows of other requests are
    left alone), or a work_list already built by prefill_work_list for this
    config's block_q and on q's device (the Triton backend builds it once per
    step). The keyword overrides (tma: one of TMA_MODES) are for benchmarks.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    assert k.shape[0] >= num_tokens and v.shape == k.shape and o.shape == q.shape
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == o.stride(-1) == 1
    num_queries_per_kv = num_heads // num_kv_heads
    interpreted = is_interpreted(_prefill_attention_kernel)
    cfg = default_config(num_queries_per_kv, head_dim, q.dtype)
    dot_fp32 = cfg["dot_fp32"]
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    pack_gqa = cfg["pack_gqa"] if pack_gqa is None else pack_gqa
    tma = cfg["tma"] if tma is None else tma
    if tma not in TMA_MODES:
        raise ValueError(f"tma must be one of {TMA_MODES}, got {tma!r}")
    warp_specialize = cfg["warp_specialize"] if warp_specialize is None else warp_specialize
    fold_scale = cfg["fold_scale"] if fold_scale is None else fold_scale
    if fold_scale and not softmax_scale > 0:
        raise ValueError(f"fold_scale needs softmax_scale > 0 (it keeps the max's order), got {softmax_scale}")
    block_q = block_q_of(block_m, num_queries_per_kv, pack_gqa)
    if work_list is None:
        if b_start_loc is None or b_seq_len is None:
            raise ValueError("context_attention_fwd needs b_start_loc and b_seq_len, or a work_list")
        work_list = prefill_work_list(b_start_loc, b_seq_len, block_q).to(q.device)
    assert work_list.dtype == torch.int32 and work_list.is_contiguous() and work_list.shape[-1] == 3
    if work_list.shape[0] == 0:
        return o
    check_launchable(q, _prefill_attention_kernel)
    load_q = tma == "host" and not pack_gqa
    descs: tuple[Any, Any, Any] = (q, k, v)            # unused placeholders unless tma == "host"
    if tma == "host":
        descs = host_descriptors(q, k, v, block_m, block_n, load_q)
    elif tma == "device":
        _check_tma_rows("K", k, need_packed_heads=False)
        _check_tma_rows("V", v, need_packed_heads=False)
        if not interpreted:
            _ensure_tma_allocator()
    grid = launch_grid(work_list.shape[0], num_heads, num_kv_heads, pack_gqa)
    _prefill_attention_kernel[grid](
        q, k, v, o, work_list, *descs, softmax_scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HEADS_PER_PROGRAM=num_queries_per_kv if pack_gqa else 1, TMA=tma, Q_DESC=load_q,
        WARP_SPECIALIZE=warp_specialize, FOLD_SCALE=fold_scale,
        DOT_FP32=dot_fp32, num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"])
    return o


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          b_start_loc: Sequence[int], b_seq_len: Sequence[int],
                          softmax_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, one request at a time: causal softmax in fp32 over the request's own K/V.
    Rows of tokens outside the requests are left as they are in `out` (zeros if not given)."""
    out = torch.zeros_like(q) if out is None else out
    group = q.shape[1] // k.shape[1]
    for start, length in zip(b_start_loc, b_seq_len):
        start, length = int(start), int(length)
        if length == 0:
            continue
        rows = slice(start, start + length)
        kk = k[rows].float().repeat_interleave(group, dim=1)                 # [L, nh, hd]
        vv = v[rows].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), kk) * softmax_scale
        pos = torch.arange(length, device=q.device)
        probs = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf")).softmax(dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
    return out
