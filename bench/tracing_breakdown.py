"""Where tracing's host time goes: per function, per engine step, at each level.

    OMP_NUM_THREADS=1 .venv/bin/python bench/tracing_breakdown.py          # CPU, tiny model
    python bench/tracing_breakdown.py --gpu                                 # the 256-sequence GPU workload

bench/tracing_overhead.py says *how much* throughput tracing costs; this
says *where*. It wraps a list of functions (the tracing entry points and the
snapshot builders, below) with timers from the outside, runs one engine per
level, one after the other, and reports per engine step:
    - wall ms of the step loop, and the main thread's CPU ms;
    - the CPU ms of the span exporter's thread (it holds the GIL while it
      turns spans into rows: time the engine's thread cannot run);
    - wall ms inside each wrapped function (they nest: a snapshot's time
      includes the builders it calls);
    - spans and snapshot bytes written per step (from the run store).
CPU: the tiny random Llama of bench/tracing_host_cost.py, 256 requests of
16 + 64 tokens. GPU: bench/throughput.py's workload (Qwen3-0.6B shape).
The timers cost a little themselves: compare levels, not absolute figures.

Prints a table and writes bench/results/tracing_breakdown_{cpu,h200}.json.
"""
from __future__ import annotations

import argparse
import collections
import functools
import gc
import glob
import json
import os
import platform
import random
import sqlite3
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (module, class or None, function, label): what gets a timer.
TIMED = [
    ("vllm_anatomy.tracing.step_tracer", "StepSnapshotter", "__call__", "StepSnapshotter (the step snapshot)"),
    ("vllm_anatomy.core.sched.scheduler", "Scheduler", "snapshot", "Scheduler.snapshot"),
    ("vllm_anatomy.tracing.kv_snapshotter", "KVCacheSnapshotter", "snapshot", "KVCacheSnapshotter.snapshot"),
    ("vllm_anatomy.core.kv_cache_manager", "KVCacheManager", "allocate_slots", "KVCacheManager.allocate_slots"),
    ("vllm_anatomy.tracing.runner_tracer", "StepSnapshots", "record", "StepSnapshots.record (runner snapshot)"),
    ("vllm_anatomy.worker.gpu_model_runner", "GPUModelRunner", "snapshot", "GPUModelRunner.snapshot"),
    ("vllm_anatomy.tracing.device_timer", "DeviceTimer", "resolve", "DeviceTimer.resolve"),
    ("vllm_anatomy.tracing.store", "RunStore", "write_snapshot", "RunStore.write_snapshot"),
    ("vllm_anatomy.tracing.store", "RunStore", "write_spans", "RunStore.write_spans"),
    ("vllm_anatomy.core.sched.scheduler", "Scheduler", "schedule", "Scheduler.schedule"),
    ("vllm_anatomy.core.sched.scheduler", "Scheduler", "update_from_output", "Scheduler.update_from_output"),
]
EXPORT_THREAD = "span exporter thread (CPU)"


class Timers:
    def __init__(self) -> None:
        self.wall: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def install(self) -> None:
        import importlib
        for module, cls, fn, label in TIMED:
            owner = getattr(importlib.import_module(module), cls) if cls else importlib.import_module(module)
            # NOTE: a timer whose target moved must fail here, not time nothing in silence.
            setattr(owner, fn, self._wrap(getattr(owner, fn), label))
        from vllm_anatomy.tracing import span_export
        export = span_export.StoreSpanExporter.export

        def timed_export(exporter, spans):
            t = time.thread_time()
            try:
                return export(exporter, spans)
            finally:
                self.wall[EXPORT_THREAD] += time.thread_time() - t
        setattr(span_export.StoreSpanExporter, "export", timed_export)   # (patched on purpose: setattr, not a method assignment)

    def _wrap(self, fn, label):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[label] += time.perf_counter() - t
                self.calls[label] += 1
        return timed

    def reset(self) -> None:
        self.wall.clear()
        self.calls.clear()


def store_stats(trace_dir: str, since: dict) -> dict:
    """Spans and snapshot bytes in the run stores of trace_dir (minus `since`)."""
    spans = snaps = nbytes = 0
    for path in glob.glob(os.path.join(trace_dir, "*.sqlite")):
        conn = sqlite3.connect(path)
        spans += conn.execute("SELECT count(*) FROM spans").fetchone()[0]
        n, b = conn.execute("SELECT count(*), coalesce(sum(length(data)), 0) FROM snapshots").fetchone()
        snaps, nbytes = snaps + n, nbytes + b
        conn.close()
    return {"spans": spans - since.get("spans", 0), "snapshots": snaps - since.get("snapshots", 0),
            "snapshot_bytes": nbytes - since.get("snapshot_bytes", 0)}


