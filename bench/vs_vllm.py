"""vllm_anatomy vs vLLM itself, side by side on one GPU, in one run.

Runbook (H200, vLLM 0.26.0's slim bundle of ../shared/peers/vllm/ unpacked at /tmp/vllm-site):

    python bench/vs_vllm.py --vllm-site /tmp/vllm-site --ours-mp

expected wall time about 8 minutes (two vLLM start-ups of 50-95 s each, our four of
about 20 s, the model written once, the copy and matmul ceilings). It writes the JSON
again after each engine, so a run cut short keeps what it measured. To stay well
inside a 10-minute limit, drop a part: --skip-gpu-time saves vLLM's second start-up
(~2 min), --skip-spans and leaving out --ours-mp about 40 s each.

    python bench/vs_vllm.py --vllm-site SITE [--out bench/results/vs_vllm_h200.json]
        [--skip-latency] [--skip-spans] [--skip-gpu-time] [--ours-mp] [--tiny]

`--vllm-site` is a directory holding an importable vLLM (see that README for how it
reaches a GPU machine without network). Each engine runs in its own subprocess, one
after the other, so neither sees the other's GPU memory:

    ours       in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), default settings: async
               scheduling, CUDA graphs, trace level off: throughput, latency, GPU time
    vLLM       exactly as ../shared/peers/vllm/ runs it (its default multiprocess engine,
               torch.compile, FlashAttention 3, its CUDA graphs, async scheduling):
               throughput, latency
    vLLM       once more, in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): GPU time only
               (unless --skip-gpu-time)
    ours       at --trace-level spans: throughput (unless --skip-spans)
    ours       with VLLM_ENABLE_V1_MULTIPROCESSING=1, EngineCore in its own process:
               throughput, latency (row "vllm_anatomy_mp", with --ours-mp)

Throughput is nano-vllm's bench.py workload exactly: `random.seed(0)`, 256 sequences,
for each one a length uniform in [100, 1024] then that many ids uniform in
[0, 10000], then the 256 output lengths, uniform in [100, 1024] (133,966 output
tokens); temperature 0.6, ignore_eos, a Qwen3-0.6B-shaped model with random bf16
weights, max_model_len 4096. (bench/throughput.py draws ids over the whole vocabulary,
so its workload is a different one: 138,985 output tokens.)

Latency, measured the same way for both engines, through the offline `LLM.generate`:
- decode step time at batch B: B prompts of 32 tokens generate 64 and then 320
  tokens each (greedy, ignore_eos); (t320 - t64) / 256 is the steady-state time of one
  decode step — start-up of the request, prefill and the output path cancel out.
- time to first token: a 1,024-token prompt, max_tokens=1, median of 5 calls, each on a
  fresh prompt (and, as `ttft_ms_1024_prefix_cached`, the same prompt 5 times: a prefix-cache hit).
- start-up: LLM(...) constructed and ready (ours has no torch.compile to pay for).

GPU time per step ("where the time goes"), at batch 64 and 256, over the same decode
window: the host wall per step as above, and from torch.profiler (CUDA activity) the
GPU busy time per step (the union of kernel, memcpy and memset intervals), the sum of
kernel durations and the span from first to last GPU activity, each as (long run -
short run) / 256; GPU idle = 1 - busy / host wall. Against the per-step floor: the
weights plus the live KV of the window's steps at the copy rate (bench/throughput.py's
model). The profiler sees only its own process's kernels, hence vLLM's in-process phase.

The roofline floor comes from bench/throughput.py's model with the copy and matmul
rates measured here. Prints tables and writes JSON whose top level carries
`ratio_vs_vllm` (ours / vLLM output tok/s) and `fraction_of_roofline` (ours).

`--tiny` is the CPU smoke mode (tests/bench/): a tiny random Qwen3, a few short
sequences, nominal ceilings; with --vllm-site pointing at a stand-in vLLM.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import Engine, ceilings, run_subprocess, worker_env, write_models  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one run: the H200's (FULL) or the CPU smoke test's (TINY)."""
    num_seqs: int = 256                 # the first num_seqs sequences of nano-vllm's draw
    max_prompt_len: int = 1024          # prompts cut to this many tokens (1024: none is)
    max_output_len: int = 1024          # output lengths capped at this (1024: none is)
    decode_batches: tuple[int, ...] = (1, 16, 64, 256)
    gpu_time_batches: tuple[int, ...] = (64, 256)
    decode_prompt_len: int = 32
    window: tuple[int, int] = (64, 320)  # decode window: the short and the long run's output length
    ttft_prompt_len: int = 1024


