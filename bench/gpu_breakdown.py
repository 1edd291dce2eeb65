"""Where the GPU time of the whole throughput run goes, ours and vLLM's, side by side.

    python bench/gpu_breakdown.py [--vllm-site DIR] [--out bench/results/gpu_breakdown_h200.json]
                                  [--workload nano-vllm|context:4096|prefill:4096|ttft:4096] [--gc-log]
                                  [--host-profile]  (with ttft:N: bench/ttft_host.py)

nano-vllm's workload (bench/vs_vllm.py: 256 sequences, prompts and outputs uniform in
[100, 1024], temperature 0.6, ignore_eos), run once under torch.profiler with CUDA
activity only (kernels, copies), each engine in its own subprocess and in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: the profiler sees its own process's kernels only).
Without --vllm-site only ours runs. It reports:
  - busy: the union of GPU activity over the profiled span, and that as a fraction
    (1 - busy is the time the GPU waited for the host);
  - busy per twentieth of the run (the start is prefill-heavy, the end has few sequences);
  - the idle gaps binned by length (< 10 us: launch gaps; < 100 us, < 1 ms: step
    boundaries; longer: stalls) and the largest few, with where in the run they fall;
  - kernel time by kind (attention, GEMM, norms, RoPE (with a fused q/k norm, and its K/V
    write when fused too), KV-cache writes, SiLU, sampling,
    copies, other), each kind's launch count;
  - the roofline floor of the workload (bench/throughput.py's model) against both.
  - the top kernels by time, by name (which attention kernel: prefill or decode).
--workload context:N profiles one point of bench/scaling.py's context series instead
(64 sequences of N random prompt tokens, 128 output tokens each): where vLLM's lead
at long prompts comes from; --workload prefill:N the same prompts with 1 output token
(the point's prefill alone: context:N minus prefill:N is its decode); --workload ttft:N
times bench/scaling.py's ttft point: one fresh N-token prompt alone, max_tokens 1, after one
unprofiled call of that length, TTFT_REPEATS times, and splits each request's wall into the
host before its first kernel, the GPU's span (busy and idle) and the host after its last
kernel, with kernel time by kind per request (medians): is a slower TTFT the GPU's or the
host's, and which kernels? --gc-log (ours):
every garbage collection, Triton compilation and engine step of the profiled run is logged
(bench/host_stalls.py's GCLog, TritonCompileLog, HostStepLog), and each > 1 ms idle gap is
listed with those that overlapped it, the engine steps' longest phases included (issue 34:
is a gap a collection, a compilation, or which host phase?). The profiler slows the host a little, so wall time here is not the throughput number:
bench/vs_vllm.py measures that, unprofiled. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import Engine, ceilings, run_subprocess, worker_env, write_models  # noqa: E402
from vs_vllm import FULL, nano_vllm_workload  # noqa: E402

# Kernel name (lower case) -> kind; the first kind whose any substring matches wins.
KINDS = [
    # (cuDNN's fused attention, VLLM_ANATOMY_PREFILL_KERNEL=cudnn: cudnn_generated_..._sdpa_..._fprop_...)
    # (reduce_segments: our split-KV decode's combine of the 3D kernel's segments)
    ("attention", ("attention", "flash_fwd", "flash::", "fmha", "sdpa", "reduce_segments")),
    ("kv_cache_write", ("reshape_and_cache",)),
    # (_skinny_gemm_kernel and its second-launch sum _splitk_reduce_kernel: kernels/skinny_gemm.py)
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "splitkreduce", "splitk_reduce", "cublas")),
    ("norm", ("rms_norm", "rmsnorm", "layernorm", "layer_norm")),
    # Qwen3's fused q/k norm + RoPE (ours, and its twin that also writes K/V; vLLM's fusedQKNormRope)
    ("rope", ("rotary", "qk_norm_rope", "qknormrope")),
    ("activation", ("silu", "act_and_mul")),
    ("sampling", ("softmax", "distribution", "exponential", "argmax", "reduce_kernel", "sample", "gumbel",
                  "topk", "sort")),
    ("copy", ("memcpy", "memset")),
]
NUM_BUCKETS = 20
TOP_KERNELS = 12
CONTEXT_NUM_SEQS, CONTEXT_OUTPUT_LEN = 64, 128     # bench/scaling.py's context series
TTFT_REPEATS = 5                                   # bench/scaling.py's ttft series: median of 5


def workload(name: str) -> tuple[list[list[int]], list[int], float, int]:
    """(prompts, max_tokens, temperature, max_model_len) of `nano-vllm`, `context:N`, `prefill:N`
    or `ttft:N` (1 + TTFT_REPEATS prompts, each run alone: the first one unprofiled)."""
    if name == "nano-vllm":
        prompts, max_tokens = nano_vllm_workload(FULL)
        return prompts, max_tokens, 0.6, 4096
    kind, _, n = name.partition(":")
    if kind not in ("context", "prefill", "ttft") or not n.isdigit() or int(n) < 1:
        raise SystemExit(f"--workload: nano-vllm, context:N, prefill:N or ttft:N (N prompt tokens), not {name!r}")
    if kind == "ttft":
        prompts = fresh_prompts(int(n), 1 + TTFT_REPEATS, seed=0)
        return prompts, [1] * len(prompts), 0.0, int(n) + CONTEXT_OUTPUT_LEN
    prompts = fresh_prompts(int(n), CONTEXT_NUM_SEQS, seed=0)
    # prefill:N: the same prompts with one output token: the context point's prefill alone, so
    # that context:N minus prefill:N is its decode (the profile cannot tell a kernel's step kind).
    output_len = CONTEXT_OUTPUT_LEN if kind == "context" else 1
    return prompts, [output_len] * CONTEXT_NUM_SEQS, 0.6, int(n) + CONTEXT_OUTPUT_LEN


def fresh_prompts(num_tokens: int, count: int, seed: int) -> list[list[int]]:
    """count random prompts of num_tokens ids in [0, 10000]; workload() draws with seed 0, so another
    seed gives prompts no prefix-cache hit can serve."""
    rng = random.Random(seed)
    return [[rng.randint(0, 10000) for _ in range(num_tokens)] for _ in range(count)]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, subs in KINDS if any(s in low for s in subs)), "other")


def breakdown(intervals: list[tuple[float, float, str]]) -> dict:
    """intervals: (start_us, end_us, kernel name) of every GPU activity -> the module docstring's numbers."""
    intervals.sort()
    start, end = intervals[0][0], max(e for _, e, _ in intervals)
    span = end - start
    buckets = [0.0] * NUM_BUCKETS
    busy, covered_to = 0.0, float("-inf")
    time_by_kind: dict[str, float] = {}
    count_by_kind: dict[str, int] = {}
    gaps: list[tuple[float, float]] = []                    # (idle us, offset us) between covered stretches
    for s, e, name in intervals:
        k = kind_of(name)
        time_by_kind[k] = time_by_kind.get(k, 0.0) + (e - s)
        count_by_kind[k] = count_by_kind.get(k, 0) + 1
        # NOTE: kernels on two streams may overlap: busy counts covered time once.
        if s > covered_to > float("-inf"):
            gaps.append((s - covered_to, covered_to - start))
        lo = max(s, covered_to)
        if e > lo:
            busy += e - lo
            for b in range(NUM_BUCKETS):
                b_lo = start + span * b / NUM_BUCKETS
                overlap = min(e, b_lo + span / NUM_BUCKETS) - max(lo, b_lo)
                if overlap > 0:
                    buckets[b] += overlap
        covered_to = max(covered_to, e)
    order = sorted(time_by_kind, key=time_by_kind.__getitem__, reverse=True)
    return {"span_s": span / 1e6, "busy_s": busy / 1e6, "busy_fraction": busy / span,
            "busy_fraction_by_twentieth": [round(b / (span / NUM_BUCKETS), 4) for b in buckets],
            "kernel_s_by_kind": {k: time_by_kind[k] / 1e6 for k in order},
            "launches_by_kind": {k: count_by_kind[k] for k in order},
            "idle_gaps": idle_gaps(gaps, span)}