def run_level(make_llm, run_workload, level: str, timers: Timers, trace_dir: str) -> dict:
    llm = make_llm(level, trace_dir)
    run_workload(llm, warmup=True)
    before = store_stats(trace_dir, {})
    timers.reset()
    t, cpu = time.perf_counter(), time.thread_time()
    tokens = run_workload(llm, warmup=False)
    wall, main_cpu = time.perf_counter() - t, time.thread_time() - cpu
    steps = timers.calls["Scheduler.schedule"]
    llm.llm_engine.shutdown()
    stats = store_stats(trace_dir, before)
    del llm
    gc.collect()
    per_step = {k: 1e3 * v / steps for k, v in sorted(timers.wall.items(), key=lambda kv: -kv[1])}
    return {"steps": steps, "tokens": tokens, "tok_per_s": tokens / wall, "ms_per_step": 1e3 * wall / steps,
            "main_thread_cpu_ms_per_step": 1e3 * main_cpu / steps, "functions_ms_per_step": per_step,
            "spans_per_step": stats["spans"] / steps, "snapshot_kb_per_step": stats["snapshot_bytes"] / steps / 1e3}


def cpu_setup(args, tmp: str):
    from tracing_host_cost import VOCAB, write_tiny_model

    from vllm_anatomy import LLM, SamplingParams
    from vllm_anatomy.sampling_params import RequestOutputKind
    write_tiny_model(tmp)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(16)]} for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    def make_llm(level, trace_dir):
        return LLM(tmp, device="cpu", max_model_len=512, max_num_seqs=args.requests,
                   max_num_batched_tokens=max(2048, 16 * args.requests), num_gpu_blocks_override=args.requests * 6 + 64,
                   trace_level=level, trace_dir=None if level == "off" else trace_dir)

    def run_workload(llm, warmup):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return make_llm, run_workload


def gpu_setup(args, tmp: str):
    from throughput import qwen3_06b_config, workload, write_random_model

    from vllm_anatomy import LLM, SamplingParams
    write_random_model(tmp)
    prompts, outs = workload(args.requests, 100, 1024, qwen3_06b_config().vocab_size)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]

    def make_llm(level, trace_dir):
        return LLM(tmp, max_model_len=4096, trace_level=level, trace_dir=None if level == "off" else trace_dir)

    def run_workload(llm, warmup):
        if warmup:
            llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
            return 0
        outs_ = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs_)
    return make_llm, run_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--levels", default="off,spans,full")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"tracing_breakdown_{'h200' if args.gpu else 'cpu'}.json")
    timers = Timers()
    timers.install()
    rounds: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as trace_dir:
        make_llm, run_workload = (gpu_setup if args.gpu else cpu_setup)(args, tmp)
        for level in args.levels.split(","):
            r = run_level(make_llm, run_workload, level, timers, trace_dir)
            rounds.setdefault(level, []).append(r)
            print(f"\n{level}: {r['tok_per_s']:.0f} tok/s, {r['ms_per_step']:.2f} ms/step "
                  f"(main thread CPU {r['main_thread_cpu_ms_per_step']:.2f}), {r['spans_per_step']:.1f} spans "
                  f"and {r['snapshot_kb_per_step']:.1f} KB of snapshots per step", flush=True)
    # NOTE: a level given more than once (off,spans,off,spans) runs in rounds: its fastest round is shown.
    results = {lvl: min(rs, key=lambda r: r["ms_per_step"]) for lvl, rs in rounds.items()}
    names = sorted({k for r in results.values() for k in r["functions_ms_per_step"]},
                   key=lambda k: -max(r["functions_ms_per_step"].get(k, 0) for r in results.values()))
    print(f"\n{'ms per step':<36}" + "".join(f"{lvl:>10}" for lvl in results))
    for key in ("ms_per_step", "main_thread_cpu_ms_per_step"):
        print(f"{key:<36}" + "".join(f"{r[key]:>10.2f}" for r in results.values()))
    for name in names:
        print(f"  {name:<34}" + "".join(f"{r['functions_ms_per_step'].get(name, 0):>10.2f}" for r in results.values()))
    print(f"{'spans per step':<36}" + "".join(f"{r['spans_per_step']:>10.1f}" for r in results.values()))
    print(f"{'snapshot KB per step':<36}" + "".join(f"{r['snapshot_kb_per_step']:>10.1f}" for r in results.values()))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"workload": {"gpu": args.gpu, "requests": args.requests},
                   "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
                   "levels": results, "rounds": rounds}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