FULL = Plan()
TINY = Plan(num_seqs=4, max_prompt_len=48, max_output_len=8, decode_batches=(1, 4), gpu_time_batches=(4,),
            window=(4, 12), ttft_prompt_len=64)


def nano_vllm_workload(plan: Plan = FULL) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py draw, call for call (random.seed(0), then randint)."""
    rng = random.Random(0)          # the same stream as the module-level random after seed(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    max_tokens = [rng.randint(100, 1024) for _ in range(256)]
    return ([p[:plan.max_prompt_len] for p in prompts[:plan.num_seqs]],
            [min(m, plan.max_output_len) for m in max_tokens[:plan.num_seqs]])


def workload_record(plan: Plan, tiny: bool) -> dict:
    """What the JSON says about the throughput workload."""
    prompts, outs = nano_vllm_workload(plan)
    return {"name": "nano-vllm bench.py", "num_seqs": len(prompts), "output_tokens": sum(outs),
            "prompt_tokens": sum(map(len, prompts)), "temperature": 0.6, "ignore_eos": True,
            "model": "tiny random Qwen3 (smoke)" if tiny else "Qwen3-0.6B shape, random bf16 weights",
            "max_model_len": 4096}


# ---------------------------------------------------------------------------- the worker (one engine)

def decode_prompts(rng: random.Random, batch: int, plan: Plan) -> list[list[int]]:
    return [[rng.randint(0, 10000) for _ in range(plan.decode_prompt_len)] for _ in range(batch)]


def decode_step_ms(engine: Engine, prompts: list[list[int]], plan: Plan) -> float:
    """Host wall time of one steady decode step: (t_long - t_short) / steps (module docstring)."""
    short, long = plan.window
    t_short, _ = engine.generate(prompts, [short] * len(prompts), 0.0)
    t_long, _ = engine.generate(prompts, [long] * len(prompts), 0.0)
    return 1e3 * (t_long - t_short) / (long - short)


def latency(engine: Engine, plan: Plan) -> dict:
    rng = random.Random(1)
    decode = {str(b): decode_step_ms(engine, decode_prompts(rng, b, plan), plan) for b in plan.decode_batches}
    # NOTE: a fresh prompt per call: a repeated one hits the prefix cache (both
    # engines cache by default) and times a one-token prefill. The repeat is kept
    # beside it, named as what it is: results written before 2026-12-06 hold that
    # cached kind under ttft_ms_1024.
    fresh = [engine.generate([[rng.randint(0, 10000) for _ in range(plan.ttft_prompt_len)]], [1], 0.0)[0]
             for _ in range(6)][1:]
    cached_prompt = [rng.randint(0, 10000) for _ in range(plan.ttft_prompt_len)]
    cached = [engine.generate([cached_prompt], [1], 0.0)[0] for _ in range(6)][1:]
    return {"decode_step_ms": decode, "ttft_ms_1024": 1e3 * statistics.median(fresh),
            "ttft_ms_1024_prefix_cached": 1e3 * statistics.median(cached)}


GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_activity(trace_events: list[dict]) -> dict:
    """Busy time (the union of GPU activity intervals), kernel-time sum and span, in µs,
    from a Chrome trace's events (torch.profiler's export_chrome_trace)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace_events
                   if e.get("ph") == "X" and e.get("cat") in GPU_ACTIVITY)
    kernels = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        # NOTE: kernels on two streams may overlap: busy counts the covered time
        # once, so 1 - busy / wall is the time no GPU work ran at all.
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    return {"busy_us": busy, "kernel_sum_us": sum(e["dur"] for e in kernels), "num_kernels": len(kernels),
            "span_us": spans[-1][1] - spans[0][0] if spans else 0.0}


