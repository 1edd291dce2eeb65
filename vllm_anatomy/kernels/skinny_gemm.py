"""skinny_gemm: y = x @ W.T (+ b) for the few-token matmuls of decode steps, split along K.

The CUDA counterpart of what vLLM does on ROCm for the same shapes:
vllm/model_executor/layers/utils.py (rocm_unquantized_gemm_impl) sends a linear layer's
matmul to its skinny kernels (ops.wvSplitK for up to 5 tokens, ops.wvSplitKrc, split-K
with a reduce count, for 10-128) behind VLLM_ROCM_USE_SKINNY_GEMM; on CUDA vLLM calls
F.linear (cuBLAS). Ours is reached the same way, through the layer's `gemm`
(model_executor/layers/utils.py: dispatch_unquantized_gemm), behind VLLM_ANATOMY_SKINNY_GEMM.

Shapes (one tensor-parallel rank's shard; nothing here knows about ranks):
    x       [..., K]   bf16 / fp16 / fp32, last dim contiguous, any row stride
    weight  [N, K]     same dtype, contiguous (the checkpoint's layout; the tied lm_head's
                       is the embedding table [V, H])
    bias    [N] or None
    out     [..., N]   NEW contiguous tensor in x's dtype; fp32 accumulation, the bias
                       added in fp32 before the one rounding
M = x.numel() // K tokens, from 1 up to a few hundred (the kernel is correct for any M;
it is meant for M <= 256, where F.linear's tiles leave most of a Hopper GPU idle).

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits). Program (i, j, s) multiplies the
[BLOCK_M, K/splits] slice of x's rows i by the [BLOCK_N, K/splits] slice of W's rows j.
The M tiles sit on the fastest grid axis, so the programs that read the same W tile
run side by side and all but the first find it in L2: W crosses HBM once.
With splits == 1 a program writes its tile of y; otherwise it writes its fp32 partial
tile to a workspace [splits, M, N], and the tile is finished by one of two reductions
(config.reduce): "serial", in the same launch, by whichever program of the tile arrives
last (counted with an int32 atomic, which also resets the count for the next launch),
or "kernel", by a second small launch over all of y. Either one sums the partials in
split order 0, 1, ..., adds the bias, casts and stores.

SWAP_AB computes the tile transposed, acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T: the long
side (W's rows) on the MMA's M side, the few tokens on its N side (Hopper's wgmma is
64 rows by 8..256 columns; tl.dot's sides are at least 16). TMA loads both tiles through
host-built tensor descriptors (triton.tools.tensor_descriptor) instead of pointers.

NOTE: why split-K. A decode step of Qwen3-0.6B multiplies at most 256 tokens by
matrices of 1024-6144 rows (and the 151,936-row lm_head). Tiled 128 x 128 as cuBLAS
tiles large problems, o_proj and down_proj (N = 1024) give 8-16 tiles, i.e. 8-16 busy
SMs of 132, each streaming 0.5-1 MB of weight: latency-bound, far from the copy rate
(the H200 profile, bench/results/gpu_breakdown_h200.json: 1.01 s of cuBLAS GEMMs in
131,876 launches, 7.7 us each on average, ~30 us per layer, where reading a layer's 31 MB
of weights at 4.8 TB/s takes ~6.5 us). Cutting K into
`splits` pieces multiplies the programs by `splits` with the same bytes read in all, so
a tile count x splits of about one or two waves of SMs keeps the whole chip reading.
The price is the partial tiles (splits x M x N fp32, mostly from L2) and their sum,
which is why the split shrinks as M grows (config_for_tiles).

NOTE: why deterministic. A greedy token must not change from one run to the next, and
fp32 addition is not associative: accumulating the partials with fp32 atomics (the
usual split-K epilogue) adds them in whatever order the programs finish, so the same
step could round differently on every run. Here every partial is computed by one
program in a fixed K order, and the partials are summed in split order whichever
program sums them: the result depends only on the shapes and the config, which the
host picks from shapes alone (pick_config), so a CUDA graph replays it bit for bit.
The atomic counter decides only *who* sums, never in which order.

NOTE: why configs come from a host table and not from triton.autotune: the engine
captures CUDA graphs, one per batch size, and a capture may neither time candidates
nor sync the host. pick_config is a pure function of (M, N, K, dtype, SM count),
so the grid of every captured launch is fixed by shapes; bench/skinny_gemm.py sweeps
candidates on a GPU and prints rows for TUNED_CONFIGS.

NOTE: with PDL (VLLM_ANATOMY_PDL, kernels/pdl.py, sm_90+) a launch may start while the
kernel before it (the norm, the activation, attention: x's producer) still runs. A program
then first prefetches its own slice of W into L2 (the weight is constant, the one input
allowed before the wait, and only read), waits (pdl_wait), and only then reads x, the
partials or the counters and writes anything; it lets the next kernel launch after its main
loop. The "kernel" reduction waits first. The arithmetic and its order are untouched: the
results are those of the switch off, bit for bit.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from vllm_anatomy.kernels.launch import check_launchable, is_interpreted
from vllm_anatomy.kernels.pdl import pdl_launch_dependents, pdl_wait, prefetch_l2, use_pdl

REDUCE_MODES = ("serial", "kernel")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
M_BUCKETS = (16, 32, 64, 128, 256)
HOPPER_SMS = 132                        # H100 / H200 SXM: the count assumed off a GPU


@triton.jit
def _store_tile(out_ptr, bias_ptr, acc, idx_m, idx_n, mask, N, HAS_BIAS: tl.constexpr):
    """acc (+ bias) rounded to out's dtype, at out[idx_m, idx_n] of the contiguous [M, N] out
    (idx_m, idx_n: a row and a column of indices, broadcast to acc's shape)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + idx_n, mask=idx_n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx_m.to(tl.int64) * N + idx_n, acc.to(out_ptr.dtype.element_ty), mask=mask)


# NOTE: the per-step size M and the split arguments are not specialised (launch.py), so one
# compiled variant per config serves every batch size and every split count.
@triton.jit(do_not_specialize=["M", "k_per_split", "num_splits"])
def _skinny_gemm_kernel(
    x_ptr,                     # [M, K], row stride stride_xm
    w_ptr,                     # [N, K], row stride stride_wn
    out_ptr,                   # [M, N] contiguous, x's dtype (SPLIT == "none")
    bias_ptr,                  # [N] (HAS_BIAS)
    partial_ptr,               # [num_splits, M, N] fp32 (SPLIT != "none")
    counter_ptr,               # [>= tiles] int32, zero between launches (SPLIT == "serial")
    x_desc, w_desc,            # TMA: host descriptors of x and W; else unused (the tensors)
    M, N, K,
    k_per_split,               # a multiple of BLOCK_K; split s covers K [s * k_per_split, (s+1) * k_per_split)
    num_splits,
    split_size,                # M * N: one partial (specialised: divisible by 16 when N is, for vector stores)
    stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,       # "none" | "serial" | "kernel"
    SWAP_AB: tl.constexpr,     # acc is [BLOCK_N, BLOCK_M] = W_tile @ x_tile.T
    TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,      # K % BLOCK_K == 0: no mask along K
    DOT_FP32: tl.constexpr,    # fp32 input, or the interpreter: dots in fp32 ("ieee")
    USE_PDL: tl.constexpr,     # launched with PDL (pdl.py): prefetch W into L2, then wait
    PF_LINES: tl.constexpr,    # 128-byte lines in a BLOCK_K row segment of W (at least 1)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: the hint keeps the loads vectorised: k_per_split is not specialised, so without it
    # the compiler could not tell that each row's first column is 16-byte aligned.
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_end = tl.minimum(K, k_start + k_per_split)

    # Rows past M or N are read again from row (index % M) or (index % N): in bounds with no
    # mask, and their results are never stored.
    rows_x = (offs_m % M).to(tl.int64)
    rows_w = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + (k_start + offs_k)[None, :]
    if USE_PDL:
        # NOTE: with PDL this runs while the previous kernel (the norm or activation that
        # produces x) still does: the weight is a constant input, so its slice of this
        # program, [BLOCK_N, k_start:k_end), may be pulled into L2 before the wait, one
        # prefetch per 128-byte line (columns clamped to K - 1: always in bounds). Nothing
        # else is read, and nothing written, before pdl_wait (pdl.py, NOTE (a)).
        pf_cols = tl.arange(0, PF_LINES) * (BLOCK_K // PF_LINES)
        for kk in range(k_start, k_end, BLOCK_K):
            prefetch_l2(w_ptr + rows_w[:, None] * stride_wn + tl.minimum(kk + pf_cols, K - 1)[None, :], USE_PDL)
    pdl_wait(USE_PDL)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K):
        if TMA:
            # Out-of-bounds rows and columns of a descriptor's box read as zeros.
            x = x_desc.load([pid_m * BLOCK_M, k])
            w = w_desc.load([pid_n * BLOCK_N, k])
        elif EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            in_k = (k + offs_k < K)[None, :]
            x = tl.load(x_ptrs, mask=in_k, other=0.0)
            w = tl.load(w_ptrs, mask=in_k, other=0.0)
        if DOT_FP32:   # fp32 input, or the interpreter (its bf16 arithmetic is wrong): upcast after the load
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(x), acc)            # bf16/fp16 in, fp32 out
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    pdl_launch_dependents(USE_PDL)      # after the main loop (pdl.py, NOTE (b))

    # Indices of acc's elements in y, in acc's orientation.
    if SWAP_AB:
        idx_m = offs_m[None, :]
        idx_n = offs_n[:, None]
    else:
        idx_m = offs_m[:, None]
        idx_n = offs_n[None, :]
    mask = (idx_m < M) & (idx_n < N)
    if SPLIT == "none":
        _store_tile(out_ptr, bias_ptr, acc, idx_m, idx_n, mask, N, HAS_BIAS)
    else:
        tile = idx_m.to(tl.int64) * N + idx_n                  # offsets in one [M, N] partial
        tl.store(partial_ptr + pid_k.to(tl.int64) * split_size + tile, acc, mask=mask)
        if SPLIT == "serial":
            # NOTE: every thread's partial is stored before the barrier; the atomic (one
            # thread, acq_rel at GPU scope) then publishes them all and, for the last of
            # the tile's programs, makes the others' partials visible. Only the sum below
            # decides the rounding, and its order is fixed.
            tl.debug_barrier()
            counter = counter_ptr + pid_n * tl.num_programs(0) + pid_m
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                total = tl.zeros(acc.shape, dtype=tl.float32)
                partials = partial_ptr + tile                  # split 0's; a pointer steps in 64 bits
                for _ in range(0, num_splits):
                    # .cg: from L2, never a stale L1 line of an earlier launch
                    total += tl.load(partials, mask=mask, other=0.0, cache_modifier=".cg")
                    partials += split_size
                tl.atomic_xchg(counter, 0)                     # zero again for the next launch
                _store_tile(out_ptr, bias_ptr, total, idx_m, idx_n, mask, N, HAS_BIAS)


@triton.jit(do_not_specialize=["num_splits"])
def _splitk_reduce_kernel(
    partial_ptr,               # [num_splits, M, N] fp32
    out_ptr,                   # [M, N] contiguous
    bias_ptr,                  # [N] (HAS_BIAS)
    num_elements, N, num_splits,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,     # launched with PDL (pdl.py): the partials are the GEMM's, wait first
):
    pdl_wait(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_elements
    total = tl.zeros([BLOCK], dtype=tl.float32)
    partials = partial_ptr + offs
    for _ in range(0, num_splits):                 # split order: the same sum as "serial"
        total += tl.load(partials, mask=mask, other=0.0)
        partials += num_elements
    pdl_launch_dependents(USE_PDL)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


# =====================================================================================
# Host side: configs, the table, the wrapper, the reference
# =====================================================================================

@dataclass(frozen=True)
class SkinnyGemmConfig:
    """One launch configuration (host ints only)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1               # asked for; capped so that no split is empty (launch_splits)
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    tma: bool = False              # used where x and W rows are 16-byte aligned (else pointers)
    reduce: str = "serial"         # how split tiles are summed: REDUCE_MODES

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest side), got {value}")
        if self.split_k < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad split_k / num_warps / num_stages in {self}")
        if self.reduce not in REDUCE_MODES:
            raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {self.reduce!r}")

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k} s{self.split_k} w{self.num_warps} "
                f"st{self.num_stages}" + (" swap" if self.swap_ab else "") + (" tma" if self.tma else "")
                + (f" {self.reduce}" if self.split_k > 1 else ""))


def m_bucket(m: int) -> int:
    """The table's row for M tokens: the next of M_BUCKETS at or above M (the last beyond)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def launch_splits(cfg: SkinnyGemmConfig, k: int) -> tuple[int, int]:
    """(k_per_split, splits): split_k pieces of whole BLOCK_K steps, none of them empty."""
    k_steps = triton.cdiv(k, cfg.block_k)
    steps_per_split = triton.cdiv(k_steps, min(cfg.split_k, k_steps))
    return steps_per_split * cfg.block_k, triton.cdiv(k_steps, steps_per_split)


def launch_grid(m: int, n: int, k: int, cfg: SkinnyGemmConfig) -> tuple[int, int, int]:
    """(M tiles, N tiles, splits)."""
    return triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), launch_splits(cfg, k)[1]


# NOTE: cached: a pure function of host ints, asked by every linear layer of every eager step
# (a graph replay asks nothing); the config is frozen, so sharing it is safe.
@functools.cache
def default_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int = HOPPER_SMS) -> SkinnyGemmConfig:
    """The first-principles choice for shapes TUNED_CONFIGS has no row for.

    NOTE: the rules. Up to 64 tokens the tile is transposed (swap_ab: W's rows on the
    MMA's 64-row side) and as tall as the bucket, so that one program covers every token
    and W is read once; from 128 tokens, plain tiles of 128 rows. BLOCK_N 128 when that
    alone gives a wave of programs (the lm_head), else 64. BLOCK_K 128 (64 for fp32:
    tests, the interpreter). The rest as config_for_tiles.
    """
    bucket = m_bucket(m)
    block_m = min(bucket, 128)
    block_n = 128 if triton.cdiv(m, block_m) * triton.cdiv(n, 128) >= num_sms else 64
    block_k = 64 if dtype == torch.float32 else 128
    return config_for_tiles(m, n, k, block_m, block_n, block_k, bucket <= 64, dtype, num_sms)