GAP_BINS_US = (10.0, 100.0, 1000.0)                       # launch gaps | step boundaries | stalls
STALL_US = GAP_BINS_US[-1]                                # --gc-log explains the gaps from here up


def idle_gaps(gaps: list[tuple[float, float]], span_us: float, largest: int = 8) -> dict:
    """Where the idle time is: gaps binned by length (count, seconds) and the largest few
    with where in the run they fall (0 = start, 1 = end)."""
    edges = (0.0,) + GAP_BINS_US + (float("inf"),)
    bins = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [g for g, _ in gaps if lo <= g < hi]
        bins.append({"from_us": lo, "to_us": None if hi == float("inf") else hi,
                     "count": len(inside), "seconds": sum(inside) / 1e6})
    top = sorted(gaps, reverse=True)[:largest]
    return {"bins": bins, "largest": [{"ms": g / 1e3, "at": round(at / span_us, 4)} for g, at in top]}


def idle_stretches(intervals: list[tuple[float, float, str]], min_us: float) -> list[tuple[float, float]]:
    """(start_us, end_us) of every stretch of at least min_us in which the GPU ran nothing."""
    stretches, covered_to = [], float("-inf")
    for s, e, _ in sorted(intervals):
        if s - covered_to >= min_us and covered_to > float("-inf"):
            stretches.append((covered_to, s))
        covered_to = max(covered_to, e)
    return stretches