def profiled_run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """One generate under torch.profiler (CUDA activity only): its GPU activity and wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    # (the smoke mode on a CPU records CPU ops: no GPU activity, zeros)
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        seconds, _ = engine.generate(prompts, [max_tokens] * len(prompts), 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return gpu_activity(events) | {"wall_s": seconds}


def gpu_time(engine: Engine, plan: Plan) -> dict:
    """Per step of the decode window, at each batch of plan.gpu_time_batches (module docstring)."""
    rng = random.Random(2)
    prompts = {b: decode_prompts(rng, b, plan) for b in plan.gpu_time_batches}
    # NOTE: every unprofiled run first, so anything an engine builds lazily for a
    # batch size (a CUDA graph capture, a Triton compile) is built before the
    # profiler first attaches CUPTI: no profiled run pays for it, and no graph is
    # captured after a profiler session (on some stacks CUPTI then traces nothing).
    wall = {b: decode_step_ms(engine, p, plan) for b, p in prompts.items()}
    short, long = plan.window
    steps = long - short
    result = {}
    for b, p in prompts.items():
        # NOTE: the short and the long run share their prompts, prefill and
        # prefix-cache hits: the difference is (long - short) decode steps.
        a, z = profiled_run(engine, p, short), profiled_run(engine, p, long)
        busy = (z["busy_us"] - a["busy_us"]) / steps / 1e3
        result[str(b)] = {
            "host_wall_ms": wall[b], "gpu_busy_ms": busy,
            "gpu_kernel_sum_ms": (z["kernel_sum_us"] - a["kernel_sum_us"]) / steps / 1e3,
            "gpu_span_ms": (z["span_us"] - a["span_us"]) / steps / 1e3,
            "gpu_idle_fraction": 1 - busy / wall[b] if wall[b] > 0 else None,
            "profiled_host_wall_ms": 1e3 * (z["wall_s"] - a["wall_s"]) / steps,
            "kernels_per_step": (z["num_kernels"] - a["num_kernels"]) / steps,
            "num_kernels_long_run": z["num_kernels"]}
    return result


def run_worker(kind: str, model_dir: str, trace_level: str, phases: list[str], plan: Plan) -> dict:
    engine = Engine(kind, model_dir, trace_level)
    engine.generate([list(range(1, 9))], [16], 0.0)                     # warm-up, as nano-vllm's bench
    result = {"engine": kind, "startup_seconds": engine.startup_s, "settings": engine.settings(),
              "phases": phases}
    if "throughput" in phases:
        prompts, max_tokens = nano_vllm_workload(plan)
        seconds, generated = engine.generate(prompts, max_tokens, 0.6)
        result["throughput"] = {"seconds": seconds, "output_tokens": generated, "tok_per_s": generated / seconds}
    if "latency" in phases:
        result |= latency(engine, plan)
    if "gpu_time" in phases:
        result["gpu_time"] = gpu_time(engine, plan)
    engine.shutdown()
    return result


# ---------------------------------------------------------------------------- the driver

def spawn(kind: str, model_dir: str, phases: list[str], vllm_site: str | None, *, trace_level: str = "off",
          multiprocess: bool | None = False, tiny: bool = False, timeout_s: float = 420) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--model-dir", model_dir,
           "--trace-level", trace_level, "--phases", ",".join(phases)] + (["--tiny"] if tiny else [])
    label = f"{kind} (multiprocessing {multiprocess}, trace {trace_level}): {', '.join(phases)}"
    return run_subprocess(label, cmd, worker_env(kind, vllm_site, multiprocess), timeout_s)


def step_floor_ms(batch: int, plan: Plan, copy_bw: float, matmul_rate: float) -> float:
    """The per-step floor over the decode window: weights + live KV at the copy rate,
    from bench/throughput.py's roofline (the long run's decode bytes less the short run's)."""
    from throughput import roofline
    prompts = [[0] * plan.decode_prompt_len] * batch
    short, long = plan.window
    a, z = (roofline(prompts, [n] * batch, copy_bw, matmul_rate)["decode_bytes"] for n in (short, long))
    return 1e3 * (z - a) / (long - short) / copy_bw


def add_floor(gpu: dict | None, floor_ms: dict) -> dict | None:
    if not gpu:
        return gpu
    return {b: r | {"floor_ms": floor_ms[b], "gpu_busy_over_floor": r["gpu_busy_ms"] / floor_ms[b],
                    "host_wall_over_floor": r["host_wall_ms"] / floor_ms[b]} for b, r in gpu.items()}


def tok_per_s(r: dict | None) -> float | None:
    return r["throughput"]["tok_per_s"] if r and "throughput" in r else None