def config_for_tiles(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, swap_ab: bool,
                     dtype: torch.dtype, num_sms: int = HOPPER_SMS) -> SkinnyGemmConfig:
    """Split, stages and warps for given tiles (default_config's second half; the benchmark's
    sweep fills its tile candidates with it).

    NOTE: K is split in powers of two until tiles x splits reach one wave of SMs, keeping
    at least two BLOCK_K steps per split (something to pipeline), 16 splits at most, and
    partials that weigh no more than the weights they save reading slowly: splits x M x N
    fp32 <= N x K of W (at 256 tokens and K = 1024, two splits; at 16 tokens, any).
    Stages: as many as fit in ~160 KB of shared memory, 2 to 4. 8 warps from 128 x 128 tiles.
    """
    elem = 4 if dtype == torch.float32 else 2
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    split_k = 1
    while (split_k < 16 and tiles * split_k < num_sms and k_steps // (2 * split_k) >= 2
           and 2 * split_k * m * 4 <= k * elem):
        split_k *= 2
    stage_bytes = (block_m + block_n) * block_k * elem
    num_stages = max(2, min(4, (160 * 1024) // stage_bytes))
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    return SkinnyGemmConfig(block_m, block_n, block_k, split_k, num_warps, num_stages, swap_ab)


# Measured rows: (N, K, M bucket) -> config, for bf16/fp16 on Hopper (sm_90), or None where
# cuBLAS measured faster (the layer's gemm then calls F.linear for those shapes: prefers_cublas).
# Printed by bench/skinny_gemm.py ("rows for TUNED_CONFIGS") on an H100 80GB HBM3 (2026-12-07,
# bench/results/skinny_gemm_h100.json): Qwen3-0.6B's decode shapes, timed with the weights past
# L2, the best of each bucket's sweep against cuBLAS over the bucket's Ms (1/4/16, 32, 64, 128,
# 192/256). The kernel won 10 of 25: down_proj up to 64 tokens (split-K 4, 6-12 % under cuBLAS),
# gate_up at 17-64 (4-7 %), qkv at 17-32 (1 %) and the lm_head up to 128 (1-4 %); cuBLAS kept the rest.
# With VLLM_ANATOMY_SKINNY_GEMM=tuned (the default) only the config rows take the kernel; with
# =1 shapes without a row take default_config (see its NOTE).
TUNED_CONFIGS: dict[tuple[int, int, int], SkinnyGemmConfig | None] = {
    (4096, 1024, 16): None,
    (4096, 1024, 32): SkinnyGemmConfig(16, 64, 128, split_k=1, num_warps=4, num_stages=4, swap_ab=True, tma=False, reduce='serial'),
    (4096, 1024, 64): None,
    (4096, 1024, 128): None,
    (4096, 1024, 256): None,
    (1024, 2048, 16): None,
    (1024, 2048, 32): None,
    (1024, 2048, 64): None,
    (1024, 2048, 128): None,
    (1024, 2048, 256): None,
    (6144, 1024, 16): None,
    (6144, 1024, 32): SkinnyGemmConfig(16, 64, 128, split_k=1, num_warps=4, num_stages=4, swap_ab=True, tma=True, reduce='serial'),
    (6144, 1024, 64): SkinnyGemmConfig(32, 64, 128, split_k=1, num_warps=4, num_stages=4, swap_ab=True, tma=True, reduce='serial'),
    (6144, 1024, 128): None,
    (6144, 1024, 256): None,
    (1024, 3072, 16): SkinnyGemmConfig(16, 64, 256, split_k=4, num_warps=4, num_stages=4, swap_ab=True, tma=False, reduce='serial'),
    (1024, 3072, 32): SkinnyGemmConfig(16, 64, 256, split_k=4, num_warps=4, num_stages=4, swap_ab=True, tma=False, reduce='serial'),
    (1024, 3072, 64): SkinnyGemmConfig(32, 64, 256, split_k=4, num_warps=4, num_stages=4, swap_ab=True, tma=False, reduce='serial'),
    (1024, 3072, 128): None,
    (1024, 3072, 256): None,
    (151936, 1024, 16): SkinnyGemmConfig(16, 128, 128, split_k=1, num_warps=8, num_stages=2, swap_ab=True, tma=False, reduce='serial'),
    (151936, 1024, 32): SkinnyGemmConfig(32, 64, 128, split_k=1, num_warps=4, num_stages=2, swap_ab=True, tma=False, reduce='serial'),
    (151936, 1024, 64): SkinnyGemmConfig(64, 64, 64, split_k=1, num_warps=4, num_stages=5, swap_ab=False, tma=False, reduce='serial'),
    (151936, 1024, 128): SkinnyGemmConfig(128, 64, 64, split_k=1, num_warps=4, num_stages=4, swap_ab=True, tma=True, reduce='serial'),
    (151936, 1024, 256): None,
}


def prefers_cublas(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """True where TUNED_CONFIGS holds None for this shape's bucket: F.linear was faster there."""
    key = (n, k, m_bucket(m))
    return dtype != torch.float32 and key in TUNED_CONFIGS and TUNED_CONFIGS[key] is None


def has_tuned_row(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """True where TUNED_CONFIGS holds a config for this shape's bucket: the kernel measured
    faster than cuBLAS there (what VLLM_ANATOMY_SKINNY_GEMM=tuned runs)."""
    return dtype != torch.float32 and TUNED_CONFIGS.get((n, k, m_bucket(m))) is not None


def takes_skinny(m: int, n: int, k: int, dtype: torch.dtype, tuned_only: bool) -> bool:
    """Whether a layer's gemm runs this matmul (of at most VLLM_ANATOMY_SKINNY_GEMM_MAX_M
    tokens) through the kernel: at "tuned" where its bucket's row is a config, at "1"
    everywhere but where the row is None (prefers_cublas)."""
    return has_tuned_row(m, n, k, dtype) if tuned_only else not prefers_cublas(m, n, k, dtype)


def tuned_buckets(n: int, k: int) -> list[int]:
    """The M buckets of an [N, K] weight that TUNED_CONFIGS sends to the kernel (16-bit types)."""
    return [b for b in M_BUCKETS if TUNED_CONFIGS.get((n, k, b)) is not None]


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int = HOPPER_SMS) -> SkinnyGemmConfig:
    """The config for an [m, k] x [n, k]^T matmul: a pure function of host ints."""
    if dtype != torch.float32:
        tuned = TUNED_CONFIGS.get((n, k, m_bucket(m)))
        if tuned is not None:
            return tuned
    return default_config(m, n, k, dtype, num_sms)


@functools.cache
def num_sms_of(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (HOPPER_SMS off a GPU: the interpreter)."""
    if device.type != "cuda":
        return HOPPER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def new_counters(n: int, max_m: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 counter per output tile of the smallest tiles (16 x 16) at up to
    max_m tokens: enough for any config. A layer keeps its own (see skinny_gemm)."""
    return torch.zeros(triton.cdiv(max_m, 16) * triton.cdiv(n, 16), dtype=torch.int32, device=device)


def prefetch_lines(block_k: int, element_size: int) -> int:
    """128-byte lines in BLOCK_K elements of a W row (at least 1): the PDL prefetch's width."""
    return max(1, block_k * element_size // 128)


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA reads rows starting 16-byte aligned (base and row stride)."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                config: SkinnyGemmConfig | None = None, counters: torch.Tensor | None = None,
                pdl: bool = False) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> a new [..., N] in x's dtype.

    config: pick_config's by default (the benchmark passes others). counters: the
    caller's zeroed int32 tile counters for the "serial" reduction (new_counters; they
    are left zeroed), reused launch after launch by one layer; without them a zeroed
    tensor is made per call (a memset more). pdl: the VLLM_ANATOMY_PDL switch as the caller
    read it (kernels/pdl.py: launched with PDL where use_pdl says so; the same results).
    Never syncs the host: safe to capture.
    """
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"x [..., {k}] and weight {tuple(weight.shape)} do not multiply")
    n = weight.shape[0]
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and weight must share one of {DTYPES}, got {x.dtype} and {weight.dtype}")
    if weight.stride(1) != 1 or x.stride(-1) != 1:
        raise ValueError("weight and x need a contiguous last dimension")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    out_shape = x.shape[:-1] + (n,)
    x2 = x.reshape(-1, k) if x.dim() != 2 else x
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(out_shape)
    check_launchable(x2, _skinny_gemm_kernel)
    cfg = config or pick_config(m, n, k, x.dtype, num_sms_of(x.device))
    k_per_split, splits = launch_splits(cfg, k)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    split = "none" if splits == 1 else cfg.reduce
    partial = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if split == "serial":
        tiles = grid[0] * grid[1]
        if counters is None:
            counters = torch.zeros(tiles, dtype=torch.int32, device=x.device)
        elif counters.numel() < tiles or counters.dtype != torch.int32:
            raise ValueError(f"counters: need {tiles} int32, got {counters.numel()} {counters.dtype}")
    tma = cfg.tma and _tma_ok(x2) and _tma_ok(weight)
    on = use_pdl(x2, pdl)
    descs: tuple = (x2, weight)
    if tma:
        descs = (TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [cfg.block_m, cfg.block_k]),
                 TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [cfg.block_n, cfg.block_k]))
    _skinny_gemm_kernel[grid](
        x2, weight, out, bias if bias is not None else out, partial,
        counters if counters is not None else out, *descs,
        m, n, k, k_per_split, splits, m * n, x2.stride(0), weight.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split,
        SWAP_AB=cfg.swap_ab, TMA=tma, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        DOT_FP32=x.dtype == torch.float32 or is_interpreted(_skinny_gemm_kernel),
        USE_PDL=on, PF_LINES=prefetch_lines(cfg.block_k, weight.element_size()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=on)
    if split == "kernel":
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            partial, out, bias if bias is not None else out, m * n, n, splits,
            BLOCK=block, HAS_BIAS=bias is not None, USE_PDL=on, num_warps=4, launch_pdl=on)
    return out.view(out_shape)


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: the product and the bias in fp32, rounded once to x's dtype."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
