"""Where the GPU time of the whole throughput run goes, ours and vLLM's, side by side.

    python bench/gpu_breakdown.py [--vllm-site DIR] [--out bench/results/gpu_breakdown_h200.json]
                                  [--workload nano-vllm|context:4096|prefill:4096]

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
  - kernel time by kind (attention, GEMM, norms, RoPE, KV-cache writes, SiLU, sampling,
    copies, other), each kind's launch count;
  - the roofline floor of the workload (bench/throughput.py's model) against both.
  - the top kernels by time, by name (which attention kernel: prefill or decode).
--workload context:N profiles one point of bench/scaling.py's context series instead
(64 sequences of N random prompt tokens, 128 output tokens each): where vLLM's lead
at long prompts comes from; --workload prefill:N the same prompts with 1 output token
(the point's prefill alone: context:N minus prefill:N is its decode). The profiler slows the host a little, so wall time here is not the throughput number:
bench/vs_vllm.py measures that, unprofiled. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import Engine, ceilings, run_subprocess, worker_env, write_models  # noqa: E402
from vs_vllm import FULL, nano_vllm_workload  # noqa: E402

# Kernel name (lower case) -> kind; the first kind whose any substring matches wins.
KINDS = [
    # (cuDNN's fused attention, VLLM_ANATOMY_PREFILL_KERNEL=cudnn: cudnn_generated_..._sdpa_..._fprop_...)
    ("attention", ("attention", "flash_fwd", "flash::", "fmha", "sdpa")),
    ("kv_cache_write", ("reshape_and_cache",)),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "splitkreduce", "cublas")),
    ("norm", ("rms_norm", "rmsnorm", "layernorm", "layer_norm")),
    ("rope", ("rotary",)),
    ("activation", ("silu", "act_and_mul")),
    ("sampling", ("softmax", "distribution", "exponential", "argmax", "reduce_kernel", "sample", "gumbel",
                  "topk", "sort")),
    ("copy", ("memcpy", "memset")),
]
NUM_BUCKETS = 20
TOP_KERNELS = 12
CONTEXT_NUM_SEQS, CONTEXT_OUTPUT_LEN = 64, 128     # bench/scaling.py's context series


def workload(name: str) -> tuple[list[list[int]], list[int], float, int]:
    """(prompts, max_tokens, temperature, max_model_len) of `nano-vllm`, `context:N` or `prefill:N`."""
    if name == "nano-vllm":
        prompts, max_tokens = nano_vllm_workload(FULL)
        return prompts, max_tokens, 0.6, 4096
    kind, _, n = name.partition(":")
    if kind not in ("context", "prefill") or not n.isdigit():
        raise SystemExit(f"--workload: nano-vllm, context:N or prefill:N (N prompt tokens), not {name!r}")
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(int(n))] for _ in range(CONTEXT_NUM_SEQS)]
    # prefill:N: the same prompts with one output token: the context point's prefill alone, so
    # that context:N minus prefill:N is its decode (the profile cannot tell a kernel's step kind).
    output_len = CONTEXT_OUTPUT_LEN if kind == "context" else 1
    return prompts, [output_len] * CONTEXT_NUM_SEQS, 0.6, int(n) + CONTEXT_OUTPUT_LEN


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
    order = sorted(time_by_kind, key=time_by_kind.get, reverse=True)
    return {"span_s": span / 1e6, "busy_s": busy / 1e6, "busy_fraction": busy / span,
            "busy_fraction_by_twentieth": [round(b / (span / NUM_BUCKETS), 4) for b in buckets],
            "kernel_s_by_kind": {k: time_by_kind[k] / 1e6 for k in order},
            "launches_by_kind": {k: count_by_kind[k] for k in order},
            "idle_gaps": idle_gaps(gaps, span)}


GAP_BINS_US = (10.0, 100.0, 1000.0)                       # launch gaps | step boundaries | stalls


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


def top_kernels(intervals: list[tuple[float, float, str]], n: int = TOP_KERNELS) -> list[dict]:
    """The n kernel names with the most GPU time: name (cut to 90 characters), seconds, launches."""
    by_name: dict[str, list[float]] = {}
    for start, end, name in intervals:
        row = by_name.setdefault(name[:90], [0.0, 0])
        row[0] += (end - start) / 1e6
        row[1] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:n]
    return [{"name": name, "seconds": s, "launches": int(k), "kind": kind_of(name)} for name, (s, k) in ranked]


def run_worker(kind: str, model_dir: str, workload_name: str = "nano-vllm") -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    prompts, max_tokens, temperature, max_model_len = workload(workload_name)
    engine = Engine(kind, model_dir, max_model_len=max_model_len)
    engine.generate([list(range(1, 9))], [16], 0.0)                  # warm-up, as nano-vllm's bench
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        seconds, generated = engine.generate(prompts, max_tokens, temperature)
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end, e.name) for e in gpu]
    result = {"engine": kind, "settings": engine.settings(), "profiled_wall_s": seconds,
              "output_tokens": generated} | breakdown(intervals) | {"top_kernels": top_kernels(intervals)}
    engine.shutdown()
    return result


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
        print(f"top kernels, {e}:")
        for row in result[e].get("top_kernels", []):
            print(f"  {row['seconds']:8.3f} s {row['launches']:7d}x  {row['kind']:14s} {row['name'][:70]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-site", help="the unpacked vLLM 0.26.0 bundle (../shared/peers/vllm/); omit: ours only")
    ap.add_argument("--out", default="bench/results/gpu_breakdown_h200.json")
    ap.add_argument("--workload", default="nano-vllm",
                    help="nano-vllm (bench/vs_vllm.py's), context:N (bench/scaling.py's point of N-token prompts) "
                         "or prefill:N (the same prompts, 1 output token)")
    ap.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args.worker, args.model_dir, args.workload)), flush=True)
        return
    workload(args.workload)                                           # refuse a bad name before any start-up
    import tempfile

    import torch
    from throughput import roofline
    with tempfile.TemporaryDirectory() as tmp:
        ours_dir, vllm_dir = os.path.join(tmp, "ours"), os.path.join(tmp, "vllm")
        write_models(ours_dir, vllm_dir, tiny=False)
        copy, mm = ceilings(tiny=False)
        prompts, max_tokens, _, _ = workload(args.workload)
        result: dict = {"bench": "gpu_breakdown", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "workload": args.workload,
                        "roofline_floor_s": roofline(prompts, max_tokens, copy["bytes_per_s"],
                                                     mm["flop_per_s"])["floor_seconds"]}
        for kind, key, model_dir in [("ours", "vllm_anatomy", ours_dir), ("vllm", "vllm", vllm_dir)]:
            if kind == "vllm" and not args.vllm_site:
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--model-dir", model_dir,
                   "--workload", args.workload]
            result[key] = run_subprocess(f"{kind}: profiled throughput run", cmd,
                                         worker_env(kind, args.vllm_site, multiprocess=False), timeout_s=300)
    print_table(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