def print_tables(result: dict, plan: Plan) -> None:
    roof = result["roofline"]
    rows: list[tuple[str, Any]]                     # (name, its result; runs that did not happen are dropped below)
    rows = [(name, result.get(key)) for name, key in
            (("vllm_anatomy", "vllm_anatomy"), ("vLLM", "vllm"), ("vllm_anatomy spans", "vllm_anatomy_trace_spans"),
             ("vllm_anatomy mp", "vllm_anatomy_mp"))]
    rows = [(n, r) for n, r in rows if r and "throughput" in r]
    print(f"{'':24}{'output tok/s':>14}{'seconds':>10}{'start-up s':>12}")
    for name, r in rows:
        t = r["throughput"]
        print(f"{name:24}{t['tok_per_s']:>14.0f}{t['seconds']:>10.2f}{r['startup_seconds']:>12.1f}")
    print(f"{'roofline floor':24}{roof['floor_tok_per_s']:>14.0f}{roof['floor_seconds']:>10.2f}")
    if result.get("ratio_vs_vllm"):
        print(f"ratio vs vLLM: {result['ratio_vs_vllm']:.3f}x (target >= 1.10); "
              f"ours at {100 * result['fraction_of_roofline']:.1f} % of the floor (target >= 80 %), "
              f"vLLM at {100 * result['vllm_fraction_of_roofline']:.1f} %")
    latency_rows = [(n, r) for n, r in rows if "decode_step_ms" in r]
    if latency_rows:
        print(f"{'decode step ms':24}" + "".join(f"{'B=' + str(b):>10}" for b in plan.decode_batches)
              + f"{'TTFT':>10}")
        for name, r in latency_rows:
            print(f"{name:24}" + "".join(f"{r['decode_step_ms'][str(b)]:>10.2f}" for b in plan.decode_batches)
                  + f"{r['ttft_ms_1024']:>10.1f}")
    gpu = result.get("gpu_time_per_step")
    if gpu:
        print(f"per decode step, ms{'':5}{'B':>5}{'host wall':>11}{'GPU busy':>10}{'kernels':>9}"
              f"{'GPU idle':>10}{'floor':>8}{'busy/floor':>12}")
        for name, key in (("vllm_anatomy", "vllm_anatomy"), ("vLLM in-process", "vllm")):
            for b, r in (gpu.get(key) or {}).items():
                idle = r["gpu_idle_fraction"]
                print(f"{name:24}{b:>5}{r['host_wall_ms']:>11.2f}{r['gpu_busy_ms']:>10.2f}"
                      f"{r['gpu_kernel_sum_ms']:>9.2f}{'' if idle is None else f'{100 * idle:.1f}%':>10}"
                      f"{r['floor_ms']:>8.2f}{r['gpu_busy_over_floor']:>11.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-site", help="directory with an importable vLLM (the slim bundle, unpacked)")
    ap.add_argument("--out", default="bench/results/vs_vllm_h200.json")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-spans", action="store_true", help="skip our run at --trace-level spans")
    ap.add_argument("--skip-gpu-time", action="store_true",
                    help="skip the profiled GPU time per step (and so vLLM's second, in-process start-up)")
    ap.add_argument("--ours-mp", action="store_true",
                    help="one more row: ours with VLLM_ENABLE_V1_MULTIPROCESSING=1 (EngineCore in its own process)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny model, tiny workload, nominal ceilings")
    ap.add_argument("--worker-timeout", type=float, default=420, help="seconds one engine's subprocess may take")
    ap.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--trace-level", default="off", help=argparse.SUPPRESS)
    ap.add_argument("--phases", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    plan = TINY if args.tiny else FULL
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args.worker, args.model_dir, args.trace_level,
                                                args.phases.split(","), plan)), flush=True)
        return
    if not args.vllm_site:
        sys.exit("--vllm-site is required (see ../shared/peers/vllm/README.md)")
    import torch
    if not torch.cuda.is_available() and not args.tiny:
        sys.exit("bench/vs_vllm.py needs a CUDA device (or --tiny, the CPU smoke mode)")
    from throughput import roofline                            # bench/throughput.py

    prompts, outs = nano_vllm_workload(plan)
    copy, mm = ceilings(args.tiny)
    roof = roofline(prompts, outs, copy["bytes_per_s"], mm["flop_per_s"])
    floor_ms = {str(b): step_floor_ms(b, plan, copy["bytes_per_s"], mm["flop_per_s"]) for b in plan.gpu_time_batches}
    result = {
        "bench": "vs_vllm", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "machine": platform.node(), "smoke": args.tiny,
        "ratio_vs_vllm": None, "fraction_of_roofline": None, "vllm_fraction_of_roofline": None,
        "ratio_vs_vllm_trace_spans": None, "ratio_vs_vllm_mp": None,
        "workload": workload_record(plan, args.tiny),
        "plan": dataclasses.asdict(plan),
        "copy_ceiling_bytes_per_s": copy["bytes_per_s"], "matmul_ceiling_flop_per_s": mm["flop_per_s"],
        "ceilings_nominal": args.tiny, "roofline": roof,
    }

    def save() -> None:
        ours_tps, vllm_tps = tok_per_s(result.get("vllm_anatomy")), tok_per_s(result.get("vllm"))
        if ours_tps:
            result["fraction_of_roofline"] = ours_tps / roof["floor_tok_per_s"]
        if vllm_tps:
            result["vllm_fraction_of_roofline"] = vllm_tps / roof["floor_tok_per_s"]
            for key, row in (("ratio_vs_vllm", "vllm_anatomy"), ("ratio_vs_vllm_trace_spans", "vllm_anatomy_trace_spans"),
                             ("ratio_vs_vllm_mp", "vllm_anatomy_mp")):
                tps = tok_per_s(result.get(row))
                result[key] = tps / vllm_tps if tps else None
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    with tempfile.TemporaryDirectory() as ours_dir, tempfile.TemporaryDirectory() as vllm_dir:
        vllm_dir, result["vllm_model_config"] = write_models(ours_dir, vllm_dir, args.tiny)
        gpu_time_phase = [] if args.skip_gpu_time else ["gpu_time"]
        latency_phase = [] if args.skip_latency else ["latency"]
        kw = {"tiny": args.tiny, "timeout_s": args.worker_timeout}
        result["vllm_anatomy"] = spawn("ours", ours_dir, ["throughput"] + latency_phase + gpu_time_phase, None, **kw)
        save()
        # NOTE: vLLM's throughput and latency run as ../shared/peers/vllm/ runs it: its default
        # multiprocess engine (VLLM_ENABLE_V1_MULTIPROCESSING unset).
        result["vllm"] = spawn("vllm", vllm_dir, ["throughput"] + latency_phase, args.vllm_site,
                               multiprocess=None, **kw)
        save()
        if gpu_time_phase:
            # NOTE: torch.profiler sees the kernels of its own process only: vLLM's GPU
            # time is measured on a second engine in this subprocess's process.
            vllm_inproc = spawn("vllm", vllm_dir, gpu_time_phase, args.vllm_site, multiprocess=False, **kw)
            result["gpu_time_per_step"] = {
                "window": {"prompt_tokens": plan.decode_prompt_len, "output_lengths": list(plan.window),
                           "steps": plan.window[1] - plan.window[0]},
                "floor_ms": floor_ms,
                "vllm_anatomy": add_floor(result["vllm_anatomy"].get("gpu_time"), floor_ms),
                "vllm": add_floor(vllm_inproc.get("gpu_time"), floor_ms),
                "vllm_engine": "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), a second start-up in its own "
                               "subprocess after the throughput one: torch.profiler sees its own process's "
                               "kernels only. host_wall_ms is that engine's; vLLM's default multiprocess "
                               "engine's decode step is vllm.decode_step_ms",
                "vllm_inproc_run": {k: v for k, v in vllm_inproc.items() if k != "gpu_time"},
            }
            save()
        if not args.skip_spans:
            result["vllm_anatomy_trace_spans"] = spawn("ours", ours_dir, ["throughput"], None,
                                                       trace_level="spans", **kw)
            save()
        if args.ours_mp:
            result["vllm_anatomy_mp"] = spawn("ours", ours_dir, ["throughput"] + latency_phase, None,
                                              multiprocess=True, **kw)
            save()
    print_tables(result, plan)
    print(f"wrote {args.out}")
    failed = [k for k in ("vllm_anatomy", "vllm", "vllm_anatomy_trace_spans", "vllm_anatomy_mp")
              if isinstance(result.get(k), dict) and "error" in result[k]]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their errors are in {args.out})")


if __name__ == "__main__":
    main()