def _overlap_ns(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def gap_causes(gaps_ns: list[tuple[float, float]], run_ns: tuple[float, float], gc_events: list[dict],
               compiles: list[dict], host_steps: list[dict]) -> dict:
    """For each GPU idle gap (start, end in time.time_ns()), what the host did meanwhile: the
    garbage collections and Triton compilations that overlapped it, and the engine steps
    (LLMEngine.step calls) that ran across it with their longest phases. run_ns: the profiled
    span (where in the run a gap falls). gc_events: bench/host_stalls.GCEvent dicts; compiles
    and host_steps: TritonCompileLog.events and HostStepLog.steps."""
    span = max(run_ns[1] - run_ns[0], 1.0)
    rows: list[dict[str, Any]] = []
    for g0, g1 in gaps_ns:
        gcs = [{"generation": e["generation"], "ms": e["duration_s"] * 1e3, "collected": e["collected"],
                "overlap_ms": _overlap_ns(g0, g1, e["start_ns"], e["start_ns"] + e["duration_s"] * 1e9) / 1e6}
               for e in gc_events if _overlap_ns(g0, g1, e["start_ns"], e["start_ns"] + e["duration_s"] * 1e9) > 0]
        jit = [{"kernel": c["kernel"], "ms": ((c["end_ns"] or g1) - c["start_ns"]) / 1e6}
               for c in compiles if _overlap_ns(g0, g1, c["start_ns"], c["end_ns"] or g1) > 0]
        steps = [{"step": i, "ms": (h["end_ns"] - h["start_ns"]) / 1e6,
                  "top_phases_ms": dict(sorted(((p, v * 1e3) for p, v in h["phases_s"].items()),
                                               key=lambda kv: -kv[1])[:4])}
                 for i, h in enumerate(host_steps) if _overlap_ns(g0, g1, h["start_ns"], h["end_ns"]) > 0]
        rows.append({"ms": (g1 - g0) / 1e6, "at": round((g0 - run_ns[0]) / span, 4), "gc": gcs,
                     "triton_compiles": jit, "host_steps": steps})
    return {"num_gaps": len(rows), "gap_s": sum(r["ms"] for r in rows) / 1e3,
            "num_with_gc": sum(bool(r["gc"]) for r in rows),
            "num_with_gen2": sum(any(g["generation"] == 2 for g in r["gc"]) for r in rows),
            "gc_overlap_s": sum(g["overlap_ms"] for r in rows for g in r["gc"]) / 1e3,
            "num_with_triton_compile": sum(bool(r["triton_compiles"]) for r in rows),
            "gaps": rows}


def top_kernels(intervals: list[tuple[float, float, str]], n: int = TOP_KERNELS) -> list[dict]:
    """The n kernel names with the most GPU time: name (cut to 90 characters), seconds, launches."""
    by_name: dict[str, list[float]] = {}
    for start, end, name in intervals:
        row = by_name.setdefault(name[:90], [0.0, 0])
        row[0] += (end - start) / 1e6
        row[1] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:n]
    return [{"name": name, "seconds": s, "launches": int(k), "kind": kind_of(name)} for name, (s, k) in ranked]


