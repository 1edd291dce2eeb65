"""Skinny GEMMs on the GPU: cuBLAS (F.linear) vs vllm_anatomy/kernels/skinny_gemm.py on the
decode shapes of Qwen3-0.6B, and what the per-step total would be with either.

    python bench/skinny_gemm.py --out $OUT/skinny_gemm_h100.json [--budget-s 120] [--jobs 16] [--no-sweep]
    python bench/skinny_gemm.py --in-context --out $OUT/skinny_gemm_incontext_h100.json [--budget-s 60]  # in context
    python bench/skinny_gemm.py --pdl --out $OUT/skinny_gemm_pdl_h100.json [--budget-s 60]  # in context, PDL
    python bench/skinny_gemm.py --tiny --out /tmp/skinny.json      # CPU smoke (Triton interpreter)

Shapes (y[M, N] = x[M, K] @ W[N, K]^T, bf16, no bias): the four matmuls of a decoder layer,
qkv_proj 1024 -> 4096, o_proj 2048 -> 1024, gate_up_proj 1024 -> 6144, down_proj 3072 -> 1024
(x 28 layers), and the tied lm_head 1024 -> 151936 (once per step), at M tokens in
{1, 4, 16, 32, 64, 128, 192, 256}.

Times: median of CUDA-event-timed CUDA-graph replays (bench/kernel_bench.py's time_ms). NOTE:
each graph cycles through enough copies of W to exceed L2 (>= 160 MB of weights), as a decode
step does (a layer's weights are evicted by the 27 others before the next step): timing one W
again and again would measure L2, not HBM, for every matrix but the lm_head. x stays hot.

The sweep (ours): for each shape and M bucket (16, 32, 64, 128, 256; timed at that M), phase A
times tile shapes (BLOCK_M, BLOCK_N in {64, 128}, BLOCK_K in {64, 128, 256}, swapped or not;
split, stages and warps by the kernel's rules: config_for_tiles), phase B varies the best of A
(split count, warps x stages, TMA, the second-launch reduction). Every candidate is compiled
before its phase is timed, in --jobs worker processes that fill Triton's on-disk cache
(the timing process then loads them); a config that fails to compile or run is listed
under compile_failed and skipped. Phases stop adding configs after --budget-s seconds.
Then the table: at every M, cuBLAS, our default (pick_config) and the bucket's best, each
with its max |error| against the fp32 reference and a bit-equality check over 5 runs; per
shape, us, fraction of the copy rate (bytes of W + x + y) and of the matmul rate (2MNK),
speed-up over cuBLAS; per M, the step total (28 x the four layer GEMMs + the lm_head) for
cuBLAS, ours default, ours best, and "dispatch" (the faster of cuBLAS and ours best per
shape, what TUNED_CONFIGS plus the threshold could reach). Last, the best config of every
(shape, bucket) as rows to paste into TUNED_CONFIGS. Copy and matmul rates are measured in
the same run (kernel_bench.py's copy_ceiling and matmul_ceiling). About half a minute on an H100 (16 compile
processes; bench/results/skinny_gemm_h100.json took 22 s, its 60 s sweep budget not reached).

--in-context: every GEMM, ours and cuBLAS, timed in context, as the default engine runs it (no
kernel launched with PDL), and the rows chosen from those times. Why: bench/pdl_layers.py timed a
layer's kernel chain (norm -> qkv -> ... -> down, one CUDA graph) on an H100, PDL off: with the
rows chosen here alone (VLLM_ANATOMY_SKINNY_GEMM=tuned) the chain was SLOWER than with every GEMM
on cuBLAS at 16-64 tokens (bench/results/pdl_layers_h100.json: 31.6 vs 29.5 us per layer at M=16,
31.3 vs 30.0 at 32, 32.6 vs 30.9 at 64), though faster at M=1 (28.06 vs 29.07). A GEMM timed
alone follows a copy of itself; in a step it follows another kernel (a norm, attention, an
activation), and a config that wins the first way may lose the second: rows chosen alone may be
wrong in context, and this mode measures them the second way.
How: inside the captured graph every GEMM launch is preceded by its producer, the engine's own
rms_norm (kernels/rms_norm.py) writing the GEMM's x [M, K] from a hot x_in [M, K]. The producer
alone is timed the same way (a graph of as many norms) and subtracted, so "us" stays the GEMM's
time per launch, comparable with the table without it (each entry also keeps in_context_us and
producer_us). NOTE: the producer is a stand-in for o_proj (x is attention's output, K = 2048) and
down_proj (silu_and_mul's, K = 3072): an rms_norm over K of the same [M, K] size; for qkv_proj,
gate_up_proj and the lm_head (K = hidden = 1024) it is the real one (without the residual add).
W is cycled past L2 as above. The JSON says "in_context": true, "pdl": false, names the producer
and its times (producer, producer_us), and its tuned_rows are those chosen in context: the rows
for the default engine (VLLM_ANATOMY_PDL off).

--pdl: --in-context (implied) with PDL, as the engine runs it with VLLM_ANATOMY_PDL=1. Why: with
PDL (vllm_anatomy/kernels/pdl.py) our kernel launches while the kernel before it still runs,
prefetches its slice of W into L2 and lets the kernel after it launch early; cuBLAS takes no part
(an ordinary launch: a full barrier on both sides, kernels/pdl.py NOTE (c)). Timed alone, back
to back, neither has a PDL neighbour, so the table above undervalues ours wherever PDL is on.
How: as --in-context, with the producer launched with pdl=True (as the engine's norms are,
whatever follows) and ours with pdl=True; cuBLAS as it is. Ours with and without PDL must be
bit-equal (the wait, the trigger and the prefetch move no arithmetic): checked on one config per
shape (pdl_bit_equal). The JSON says "in_context": true, "pdl": true and its tuned_rows are those
chosen in context with PDL: the rows for VLLM_ANATOMY_PDL=1. With --tiny (the interpreter)
nothing can launch with PDL (pdl.py's use_pdl says no): the producer is still timed and
subtracted, and the JSON and the printout say "pdl_effective": false. Without either flag the
JSON says "in_context": false, "pdl": false (each GEMM alone).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import sys
import time
from typing import Any

if "--tiny" in sys.argv:
    # Before any Triton kernel is imported: the interpreter is chosen at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kernel_bench import copy_ceiling, matmul_ceiling, time_ms, write_json  # noqa: E402

from vllm_anatomy.kernels import skinny_gemm as sg  # noqa: E402
from vllm_anatomy.kernels.pdl import use_pdl  # noqa: E402
from vllm_anatomy.kernels.rms_norm import rms_norm  # noqa: E402
from vllm_anatomy.kernels.skinny_gemm import SkinnyGemmConfig  # noqa: E402

NUM_LAYERS = 28
SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
          "down_proj": (1024, 3072), "lm_head": (151936, 1024)}       # name: (N, K)
MS = [1, 4, 16, 32, 64, 128, 192, 256]
TINY_SHAPES = {"qkv_proj": (96, 64), "o_proj": (64, 80), "gate_up_proj": (128, 64), "down_proj": (64, 112),
               "lm_head": (300, 64)}
TINY_MS = [1, 5, 20]
COLD_BYTES = 160 * 2 ** 20             # W copies cycled per graph: more than any Hopper L2
MAX_ERR = 0.05                         # outputs ~N(0, 1): bf16 rounding is <= 0.016 at |y| < 8
REPEATS = 5                            # runs compared bit for bit
SMEM_LIMIT = 227 * 1024                # Hopper's shared memory per block
NORM_EPS = 1e-6                        # the in-context producer's (Qwen3's rms_norm_eps)
COMPILED: set[str] = set()             # variant keys compiled (or loaded) in this run
PRODUCER_US: dict[tuple[int, int, int], float] = {}   # in context: (M, K, per graph) -> the producer alone, us


class Setup:
    """Shapes, dtype, device and timing of a run (the GPU's or the CPU smoke test's), and its mode:
    each GEMM alone (the default), in context (--in-context), or in context with PDL (--pdl)."""

    in_context = False         # --in-context, --pdl: GEMMs timed after their producer (Case.time_us)
    pdl = False                # --pdl: the producer and ours launched with pdl=True
    pdl_effective = False      # ... and PDL really on (use_pdl: a GPU of sm_90+, no interpreter)

    def __init__(self, tiny: bool, in_context: bool = False, pdl: bool = False):
        self.tiny = tiny
        if tiny:
            self.shapes, self.ms, self.dtype, self.device = TINY_SHAPES, TINY_MS, torch.float32, "cpu"
            self.num_sms = sg.HOPPER_SMS
        else:
            self.shapes, self.ms, self.dtype, self.device = SHAPES, MS, torch.bfloat16, "cuda"
            self.num_sms = sg.num_sms_of(torch.device("cuda"))
        self.in_context = in_context or pdl        # NOTE: PDL only exists between neighbours
        self.pdl = pdl
        self.pdl_effective = pdl and use_pdl(torch.empty(1, device=self.device), True)

    @property
    def flag(self) -> str:
        """The mode's flag, for the printout: "--pdl", "--in-context" or "" (each GEMM alone)."""
        return "--pdl" if self.pdl else "--in-context" if self.in_context else ""

    def context_note(self) -> str:
        """What --in-context or --pdl did in this run, for the printout and the JSON."""
        tiny = ("; --tiny: each time is a difference of two interpreter timings, mostly noise (it can be "
                "negative)" if self.tiny else "")
        if not self.pdl:
            return ("each GEMM timed after its producer (rms_norm over K), nothing launched with PDL (the default "
                    "engine, VLLM_ANATOMY_PDL off); the producer alone subtracted" + tiny)
        if self.pdl_effective:
            return ("each GEMM timed after its producer (rms_norm over K), both launched with PDL (cuBLAS "
                    "without: it cannot take part); the producer alone subtracted")
        return ("PDL NOT effective here (the Triton interpreter, the CPU or a GPU before sm_90: use_pdl says "
                "no): each GEMM timed after its producer (rms_norm over K), the producer alone subtracted, "
                "nothing launched with PDL" + tiny)

    def time_us(self, fn, per_graph: int) -> float:
        if self.tiny:
            fn()
            times = []
            # NOTE: in context the least of a few calls: a difference of two interpreter timings
            # (in context minus the producer) is otherwise mostly the CPU's noise.
            for _ in range(REPEATS if self.in_context else 1):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return min(times)
        return 1e3 * time_ms(fn, warmup=2, reps=10, per_graph=per_graph)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


