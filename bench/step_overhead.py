"""Where a decode step's time goes at batch 256: CUDA graphs with async scheduling,
graphs with synchronous scheduling, and eager (GPU).

    python bench/step_overhead.py [--modes graphs_async,graphs,eager] [--num-seqs 256] [--out FILE]
    OMP_NUM_THREADS=1 python bench/step_overhead.py --cpu [--rounds 3]    # the host phases on a CPU

--cpu: the same per-phase clock on a CPU, with bench/tracing_host_cost.py's
tiny random Llama (2 layers, hidden 64: the forward is cheap) and prompts
uniform in [16, 256]; phases are timed in the thread's CPU time
(time.thread_time: a loaded machine swamps wall time), modes
eager_async (the GPU default's engine loop) and eager; forward_launch is the
whole CPU forward there. Writes bench/results/step_overhead_cpu.json.

256 requests (prompts uniform in [100, 1024] random ids, seed 0; the Qwen3-0.6B
shape with random bf16 weights, as bench/throughput.py) are prefilled, then
decode together. For every step where all 256 decode (one token each), it
records the host time of each phase of the step — Scheduler.schedule,
_update_states, _prepare_inputs, the forward launch (or graph replay), logits,
sampler, the sync wait, _bookkeeping_sync, Scheduler.update_from_output and
OutputProcessor.process_outputs — by wrapping those methods with a clock (this
script only; the engine is unchanged). With async scheduling one engine step
launches step N+1 and then finishes step N, so its phases belong to two
different steps; per step they still add up to the same work.

GPU idle: torch.profiler (CUPTI) records every kernel and copy of a window of
decode steps; idle = 1 - (union of device activity) / (window length). The
target (issue 7): idle <= 15 % with CUDA graphs.

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import qwen3_06b_config, write_random_model  # noqa: E402

PHASES = ["schedule", "update_states", "prepare_inputs", "forward_launch", "compute_logits", "sample",
          "sync_wait", "bookkeeping", "async_output", "update_from_output", "process_outputs"]


class PhaseClock:
    """Wraps bound methods so each call adds its duration to the current step's record."""

    def __init__(self, now=time.perf_counter) -> None:
        self.current: dict[str, float] = {}
        self.now = now

    def wrap(self, obj, method: str, phase: str) -> None:
        fn = getattr(obj, method)

        def timed(*args, **kwargs):
            t = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + self.now() - t
        setattr(obj, method, timed)


def instrument(llm, clock: PhaseClock) -> None:
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.model_executor.driver_worker.model_runner
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.scheduler, "update_from_output", "update_from_output")
    clock.wrap(runner, "_update_states", "update_states")
    clock.wrap(runner, "_prepare_inputs", "prepare_inputs")
    clock.wrap(runner, "_model_forward", "forward_launch")
    if runner.cudagraph_runner is not None:
        clock.wrap(runner.cudagraph_runner, "replay", "forward_launch")
    clock.wrap(runner.model, "compute_logits", "compute_logits")
    clock.wrap(runner.sampler, "forward", "sample")
    clock.wrap(runner, "_bookkeeping_sync", "bookkeeping")
    clock.wrap(runner, "_bookkeeping_async", "bookkeeping")
    # Async scheduling: the output's get_output, one step later (the sync wait, the placeholders' fill,
    # the ModelRunnerOutput); a class attribute, so every step's output is timed.
    from vllm_anatomy.worker.async_output import AsyncGPUModelRunnerOutput
    original = getattr(AsyncGPUModelRunnerOutput, "_unclocked_get_output", AsyncGPUModelRunnerOutput.get_output)
    # (setattr: class attributes patched on purpose, which mypy rejects as plain assignments)
    setattr(AsyncGPUModelRunnerOutput, "_unclocked_get_output", original)   # (this run's clock replaces the last one's)
    setattr(AsyncGPUModelRunnerOutput, "get_output", original)
    clock.wrap(AsyncGPUModelRunnerOutput, "get_output", "async_output")
    clock.wrap(engine.output_processor, "process_outputs", "process_outputs")
    # The step's one sync point (sync: _bookkeeping_sync; async: the output
    # handle's get_output, one step later) waits through the runner's tracer.
    tracer = runner.tracer
    wait = tracer.wait

    def wait_timed(event):
        wait(event)
        clock.current["sync_wait"] = clock.current.get("sync_wait", 0.0) + tracer.wait_s
    tracer.wait = wait_timed