def run_worker(kind: str, model_dir: str, workload_name: str = "nano-vllm", gc_log: bool = False,
               host_profile: bool = False) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    prompts, max_tokens, temperature, max_model_len = workload(workload_name)
    engine = Engine(kind, model_dir, max_model_len=max_model_len)
    engine.generate([list(range(1, 9))], [16], 0.0)                  # warm-up, as nano-vllm's bench
    if workload_name.startswith("ttft:"):
        result = {"engine": kind, "settings": engine.settings()} | profile_ttft(engine, prompts)
        if host_profile:
            from ttft_host import host_profile as profile_host
            n = len(prompts[0])
            result["ttft_host"] = profile_host(engine, [fresh_prompts(n, TTFT_REPEATS, seed) for seed in (1, 2, 3)])
        engine.shutdown()
        return result
    logs, allocator_before = None, {}
    if gc_log:
        from host_stalls import GCLog, HostStepLog, TritonCompileLog
        logs = (GCLog(), TritonCompileLog(), HostStepLog(engine.llm))
        allocator_before = allocator_counts()
        logs[0].__enter__()
        logs[1].__enter__()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_start_ns = time.time_ns()
            seconds, generated = engine.generate(prompts, max_tokens, temperature)
            run_end_ns = time.time_ns()
    finally:
        if logs is not None:
            logs[1].__exit__(None, None, None)
            logs[0].__exit__(None, None, None)
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end, e.name) for e in gpu]
    result = {"engine": kind, "settings": engine.settings(), "profiled_wall_s": seconds,
              "output_tokens": generated} | breakdown(intervals) | {"top_kernels": top_kernels(intervals)}
    if logs is not None:
        result["gap_causes"] = gap_causes_of_run(prof, intervals, (run_start_ns, run_end_ns), *logs)
        after = allocator_counts()
        result["gap_causes"]["allocator_counts_during_run"] = allocator_change(allocator_before, after)
    engine.shutdown()
    return result