# ------------------------------------------------------------------ ceilings


def ceilings(setup: Setup) -> tuple[dict, dict]:
    if not setup.tiny:
        return copy_ceiling(quick=True), matmul_ceiling()
    src = torch.randn(1 << 20)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    copy_s = time.perf_counter() - t0
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    a @ a
    mm_s = time.perf_counter() - t0
    return ({"bytes": 8 * src.numel(), "ms": copy_s * 1e3, "bytes_per_s": 8 * src.numel() / copy_s},
            {"shape": [256] * 3, "ms": mm_s * 1e3, "flop_per_s": 2 * 256 ** 3 / mm_s})


# ------------------------------------------------------------------ candidates


def bucket_m(setup: Setup, bucket: int) -> int:
    """The M a bucket's sweep is timed at: its largest M of the run (the bucket itself if none)."""
    inside = [m for m in setup.ms if sg.m_bucket(m) == bucket]
    return max(inside) if inside else bucket


def sweep_cases(setup: Setup) -> list[tuple[str, int]]:
    """(shape, bucket) pairs: every bucket some M of the run falls in."""
    buckets = sorted({sg.m_bucket(m) for m in setup.ms})
    return [(name, b) for name in setup.shapes for b in buckets]


def smem_bytes(cfg: SkinnyGemmConfig, elem: int) -> int:
    return (cfg.block_m + cfg.block_n) * cfg.block_k * elem * cfg.num_stages


