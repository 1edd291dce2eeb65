"""Which thread pays for level spans in steady decoding, CPU only:
OMP_NUM_THREADS=1 .venv/bin/python bench/tracing_threads.py [--rounds 4]

The workload of bench/tracing_host_cost.py (tiny random Llama, 256 requests of
16 + 64 tokens decoding together, async scheduling), one engine at level off
and one at level spans in one process, stepped in lockstep (the order
alternating). Over the steady decode steps (steps 5..59 of each round: no
request is added or finished) it adds, per step, the CPU time of the engine's
thread in each engine's step (Linux schedstat of the main thread), the wall
time of those steps, and the CPU time of the traced engine's own threads: its
span processor (DeferredSpanProcessor, formerly the SDK's
OtelBatchSpanRecordProcessor) and the run store's writer. Those two run beside
the engine's thread and hold the GIL while they run Python (the writer much
less: SQLite releases it), so on a loaded host their time partly lands on the
step. bench/tracing_host_cost.py measures the whole cost, adding requests and
finishing them included; bench/tracing_seams.py says where the engine
thread's part goes.

Prints a table and writes bench/results/tracing_threads_cpu.json.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
import tracing_host_cost as T  # noqa: E402


def thread_cpu_ms(native_id: int | None) -> float:
    """CPU time of one thread of this process (Linux: /proc/self/task/<tid>/schedstat, ns).
    native_id: Thread.native_id, None only for a thread not started yet."""
    if native_id is None:
        raise ValueError("thread_cpu_ms: the thread has not started (no native id)")
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tracing_threads_cpu.json"))
    args = ap.parse_args()
    from vllm_anatomy import SamplingParams
    from vllm_anatomy.sampling_params import RequestOutputKind
    workload = argparse.Namespace(requests=256, prompt_len=16, max_tokens=64, async_scheduling=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, T.VOCAB) for _ in range(16)]} for _ in range(256)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    main_tid = threading.main_thread().native_id
    with tempfile.TemporaryDirectory() as path, tempfile.TemporaryDirectory() as trace_dir:
        T.write_tiny_model(path)
        llm_off = T.make_llm(path, "off", trace_dir, workload)
        before = {t.native_id for t in threading.enumerate()}
        llm_spans = T.make_llm(path, "spans", trace_dir, workload)
        # (the threads the traced engine started: its span processor and the run store's writer)
        background = [t for t in threading.enumerate() if t.native_id not in before]
        engines = {"off": llm_off.llm_engine, "spans": llm_spans.llm_engine}
        T.run_round(engines, prompts, params, "warmup", list(engines))
        cpu = dict.fromkeys(engines, 0.0)
        wall = dict.fromkeys(engines, 0.0)
        bg = {t.name: 0.0 for t in background}
        steps = 0
        for r in range(args.rounds):
            for level, engine in engines.items():
                for i, prompt in enumerate(prompts):
                    engine.add_request(f"r{r}-{i}", prompt, params)
            k = 0
            while any(e.has_unfinished_requests() for e in engines.values()):
                steady = 5 <= k < 60
                bg_before = {t.name: thread_cpu_ms(t.native_id) for t in background}
                order = list(engines) if k % 2 == 0 else list(reversed(engines))
                for level in order:
                    engine = engines[level]
                    if not engine.has_unfinished_requests():
                        continue
                    c, w = thread_cpu_ms(main_tid), time.perf_counter()
                    engine.step()
                    if steady:
                        cpu[level] += thread_cpu_ms(main_tid) - c
                        wall[level] += 1e3 * (time.perf_counter() - w)
                if steady:
                    for t in background:
                        bg[t.name] += thread_cpu_ms(t.native_id) - bg_before[t.name]
                    steps += 1
                k += 1
        for engine in engines.values():
            engine.shutdown()
    table: dict[str, Any]                           # (written to the JSON below)
    table = {"steady_steps": steps,
             "engine_thread_cpu_ms_per_step": {lvl: v / steps for lvl, v in cpu.items()},
             "step_wall_ms": {lvl: v / steps for lvl, v in wall.items()},
             "added_engine_thread_cpu_ms_per_step": (cpu["spans"] - cpu["off"]) / steps,
             "added_wall_ms_per_step": (wall["spans"] - wall["off"]) / steps,
             "traced_engine_background_cpu_ms_per_step": {name: v / steps for name, v in bg.items()}}
    print(f"steady decode steps: {steps} per engine")
    print(f"{'':<34}{'off':>9}{'spans':>9}{'added':>9}")
    print(f"{'engine thread CPU ms/step':<34}{table['engine_thread_cpu_ms_per_step']['off']:>9.3f}"
          f"{table['engine_thread_cpu_ms_per_step']['spans']:>9.3f}{table['added_engine_thread_cpu_ms_per_step']:>9.3f}")
    print(f"{'step wall ms':<34}{table['step_wall_ms']['off']:>9.3f}{table['step_wall_ms']['spans']:>9.3f}"
          f"{table['added_wall_ms_per_step']:>9.3f}")
    for name, v in table["traced_engine_background_cpu_ms_per_step"].items():
        print(f"{name + ' CPU ms/step':<34}{'':>9}{v:>9.3f}")
    T.write_results(args.out, {"workload": {"requests": 256, "prompt_len": 16, "max_tokens": 64,
                                            "async_scheduling": True, "rounds": args.rounds,
                                            "steady_steps": "5..59 of each round"},
                               "machine": T.machine(), **table})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