def profile_ttft(engine: Engine, prompts: list[list[int]]) -> dict:
    """--workload ttft:N: prompts[0] alone unprofiled (a first call of a length compiles or
    autotunes), then each other prompt alone under the profiler, greedy, max_tokens 1."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    first_s, _ = engine.generate([prompts[0]], [1], 0.0)
    windows: list[tuple[int, int]] = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for p in prompts[1:]:
            t0 = time.time_ns()
            engine.generate([p], [1], 0.0)
            windows.append((t0, time.time_ns()))
    origin_ns = prof.profiler.kineto_results.trace_start_ns()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(origin_ns + e.time_range.start * 1e3, origin_ns + e.time_range.end * 1e3, e.name) for e in gpu]
    return ttft_phases(intervals, windows) | {"first_call_ms": 1e3 * first_s}


def ttft_phases(intervals_ns: list[tuple[float, float, str]], windows_ns: list[tuple[int, int]]) -> dict:
    """Each request's window (time.time_ns around generate()) split by the GPU activity inside it:
    host_head_ms (call to first kernel), gpu_span_ms (first kernel start to last kernel end),
    gpu_busy_ms (the union of kernels in it), host_tail_ms (last kernel end to return); kernel ms
    by kind; each request's numbers and their medians ("median")."""
    requests: list[dict[str, Any]] = []
    for t0, t1 in windows_ns:
        inside = sorted((s, e, n) for s, e, n in intervals_ns if s >= t0 and e <= t1)
        if not inside:
            raise SystemExit("ttft: no GPU activity inside a request's window (clocks not aligned?)")
        first, last = inside[0][0], max(e for _, e, _ in inside)
        busy, covered_to = 0.0, float("-inf")
        by_kind: dict[str, float] = {}
        for s, e, n in inside:
            k = kind_of(n)
            by_kind[k] = by_kind.get(k, 0.0) + (e - s) / 1e6
            busy += max(0.0, e - max(s, covered_to))
            covered_to = max(covered_to, e)
        requests.append({"wall_ms": (t1 - t0) / 1e6, "host_head_ms": (first - t0) / 1e6,
                         "gpu_span_ms": (last - first) / 1e6, "gpu_busy_ms": busy / 1e6,
                         "host_tail_ms": (t1 - last) / 1e6, "launches": len(inside), "kernel_ms_by_kind": by_kind})
    keys = ("wall_ms", "host_head_ms", "gpu_span_ms", "gpu_busy_ms", "host_tail_ms", "launches")
    kinds = sorted({k for r in requests for k in r["kernel_ms_by_kind"]})
    median = {k: statistics.median(r[k] for r in requests) for k in keys} | {
        "kernel_ms_by_kind": {k: statistics.median(r["kernel_ms_by_kind"].get(k, 0.0) for r in requests)
                              for k in kinds}}
    return {"ttft_requests": requests, "ttft_median": median}


def print_ttft_table(result: dict) -> None:
    engines = [k for k in ("vllm_anatomy", "vllm") if result.get(k) and "ttft_median" in result[k]]
    print(f"{'ms per request (median)':28s}" + "".join(f"{e:>14s}" for e in engines))
    for row in ("wall_ms", "host_head_ms", "gpu_span_ms", "gpu_busy_ms", "host_tail_ms", "launches"):
        print(f"{row:28s}" + "".join(f"{result[e]['ttft_median'][row]:14.3f}" for e in engines))
    kinds = sorted({k for e in engines for k in result[e]["ttft_median"]["kernel_ms_by_kind"]},
                   key=lambda k: -max(result[e]["ttft_median"]["kernel_ms_by_kind"].get(k, 0) for e in engines))
    for k in kinds:
        print(f"  {k:26s}" + "".join(f"{result[e]['ttft_median']['kernel_ms_by_kind'].get(k, 0.0):14.3f}"
                                      for e in engines))


def allocator_counts() -> dict[str, int]:
    """The torch allocators' event counters ("num_*": device mallocs and frees, alloc retries
    after an out-of-memory, which free cached blocks with a device-wide sync; pinned host
    allocations): their change over the run says whether an allocator call could be a stall."""
    import torch
    stats = dict(torch.cuda.memory_stats())
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        stats.update({f"host.{k}": v for k, v in host_stats().items()})
    return {k: int(v) for k, v in stats.items() if k.rsplit(".", 1)[-1].startswith("num_")
            and isinstance(v, (int, float))}