def gpu_idle(trace_path: str) -> dict:
    """Union of kernel/memcpy/memset intervals vs the window they span."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not spans:
        return {"busy_us": 0, "window_us": 0, "idle_fraction": None, "kernels": 0}
    busy, (cur_s, cur_e) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    return {"busy_us": busy, "window_us": window, "idle_fraction": 1 - busy / window, "kernels": len(spans)}


def run(path: str, args, mode: str) -> dict:
    from vllm_anatomy import LLM, SamplingParams
    from vllm_anatomy.sampling_params import RequestOutputKind
    rng = random.Random(0)
    if args.cpu:
        from tracing_host_cost import VOCAB
        llm = LLM(path, device="cpu", max_model_len=512, max_num_seqs=args.num_seqs, max_num_batched_tokens=8192,
                  async_scheduling=mode.endswith("_async"))
        prompts = [[rng.randint(3, VOCAB - 1) for _ in range(rng.randint(16, 256))] for _ in range(args.num_seqs)]
    else:
        llm = LLM(path, max_model_len=4096, enforce_eager=mode == "eager", async_scheduling=mode.endswith("_async"))
        vocab = qwen3_06b_config().vocab_size
        prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(100, 1024))] for _ in range(args.num_seqs)]
    # NOTE: FINAL_ONLY, as LLM.generate asks (no per-step RequestOutput per request).
    sp = SamplingParams(temperature=0.6, max_tokens=args.decode_steps + 2, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
    clock = PhaseClock(time.thread_time if args.cpu else time.perf_counter)
    instrument(llm, clock)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    records: list[dict] = []
    profiler, profiled_steps, trace_path = None, 0, None
    while engine.has_unfinished_requests():
        num_decoding = sum(1 for r in engine.engine_core.scheduler.running if r.num_output_tokens > 0)
        full_decode = num_decoding == args.num_seqs
        warmed = sum(r["full_decode"] for r in records) >= 8
        if full_decode and warmed and trace_path is None and profiler is None and not args.cpu:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.start()
        clock.current = {}
        t = clock.now()
        engine.step()
        records.append({"full_decode": full_decode, "wall": clock.now() - t, **clock.current})
        if profiler is not None:
            profiled_steps += 1
            if profiled_steps == args.profile_steps or not full_decode:
                torch.cuda.synchronize()
                profiler.stop()
                trace_path = os.path.join(tempfile.mkdtemp(), "trace.json")
                profiler.export_chrome_trace(trace_path)
                profiler = None
    cc = engine.vllm_config.compilation_config
    async_scheduling = engine.vllm_config.scheduler_config.async_scheduling
    engine.shutdown()
    # NOTE: free this engine's KV cache (most of the device) before the next
    # mode's engine sizes its own; the method wrappers above form cycles.
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    decode = [r for r in records if r["full_decode"]][2:]          # skip the first two (warm caches)
    med = {p: 1e3 * statistics.median(r.get(p, 0.0) for r in decode) for p in PHASES + ["wall"]}
    # The host's own work: the step but the forward (on a CPU the forward is the model's compute).
    med["host_but_forward"] = 1e3 * statistics.median(r["wall"] - r.get("forward_launch", 0.0) for r in decode)
    cpu_ms = med["wall"] - med["sync_wait"]
    idle = gpu_idle(trace_path) if trace_path else None
    return {"cudagraph_mode": cc.cudagraph_mode, "async_scheduling": async_scheduling,
            "decode_steps_measured": len(decode),
            "median_ms": med, "host_busy_ms": cpu_ms, "gpu_idle": idle, "profiled_steps": profiled_steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--modes", default="graphs_async,graphs,eager",
                    help="graphs_async (the default engine on a GPU), graphs (sync scheduling), eager")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true", help="the tiny model on the CPU, CPU-time clock")
    ap.add_argument("--rounds", type=int, default=1, help="(--cpu) each mode this many times, alternated")
    args = ap.parse_args()
    if args.cpu:
        args.modes = args.modes if args.modes != "graphs_async,graphs,eager" else "eager_async,eager"
        args.decode_steps = max(args.decode_steps, 64)
    elif not torch.cuda.is_available():
        sys.exit("bench/step_overhead.py needs a CUDA device (or --cpu)")
    args.out = args.out or f"bench/results/step_overhead_{'cpu' if args.cpu else 'h200'}.json"
    # NOTE: the phases are timed by wrapping the scheduler's and the runner's
    # methods in this process: the engine must run here (LLMEngine.engine_core),
    # whatever VLLM_ENABLE_V1_MULTIPROCESSING says.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    results: dict[str, Any]                         # (the JSON this bench writes)
    results = {"bench": "step_overhead", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "gpu": torch.cuda.get_device_name() if not args.cpu else None, "torch": torch.__version__,
               "workload": vars(args), "modes": {}}
    with tempfile.TemporaryDirectory() as path:
        if args.cpu:
            from tracing_host_cost import write_tiny_model
            write_tiny_model(path)
        else:
            write_random_model(path)
        rounds: dict[str, list[dict]] = {}
        for _ in range(args.rounds):
            for mode in args.modes.split(","):
                if mode not in ("graphs_async", "graphs", "eager", "eager_async"):
                    sys.exit(f"unknown mode {mode!r}")
                rounds.setdefault(mode, []).append(run(path, args, mode))
        for mode, runs in rounds.items():
            # (several rounds: each phase's median over the rounds' medians)
            results["modes"][mode] = {**runs[0], "median_ms": {
                p: statistics.median(r["median_ms"][p] for r in runs) for p in runs[0]["median_ms"]},
                "rounds_median_ms": [r["median_ms"] for r in runs]}
    print(f"median per decode step at batch {args.num_seqs} (host ms):")
    modes = list(results["modes"])
    print(f"{'phase':<20}" + "".join(f"{m:>12}" for m in modes))
    for p in PHASES + ["wall", "host_but_forward"]:
        print(f"{p:<20}" + "".join(f"{results['modes'][m]['median_ms'][p]:>12.2f}" for m in modes))
    print(f"{'step / s':<20}" + "".join(f"{1e3 / results['modes'][m]['median_ms']['wall']:>12.1f}"
                                          for m in modes))
    for m in modes:
        idle = results["modes"][m]["gpu_idle"]
        if idle and idle["idle_fraction"] is not None:
            print(f"{m}: GPU idle {100 * idle['idle_fraction']:.1f} % of {idle['window_us'] / 1e3:.1f} ms "
                  f"({results['modes'][m]['profiled_steps']} steps profiled; target <= 15 % with graphs)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