def phase_a(setup: Setup, name: str, bucket: int) -> list[SkinnyGemmConfig]:
    """The default, then tile shapes filled in by the kernel's rules (config_for_tiles)."""
    n, k = setup.shapes[name]
    m = bucket_m(setup, bucket)
    out = [sg.pick_config(m, n, k, setup.dtype, setup.num_sms)]
    if setup.tiny:
        tiles = [(16, 32, 32, True), (min(bucket, 32), 64, 32, False)]
    else:
        block_ms = sorted({min(bucket, 128), *([64] if bucket >= 128 else []),
                           *([bucket // 2] if 32 <= bucket <= 64 else [])})
        tiles = [(bm, bn, bk, swap) for bm in block_ms for bn in (64, 128) for bk in (64, 128, 256)
                 for swap in (True, False)]
    for bm, bn, bk, swap in tiles:
        cfg = sg.config_for_tiles(m, n, k, bm, bn, bk, swap, setup.dtype, setup.num_sms)
        if cfg not in out and smem_bytes(cfg, setup.dtype.itemsize) <= SMEM_LIMIT:
            out.append(cfg)
    return out


def phase_b(setup: Setup, name: str, bucket: int, best: SkinnyGemmConfig) -> list[SkinnyGemmConfig]:
    """Variations of phase A's best: split count, warps x stages, TMA, the reduction."""
    n, k = setup.shapes[name]
    elem = setup.dtype.itemsize
    k_steps = -(-k // best.block_k)
    out = [dataclasses.replace(best, split_k=s) for s in (1, 2, 4, 8, 16) if s <= k_steps]
    if not setup.tiny:
        out += [dataclasses.replace(best, num_warps=w, num_stages=st) for w in (4, 8) for st in (2, 3, 4, 5)]
    # The second-launch reduction at the best split (at 2 if the best does not split).
    out += [dataclasses.replace(best, tma=True),
            dataclasses.replace(best, reduce="kernel", split_k=max(best.split_k, 2))]
    seen, kept = {best}, []
    for cfg in out:
        if cfg not in seen and smem_bytes(cfg, elem) <= SMEM_LIMIT:
            seen.add(cfg)
            kept.append(cfg)
    return kept


# ------------------------------------------------------------------ compiling in parallel


def variant_key(cfg: SkinnyGemmConfig, k: int) -> str:
    """What Triton compiles a config into on a K: its constexprs (the split count is a runtime
    argument; only whether and how tiles are summed is compiled in). compile_failed's keys."""
    splits = sg.launch_splits(cfg, k)[1]
    return (f"m{cfg.block_m}n{cfg.block_n}k{cfg.block_k} w{cfg.num_warps} st{cfg.num_stages}"
            + (" swap" if cfg.swap_ab else "") + (" tma" if cfg.tma else "")
            + (f" {cfg.reduce}" if splits > 1 else "") + ("" if k % cfg.block_k == 0 else " ragged-K"))


def _compile_one(shape, m: int, dtype: torch.dtype, device: str, cfg: SkinnyGemmConfig,
                 pdl: bool = False) -> str | None:
    """Launch cfg once (compiling it, or loading it from Triton's cache); the error text if it fails.
    pdl: as the timing will launch it (USE_PDL is a constexpr: a variant of its own)."""
    n, k = shape
    try:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        sg.skinny_gemm(x, w, None, config=cfg, counters=sg.new_counters(n, max(m, 16), device), pdl=pdl)
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except Exception as e:                        # out of resources, a compiler error, a launch error
        return f"{type(e).__name__}: {str(e)[:300]}"


def _worker(jobs: list) -> dict[str, str]:
    """One compile process: (shape, M, dtype name, device, config fields, pdl) each launched once."""
    failed = {}
    for shape, m, dtype_name, device, fields, pdl in jobs:
        cfg = SkinnyGemmConfig(**fields)
        err = _compile_one(shape, m, getattr(torch, dtype_name), device, cfg, pdl)
        if err:
            failed[variant_key(cfg, shape[1])] = err
    return failed


def compile_pool(jobs: int):
    """`jobs` spawned compile processes (each with its own CUDA context), or None for jobs <= 1."""
    if jobs <= 1:
        return None
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    return ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))


def precompile(setup: Setup, work: list[tuple[tuple[int, int], int, SkinnyGemmConfig]], pool,
               failed: dict[str, str]) -> int:
    """Compile each variant (variant_key) of `work` not compiled yet, once, on one of its
    shapes; adds those that fail to `failed`. Returns how many were compiled.

    NOTE: in the processes of `pool` when there is one: Triton writes every compiled kernel
    to its on-disk cache, keyed by source, constants and specialisation, and this process
    finds it there at its first launch (a load, not a compile). Compiling is most of a
    sweep's time, and it needs only the CPU cores. A launch that breaks a worker's CUDA
    context fails only there (and the rest of that worker's jobs with it: listed as failed)."""
    todo: dict[str, tuple[tuple[int, int], int, SkinnyGemmConfig]] = {}     # variant_key -> its first (shape, m, cfg)
    for shape, m, cfg in work:
        key = variant_key(cfg, shape[1])
        if key not in COMPILED and key not in failed:
            todo.setdefault(key, (shape, m, cfg))
    unique = list(todo.values())
    if pool is not None and unique:
        dtype_name = str(setup.dtype).split(".")[-1]
        jobs = [[(shape, m, dtype_name, setup.device, dataclasses.asdict(cfg), setup.pdl)]
                for shape, m, cfg in unique]
        try:
            for part in pool.map(_worker, jobs):
                failed.update(part)
            unique = []
        except Exception as e:                    # a broken pool: everything compiles here instead
            print(f"  compile pool failed ({type(e).__name__}: {str(e)[:200]}); compiling in this process")
    for shape, m, cfg in unique:
        err = _compile_one(shape, m, setup.dtype, setup.device, cfg, setup.pdl)
        if err:
            failed[variant_key(cfg, shape[1])] = err
    COMPILED.update(todo)
    return len(todo)


# ------------------------------------------------------------------ one case


class Case:
    """x, cold copies of W, the fp32 reference and the tile counters of one (shape, M); in context
    (--in-context, --pdl) also the producer of x (an rms_norm over K of a hot x_in, see the module
    docstring)."""

    def __init__(self, setup: Setup, name: str, m: int, seed: int = 0):
        n, k = setup.shapes[name]
        self.setup, self.name, self.m, self.n, self.k = setup, name, m, n, k
        g = torch.Generator(device=setup.device).manual_seed(seed)
        self.x = torch.randn(m, k, generator=g, device=setup.device).to(setup.dtype)
        w = (torch.randn(n, k, generator=g, device=setup.device) / k ** 0.5).to(setup.dtype)
        copies = 1 if setup.tiny else max(1, -(-COLD_BYTES // w.nbytes))
        self.weights = [w] + [w.clone() for _ in range(copies - 1)]
        if setup.in_context:
            # NOTE: x is the producer's output, computed once here: rms_norm is deterministic,
            # so every x the graphs produce equals it bit for bit and the reference holds.
            self.x_in = self.x                                                          # [M, K]
            self.norm_w = (1 + 0.1 * torch.randn(k, generator=g, device=setup.device)).to(setup.dtype)  # [K]
            self.x = self.produce()
        self.ref = self.x.float() @ w.float().T
        self.counters = [sg.new_counters(n, max(m, 16), setup.device) for _ in self.weights]
        self.bytes = (n * k + m * k + m * n) * setup.dtype.itemsize
        self.flops = 2 * m * n * k

    def produce(self) -> torch.Tensor:
        """The in-context producer: a new x [M, K] = rms_norm(x_in); with --pdl launched with PDL
        where it can be (in a PDL engine the norm is a PDL kernel whatever follows it), with
        --in-context without (the default engine: no kernel launches with PDL)."""
        out = rms_norm(self.x_in, self.norm_w, NORM_EPS, pdl=self.setup.pdl)
        assert isinstance(out, torch.Tensor)
        return out

    def per_graph(self) -> int:
        return max(10, len(self.weights))

    def producer_us(self) -> float:
        """The producer alone, timed as the GEMMs are (as many launches per graph).

        NOTE: once per (M, K, launches per graph) in a run, shared by every case of that size
        (the sweep's phases, the table; shapes of one K whose W makes as many copies): the same
        work, and every candidate, cuBLAS too, then has the same number subtracted, so the
        producer's timing noise never reorders them. Per graph size as the GEMMs' graphs: the
        graph's own start is spread over its launches."""
        key = (self.m, self.k, self.per_graph())
        if key not in PRODUCER_US:
            PRODUCER_US[key] = self.setup.time_us(self.produce, self.per_graph())
        return PRODUCER_US[key]

    def time_us(self, launch) -> tuple[float, dict]:
        """launch(x, w, counters) cycled over the copies of W, one graph of them all (10 at least):
        (us per launch, {}). In context each launch follows its producer, whose time alone is
        subtracted: (us, {"in_context_us": producer and GEMM, "producer_us": producer alone})."""
        state = {"i": 0}

        def fn():
            i = state["i"] % len(self.weights)
            state["i"] += 1
            launch(self.produce() if self.setup.in_context else self.x, self.weights[i], self.counters[i])
        us = self.setup.time_us(fn, self.per_graph())
        if not self.setup.in_context:
            return us, {}
        producer = self.producer_us()
        return us - producer, {"in_context_us": us, "producer_us": producer}

    def cublas(self) -> dict:
        out = F.linear(self.x, self.weights[0])
        us, extra = self.time_us(lambda x, w, c: F.linear(x, w))
        e = self.entry("cublas", us, out, [F.linear(self.x, self.weights[0]) for _ in range(REPEATS)])
        return {**e, **extra}

    def ours(self, label: str, cfg: SkinnyGemmConfig, repeats: int = 0) -> dict:
        pdl = self.setup.pdl
        out = sg.skinny_gemm(self.x, self.weights[0], None, config=cfg, counters=self.counters[0], pdl=pdl)
        us, extra = self.time_us(lambda x, w, c: sg.skinny_gemm(x, w, None, config=cfg, counters=c, pdl=pdl))
        again = [sg.skinny_gemm(self.x, self.weights[0], None, config=cfg, counters=self.counters[0], pdl=pdl)
                 for _ in range(repeats)]
        e = self.entry(label, us, out, again)
        e["config"] = dataclasses.asdict(cfg)
        e["config_name"] = cfg.name
        return {**e, **extra}

    def pdl_bit_equal(self, cfg: SkinnyGemmConfig) -> dict:
        """Ours launched with PDL right after its producer (also with PDL) against ours without
        PDL on the same x: bit-equal, since the wait, the trigger and the prefetch move no
        arithmetic (kernels/pdl.py NOTE (f))."""
        w, c = self.weights[0], self.counters[0]
        on = sg.skinny_gemm(self.produce(), w, None, config=cfg, counters=c, pdl=True)
        off = sg.skinny_gemm(self.x, w, None, config=cfg, counters=c, pdl=False)
        self.setup.sync()
        return {"shape": self.name, "m": self.m, "config_name": cfg.name, "equal": torch.equal(on, off)}

    def entry(self, label: str, us: float, out: torch.Tensor, again: list[torch.Tensor]) -> dict:
        self.setup.sync()
        err = float((out.float() - self.ref).abs().max())
        e = {"name": label, "us": us, "max_err": err, "ok": err <= MAX_ERR,
             "copy_fraction": self.bytes / (us * 1e-6) / RATES["copy"],
             "matmul_fraction": self.flops / (us * 1e-6) / RATES["matmul"]}
        if again:
            e["deterministic"] = all(torch.equal(a, out) for a in again)
        return e


RATES = {"copy": 1.0, "matmul": 1.0}


def time_candidates(setup: Setup, name: str, bucket: int, configs: list[SkinnyGemmConfig], failed: dict,
                    deadline: float) -> tuple[list[dict], list[str]]:
    """Each config timed on one (shape, bucket's M) case until the deadline (the first always)."""
    case = Case(setup, name, bucket_m(setup, bucket))
    shape = setup.shapes[name]
    entries, skipped = [], []
    for i, cfg in enumerate(configs):
        if variant_key(cfg, shape[1]) in failed:
            continue
        if i and time.monotonic() > deadline:
            skipped.append(cfg.name)
            continue
        try:
            entries.append(case.ours(cfg.name, cfg))
        except Exception as e:                     # a launch that fails only here (capture, memory)
            failed[variant_key(cfg, shape[1])] = f"{type(e).__name__}: {str(e)[:300]}"
            setup.sync()
    return entries, skipped


def best_of(entries: list[dict]) -> dict | None:
    good = [e for e in entries if e["ok"]]
    return min(good, key=lambda e: e["us"]) if good else None


# ------------------------------------------------------------------ the run


def sweep(setup: Setup, args, failed: dict, result: dict) -> dict[tuple[str, int], SkinnyGemmConfig]:
    """Phases A and B over every (shape, bucket); returns the best config of each.

    NOTE: the budget counts timing only (compiling is bounded by the candidate lists):
    60 % for phase A, 40 % for B, each shared equally by the cases still to come, so every
    case is swept somewhat; a case's first candidate (A: the default) is always timed."""
    cases = sweep_cases(setup)
    rows: dict[tuple[str, int], dict[str, Any]]    # the JSON's "sweep" rows, by (shape, bucket)
    rows = {(name, b): {"shape": name, "bucket": b, "m": bucket_m(setup, b), "entries": [], "skipped": [],
                        "best": None} for name, b in cases}
    result["sweep"] = list(rows.values())
    pool = compile_pool(args.jobs)
    for phase, fraction in (("A", 0.6), ("B", 0.4)):
        plans = {}
        for name, b in cases:
            best = rows[(name, b)]["best"]
            plans[(name, b)] = (phase_a(setup, name, b) if phase == "A" else
                                phase_b(setup, name, b, SkinnyGemmConfig(**best["config"])) if best else [])
        work = [(setup.shapes[name], bucket_m(setup, b), cfg) for (name, b), cfgs in plans.items() for cfg in cfgs]
        t0 = time.monotonic()
        compiled = precompile(setup, work, pool, failed)
        print(f"phase {phase}: {len(work)} candidates, {compiled} variants compiled in "
              f"{time.monotonic() - t0:.0f} s; {len(failed)} failed so far")
        t0, budget = time.monotonic(), args.budget_s * fraction
        for i, (name, b) in enumerate(cases):
            share = max(0.0, budget - (time.monotonic() - t0)) / (len(cases) - i)
            entries, skipped = time_candidates(setup, name, b, plans[(name, b)], failed, time.monotonic() + share)
            row = rows[(name, b)]
            row["entries"] += entries
            row["skipped"] += skipped
            row["best"] = best_of(row["entries"])
        write_json(result, args.out)
    if pool is not None:
        pool.shutdown()
    return {key: SkinnyGemmConfig(**row["best"]["config"]) for key, row in rows.items() if row["best"]}


def table(setup: Setup, best: dict[tuple[str, int], SkinnyGemmConfig],
          bit_equal: list[dict] | None = None) -> list[dict]:
    """cuBLAS, our default and the bucket's best at every (shape, M). In context also the
    producer's time per row; with --pdl (into bit_equal) ours with and without PDL compared bit
    for bit on one config per shape: the default at the shape's first M."""
    rows = []
    for name in setup.shapes:
        for m in setup.ms:
            n, k = setup.shapes[name]
            case = Case(setup, name, m, seed=1)
            row: dict[str, Any] = {"shape": name, "m": m, "n": n, "k": k, "cublas": case.cublas()}
            default = sg.pick_config(m, n, k, setup.dtype, setup.num_sms)
            if setup.in_context:
                row["producer_us"] = case.producer_us()
            if setup.pdl and bit_equal is not None and m == setup.ms[0]:
                bit_equal.append(case.pdl_bit_equal(default))
            for label, cfg in (("default", default), ("best", best.get((name, sg.m_bucket(m))))):
                if cfg is None:
                    continue
                try:
                    row[label] = case.ours(label, cfg, repeats=REPEATS)
                except Exception as e:
                    row[label] = {"name": label, "error": f"{type(e).__name__}: {str(e)[:300]}",
                                  "config_name": cfg.name}
                    setup.sync()
                    continue
                row[label]["speedup_vs_cublas"] = row["cublas"]["us"] / row[label]["us"]
            rows.append(row)
            del case
            if setup.device == "cuda":
                torch.cuda.empty_cache()
    return rows


def per_step(setup: Setup, rows: list[dict]) -> list[dict]:
    """Per M: 28 x (the four layer GEMMs) + the lm_head, in us, for each way."""
    out = []
    for m in setup.ms:
        at = [r for r in rows if r["m"] == m]
        weight = {r["shape"]: (1 if r["shape"] == "lm_head" else NUM_LAYERS) for r in at}

        def total(pick):
            vals = [pick(r) for r in at]
            return None if any(v is None for v in vals) else sum(weight[r["shape"]] * v for r, v in zip(at, vals))

        def us(r, label):
            e = r.get(label)
            return e["us"] if e and "us" in e and e["ok"] else None
        cub = total(lambda r: r["cublas"]["us"])
        entry = {"m": m, "cublas_us": cub,
                 "default_us": total(lambda r: us(r, "default")),
                 "best_us": total(lambda r: us(r, "best")),
                 "dispatch_us": total(lambda r: min(r["cublas"]["us"], us(r, "best") or math.inf))}
        for key in ("default", "best", "dispatch"):
            v = entry[f"{key}_us"]
            entry[f"{key}_saving_us"] = None if v is None or cub is None else cub - v
            entry[f"{key}_speedup"] = None if not v or cub is None else cub / v
        out.append(entry)
    return out


def tuned_rows(setup: Setup, sweep_rows: list[dict], table_rows: list[dict]) -> list[dict]:
    """Each (shape, bucket) as a TUNED_CONFIGS row: its best config, or None where cuBLAS took
    less time over the table's Ms of that bucket (the engine then keeps F.linear there)."""
    rows = []
    for row in sweep_rows:
        best = row.get("best")
        if not best:
            continue
        n, k = setup.shapes[row["shape"]]
        inside = [t for t in table_rows if t["shape"] == row["shape"] and sg.m_bucket(t["m"]) == row["bucket"]]
        timed = [t for t in inside if "us" in t.get("best", {}) and t["best"]["ok"]]
        cublas_us = sum(t["cublas"]["us"] for t in timed)
        ours_us = sum(t["best"]["us"] for t in timed)
        c = best["config"]
        wins = bool(timed) and len(timed) == len(inside) and ours_us < cublas_us
        literal = f"    ({n}, {k}, {row['bucket']}): " + (
            f"SkinnyGemmConfig({c['block_m']}, {c['block_n']}, {c['block_k']}, split_k={c['split_k']}, "
            f"num_warps={c['num_warps']}, num_stages={c['num_stages']}, swap_ab={c['swap_ab']}, "
            f"tma={c['tma']}, reduce={c['reduce']!r})," if wins else "None,")
        rows.append({"shape": row["shape"], "bucket": row["bucket"], "m": row["m"], "config": c,
                     "config_name": best["config_name"], "us": best["us"],
                     "ms_in_table": [t["m"] for t in timed], "ours_us": ours_us, "cublas_us": cublas_us,
                     "wins": wins, "literal": literal})
    return rows


def print_table(setup: Setup, rows: list[dict], steps: list[dict], tuned: list[dict]) -> None:
    """The table, the step totals and the TUNED_CONFIGS rows, each said to be of the run's mode;
    in context, first what --in-context or --pdl did and the producer's times."""
    if setup.in_context:
        print(f"\n{setup.flag}: {setup.context_note()}")
        print("producer alone (subtracted from every time below), us per launch: " + ", ".join(
            f"K={k} M={m} x{p} {us:.2f}" for (m, k, p), us in sorted(PRODUCER_US.items(), key=lambda i: i[0][::-1])))
    print(f"\n{'shape':<13}{'M':>4} {'cuBLAS us':>9} {'ours dflt':>9} {'x':>6} {'ours best':>9} {'x':>6} "
          f"{'copy%':>6} {'mm%':>6}  best config")
    for r in rows:
        d, b = r.get("default", {}), r.get("best", {})

        def cell(e, key, fmt):
            return format(e[key], fmt) if e and key in e else "-"
        flag = "" if all(e.get("ok", True) and e.get("deterministic", True) for e in (d, b)) else "  WRONG/NONDET"
        best_e = b if b and "us" in b else d
        print(f"{r['shape']:<13}{r['m']:>4} {r['cublas']['us']:9.2f} {cell(d, 'us', '9.2f')} "
              f"{cell(d, 'speedup_vs_cublas', '6.2f')} {cell(b, 'us', '9.2f')} {cell(b, 'speedup_vs_cublas', '6.2f')} "
              f"{100 * best_e.get('copy_fraction', 0):5.1f}% {100 * best_e.get('matmul_fraction', 0):5.1f}%  "
              f"{best_e.get('config_name', '')}{flag}")
    print(f"\nper step ({NUM_LAYERS} layers x qkv/o/gate_up/down + lm_head), us:")
    print(f"{'M':>4} {'cuBLAS':>9} {'default':>9} {'best':>9} {'dispatch':>9} {'saving':>8} {'x':>6}")
    for s in steps:
        def f(v, fmt="9.1f"):
            return "-" if v is None else format(v, fmt)
        print(f"{s['m']:>4} {f(s['cublas_us'])} {f(s['default_us'])} {f(s['best_us'])} {f(s['dispatch_us'])} "
              f"{f(s['dispatch_saving_us'], '8.1f')} {f(s['dispatch_speedup'], '6.3f')}")
    print("\nbest config per (shape, bucket), rows for TUNED_CONFIGS in vllm_anatomy/kernels/skinny_gemm.py"
          + (f" (in context, {setup.flag}{'' if setup.pdl else ': PDL off, for the default engine'})"
             if setup.in_context else " (each GEMM alone, PDL off)"))
    print("(None: cuBLAS was faster over the bucket's Ms, F.linear stays there):")
    for t in tuned:
        print(f"{t['literal']}  # {t['shape']}, best {t['config_name']}, M {t['ms_in_table']}: "
              f"ours {t['ours_us']:.2f} us, cuBLAS {t['cublas_us']:.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "skinny_gemm.json"))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode (Triton interpreter, tiny shapes)")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="seconds of sweep timing (compiling not counted); later configs are skipped")
    ap.add_argument("--jobs", type=int, default=None,
                    help="compile processes (default: up to 16 on a GPU, 1 with --tiny)")
    ap.add_argument("--no-sweep", action="store_true", help="cuBLAS vs the default table only")
    ap.add_argument("--in-context", action="store_true",
                    help="time every GEMM in context: after its producer (rms_norm over K, its time subtracted), "
                         "nothing launched with PDL, as the default engine runs them; the rows are chosen so "
                         "(see the docstring: bench/results/pdl_layers_h100.json found the rows chosen alone "
                         "slower in a layer at 16-64 tokens)")
    ap.add_argument("--pdl", action="store_true",
                    help="as --in-context (implied), with the producer and ours launched with PDL, as the engine "
                         "runs them with VLLM_ANATOMY_PDL=1; the rows are chosen so")
    args = ap.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for the CPU smoke mode)")
    setup = Setup(args.tiny, in_context=args.in_context, pdl=args.pdl)
    if args.jobs is None:
        args.jobs = 1 if args.tiny else min(16, os.cpu_count() or 1)
    start = time.monotonic()
    copy, matmul = ceilings(setup)
    RATES.update(copy=copy["bytes_per_s"], matmul=matmul["flop_per_s"])
    print(f"copy {copy['bytes_per_s'] / 1e12:.2f} TB/s, matmul {matmul['flop_per_s'] / 1e12:.1f} TFLOP/s, "
          f"{setup.num_sms} SMs")
    failed: dict[str, str] = {}
    result = {
        "device": torch.cuda.get_device_name() if setup.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": __import__("triton").__version__, "tiny": args.tiny,
        "dtype": str(setup.dtype), "num_sms": setup.num_sms, "copy_ceiling": copy, "matmul_ceiling": matmul,
        "shapes": {k: list(v) for k, v in setup.shapes.items()}, "ms": setup.ms, "num_layers": NUM_LAYERS,
        "cold_bytes": 0 if setup.tiny else COLD_BYTES, "compile_failed": failed,
        "in_context": setup.in_context, "pdl": setup.pdl, "sweep": [],
    }
    bit_equal: list[dict] = []
    if setup.in_context:
        result.update(context_note=setup.context_note(),
                      producer=f"rms_norm(x_in [M, K], weight [K], eps={NORM_EPS}, pdl={setup.pdl}) -> x [M, K]")
        print(f"{setup.flag}: {setup.context_note()}")
    if setup.pdl:
        result.update(pdl_effective=setup.pdl_effective, pdl_bit_equal=bit_equal)
    best = {} if args.no_sweep else sweep(setup, args, failed, result)
    result["sweep_s"] = time.monotonic() - start
    result["table"] = table(setup, best, bit_equal)
    result["per_step"] = per_step(setup, result["table"])
    if setup.in_context:
        result["producer_us"] = [{"m": m, "k": k, "per_graph": p, "us": us}
                                 for (m, k, p), us in sorted(PRODUCER_US.items())]
    result["tuned_rows"] = tuned_rows(setup, result["sweep"], result["table"])
    result["wall_s"] = time.monotonic() - start
    write_json(result, args.out)
    print_table(setup, result["table"], result["per_step"], result["tuned_rows"])
    if setup.pdl:
        print("ours with PDL vs without, bit for bit: " + ", ".join(
            f"{b['shape']} M={b['m']} {b['config_name']}: {'equal' if b['equal'] else 'DIFFERENT'}" for b in bit_equal))
    if failed:
        print(f"\n{len(failed)} configs failed to compile or run (compile_failed in the JSON), e.g. "
              f"{next(iter(failed))}: {next(iter(failed.values()))[:150]}")
    print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