def allocator_change(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters of allocator_counts() that moved between two reads, by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def gap_causes_of_run(prof, intervals: list[tuple[float, float, str]], run_ns: tuple[int, int],
                      gc_log, compile_log, step_log) -> dict:
    """gap_causes of the profiled run's > 1 ms gaps.

    NOTE: the profiler's event times are microseconds after its trace start, which
    kineto keeps in Unix-epoch nanoseconds, the clock of time.time_ns() that the logs
    use (checked on a CPU trace: a record_function lands within 0.2 ms of time.time_ns()).
    clock_check_ms says how far the first GPU activity came after generate() began: a
    small positive number if the clocks agree."""
    origin_ns = prof.profiler.kineto_results.trace_start_ns()
    gaps = [(origin_ns + s * 1e3, origin_ns + e * 1e3) for s, e in idle_stretches(intervals, STALL_US)]
    out = gap_causes(gaps, run_ns, [asdict(e) for e in gc_log.events], compile_log.events, step_log.steps)
    first_gpu_ns = origin_ns + min(s for s, _, _ in intervals) * 1e3
    step_ms = sorted((h["end_ns"] - h["start_ns"]) / 1e6 for h in step_log.steps)
    return {"clock_check_ms": (first_gpu_ns - run_ns[0]) / 1e6, "gc_summary": gc_log.summary(),
            "median_host_step_ms": step_ms[len(step_ms) // 2] if step_ms else None,
            "num_triton_compiles": len(compile_log.events), "triton_hooks": compile_log.available,
            "num_host_steps": len(step_log.steps)} | out


def print_table(result: dict) -> None:
    engines = [k for k in ("vllm_anatomy", "vllm") if result.get(k) and "busy_s" in result[k]]
    kinds = sorted({k for e in engines for k in result[e]["kernel_s_by_kind"]},
                   key=lambda k: -max(result[e]["kernel_s_by_kind"].get(k, 0) for e in engines))
    print(f"{'seconds of GPU time':28s}" + "".join(f"{e:>14s}" for e in engines))
    for row in ["profiled_wall_s", "span_s", "busy_s"]:
        print(f"{row:28s}" + "".join(f"{result[e][row]:14.3f}" for e in engines))
    print(f"{'busy fraction':28s}" + "".join(f"{result[e]['busy_fraction']:14.3f}" for e in engines))
    for k in kinds:
        print(f"  {k:26s}" + "".join(f"{result[e]['kernel_s_by_kind'].get(k, 0.0):14.3f}" for e in engines))
    print(f"{'roofline floor':28s}" + "".join(f"{result['roofline_floor_s']:14.3f}" for _ in engines))
    for e in engines:
        gaps = result[e].get("idle_gaps")
        if gaps:
            print(f"idle gaps, {e}: " + ", ".join(
                f"[{b['from_us']:g}, {b['to_us'] or 'inf'}) us: {b['count']} = {b['seconds']:.3f} s" for b in gaps["bins"])
                  + "; largest ms (at): " + ", ".join(f"{g['ms']:.2f} ({g['at']:.2f})" for g in gaps["largest"]))
    for e in engines:
        causes = result[e].get("gap_causes")
        if causes:
            print_gap_causes(e, causes)
    for e in engines:
        print(f"top kernels, {e}:")
        for row in result[e].get("top_kernels", []):
            print(f"  {row['seconds']:8.3f} s {row['launches']:7d}x  {row['kind']:14s} {row['name'][:70]}")


def print_gap_causes(engine: str, causes: dict) -> None:
    """--gc-log: one line per > 1 ms GPU idle gap with what overlapped it, then the totals."""
    print(f"GPU idle gaps > 1 ms, {engine} (clock check: first GPU activity "
          f"{causes['clock_check_ms']:.2f} ms after generate() began; median engine step "
          f"{causes['median_host_step_ms'] or 0:.2f} ms):")
    print(f"  {'ms':>6} {'at':>6}  {'GC (gen:ms)':16s} {'Triton compiles':24s} host steps (ms: longest phases)")
    for g in causes["gaps"]:
        gcs = " ".join(f"{c['generation']}:{c['ms']:.2f}" for c in g["gc"]) or "-"
        jit = " ".join(c["kernel"][:20] for c in g["triton_compiles"]) or "-"
        steps = "; ".join(f"{h['ms']:.2f}: " + ", ".join(f"{p} {v:.2f}" for p, v in h["top_phases_ms"].items())
                          for h in g["host_steps"][:2])
        print(f"  {g['ms']:6.2f} {g['at']:6.3f}  {gcs:16s} {jit:24s} {steps}")
    gcs = causes["gc_summary"]
    print(f"  {causes['num_gaps']} gaps = {causes['gap_s'] * 1e3:.1f} ms; {causes['num_with_gc']} overlap a "
          f"collection ({causes['num_with_gen2']} of gen 2, {causes['gc_overlap_s'] * 1e3:.1f} ms of overlap), "
          f"{causes['num_with_triton_compile']} a Triton compilation ({causes['num_triton_compiles']} in the run"
          f"{'' if causes['triton_hooks'] else ': no hooks in this Triton'}); GC in the run: "
          + ", ".join(f"{k} {v['count']} = {v['total_s'] * 1e3:.1f} ms" for k, v in gcs.items()))
    counts = causes.get("allocator_counts_during_run")
    if counts is not None:
        print("  allocator events during the run: " + (", ".join(f"{k} +{v}" for k, v in sorted(counts.items()))
                                                      or "none"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-site", help="the unpacked vLLM 0.26.0 bundle (../shared/peers/vllm/); omit: ours only")
    ap.add_argument("--out", default="bench/results/gpu_breakdown_h200.json")
    ap.add_argument("--workload", default="nano-vllm",
                    help="nano-vllm (bench/vs_vllm.py's), context:N (bench/scaling.py's point of N-token prompts), "
                         "prefill:N (the same prompts, 1 output token) or ttft:N (one N-token prompt alone, "
                         "max_tokens 1, each request's host and GPU time)")
    ap.add_argument("--gc-log", action="store_true",
                    help="ours: log every garbage collection, Triton compilation and engine step "
                         "(time.time_ns) during the profiled run, and say for each > 1 ms GPU idle gap "
                         "which of them overlapped it (bench/host_stalls.py's logs)")
    ap.add_argument("--host-profile", action="store_true",
                    help="with ttft:N, ours: then time fresh requests without the CUDA profiler, their engine "
                         "steps' host phases, every CUDA sync they make, and a cProfile of them "
                         "(bench/ttft_host.py)")
    ap.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args.worker, args.model_dir, args.workload,
                                                gc_log=args.gc_log and args.worker == "ours",
                                                host_profile=args.host_profile and args.worker == "ours")),
              flush=True)
        return
    workload(args.workload)                                           # refuse a bad name before any start-up
    if args.host_profile and not args.workload.startswith("ttft:"):
        raise SystemExit("--host-profile goes with --workload ttft:N")
    import tempfile

    import torch
    from throughput import roofline
    with tempfile.TemporaryDirectory() as tmp:
        ours_dir, vllm_dir = os.path.join(tmp, "ours"), os.path.join(tmp, "vllm")
        write_models(ours_dir, vllm_dir, tiny=False)
        copy, mm = ceilings(tiny=False)
        prompts, max_tokens, _, _ = workload(args.workload)
        if args.workload.startswith("ttft:"):                    # the floor of one request
            prompts, max_tokens = prompts[:1], max_tokens[:1]
        result: dict = {"bench": "gpu_breakdown", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "workload": args.workload,
                        "roofline_floor_s": roofline(prompts, max_tokens, copy["bytes_per_s"],
                                                     mm["flop_per_s"])["floor_seconds"]}
        for kind, key, model_dir in [("ours", "vllm_anatomy", ours_dir), ("vllm", "vllm", vllm_dir)]:
            if kind == "vllm" and not args.vllm_site:
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--model-dir", model_dir,
                   "--workload", args.workload, *(["--gc-log"] if args.gc_log else []),
                   *(["--host-profile"] if args.host_profile else [])]
            result[key] = run_subprocess(f"{kind}: profiled throughput run", cmd,
                                         worker_env(kind, args.vllm_site, multiprocess=False), timeout_s=300)
    (print_ttft_table if args.workload.startswith("ttft:") else print_table)(result)
    if "ttft_host" in result.get("vllm_anatomy", {}):
        from ttft_host import print_host_profile
        print_host_profile(result["vllm_anatomy"]["ttft_host"], result["vllm_anatomy"].get("first_call_ms"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
