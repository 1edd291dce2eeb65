"""Host stalls of the throughput run, on the CPU: which engine steps take > 1 ms longer
than usual on the host, and whether a garbage collection is why.

    python bench/host_stalls.py                                  # nano-vllm's workload, 256 sequences
    python bench/host_stalls.py --num-seqs 16 --max-output 32 --out /tmp/s.json    # a quick look
    python bench/host_stalls.py --no-gc --out /tmp/s_nogc.json   # the collector off: what GC costs

Issue 34: on an H100 the GPU sat idle 0.14 s in 55 gaps > 1 ms during the
throughput run (bench/results/gpu_breakdown_h100_gaps.json). With async
scheduling the host prepares step N+1 while the device runs step N, so such a
gap is a step whose host work ran > 1 ms longer than usual.

This runs that run's whole host path on this CPU, without a model: the offline
engine as bench/gpu_breakdown.py builds it (LLMEngine in-process, async
scheduling on, trace level off, max_num_seqs 1024, 16,384 tokens a step, the
H100's 36,031 KV blocks, bench/throughput.py's config.json and word-level
tokenizer), nano-vllm's workload (bench/vs_vllm.py: 256 prompts and outputs
uniform in [100, 1024], temperature 0.6, ignore_eos), all 256 added before the
first step as LLM.generate does, from the first step to the last finish. Only
the model is a stand-in (HostOnlyModel: no weights, no KV cache, logits over
64 columns), so GPUModelRunner's host work runs for real on CPU tensors —
_update_states, _prepare_inputs (block table, positions, slot mapping),
the sampler, _bookkeeping_async — beside Scheduler.schedule /
update_from_output and OutputProcessor.process_outputs (detokenization on).
(bench/host_cost.py times the same scheduler and output phases with
fabricated ModelRunnerOutputs for decode steps only; here the runner's side
and the prefill steps are in too.)

Per engine step (one LLMEngine.step(): with async scheduling it launches step
N+1, then finishes step N): each phase's time (bench/step_overhead.py's clock,
time.thread_time: the thread's CPU time, which a loaded machine does not
inflate), the tokens it scheduled and how many were prompt tokens, the
requests it finished, and every garbage collection (gc.callbacks: generation,
duration, objects collected) that fell inside it. host = the step minus the
stand-in model (forward and logits). Prints the steps whose host time exceeds
the median of the 10 steps either side by > --stall-ms (1 ms), where in the
run they fall (fraction of the steps), what they had (collections, tokens,
prompt tokens, finishes, the longest phases), the median step of each kind
(prefill / decode finishing requests / decode) and the totals; writes JSON
(bench/results/host_stalls_cpu.json).

"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, cast
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from step_overhead import PhaseClock, instrument  # noqa: E402
from throughput import qwen3_06b_config, write_word_tokenizer  # noqa: E402
from vs_vllm import FULL, nano_vllm_workload  # noqa: E402

NUM_GPU_BLOCKS = 36031          # what the engine sized on the H100 (gpu_breakdown_h100_gaps.json)
LOGIT_COLUMNS = 64              # the stand-in model's logits: token ids 0..63 (all in the vocabulary)
NEIGHBOURS = 10                 # a stall is measured against the median of 10 steps each side
STAND_IN = ("forward_launch", "compute_logits", "bench")  # the stand-in model's and this script's own time


@dataclass
class GCEvent:
    """One collection: when (time.time_ns(): the profiler's clock, see gpu_breakdown --gc-log),
    how long, which generation, how many objects it freed, and the engine step it fell in."""
    start_ns: int
    duration_s: float
    generation: int
    collected: int
    step: int


class GCLog:
    """Records every garbage collection through gc.callbacks while attached (a context manager).
    `step` is whatever the caller sets it to (-1: outside any step)."""

    def __init__(self) -> None:
        self.events: list[GCEvent] = []
        self.step = -1
        self._start_ns = 0
        self._start_perf = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start_ns, self._start_perf = time.time_ns(), time.perf_counter()
        elif phase == "stop":
            self.events.append(GCEvent(self._start_ns, time.perf_counter() - self._start_perf,
                                       info["generation"], info.get("collected", 0), self.step))

    def __enter__(self) -> "GCLog":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """Count, total and largest seconds per generation."""
        out = {}
        for generation in (0, 1, 2):
            durations = [e.duration_s for e in self.events if e.generation == generation]
            out[f"gen{generation}"] = {"count": len(durations), "total_s": sum(durations),
                                       "max_s": max(durations, default=0.0)}
        return out


class HostStepLog:
    """Wraps an LLM's llm_engine.step (this script's and bench/gpu_breakdown.py --gc-log's only):
    each call's start and end (time.time_ns()) and its phases (bench/step_overhead.py's clock,
    time.perf_counter), so that a GPU idle gap can be matched with the host step that ran then."""

    def __init__(self, llm) -> None:
        self.steps: list[dict] = []
        self.clock = PhaseClock(time.perf_counter)
        instrument(llm, self.clock)
        engine = llm.llm_engine
        step = engine.step

        def logged_step():
            self.clock.current = {}
            start = time.time_ns()
            outputs = step()
            self.steps.append({"start_ns": start, "end_ns": time.time_ns(), "phases_s": dict(self.clock.current),
                               "num_outputs": len(outputs)})
            return outputs
        engine.step = logged_step


class TritonCompileLog:
    """Records each Triton JIT compilation (an in-memory cache miss: a compile, or a load from
    Triton's disk cache) through triton.knobs' jit hooks while attached: start and end
    (time.time_ns()) and the kernel. Attaches to nothing where Triton has no such knobs."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.available = False
        self._saved: tuple = ()

    @staticmethod
    def _kernel(kwargs: dict) -> str:
        return str(getattr(kwargs.get("fn"), "name", kwargs.get("repr", "?")))

    def _cache_hook(self, **kwargs) -> bool:
        self.events.append({"start_ns": time.time_ns(), "end_ns": None, "kernel": self._kernel(kwargs)})
        return False                      # (True would skip the compilation)

    def _post_compile_hook(self, **kwargs) -> None:
        kernel = self._kernel(kwargs)
        for event in reversed(self.events):
            if event["kernel"] == kernel and event["end_ns"] is None:
                event["end_ns"] = time.time_ns()
                break

    def __enter__(self) -> "TritonCompileLog":
        try:
            from triton import knobs
        except ImportError:
            return self
        runtime = knobs.runtime
        if not (hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")):
            return self
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._cache_hook, self._post_compile_hook
        self.available = True
        return self

    def __exit__(self, *exc_info) -> None:
        if self.available:
            from triton import knobs
            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved


class HostOnlyModel(torch.nn.Module):
    """The stand-in for the model: hidden states of width 1, and random logits over
    LOGIT_COLUMNS token ids, so the sampler runs for real and cheaply."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, attn_metadata) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.randn(hidden_states.shape[0], LOGIT_COLUMNS)


def host_only_executor_class():
    """UniProcExecutor with a CPU worker whose runner has the stand-in model and no KV cache."""
    from vllm_anatomy.executor.uniproc_executor import UniProcExecutor
    from vllm_anatomy.worker.worker import Worker

    class HostOnlyExecutor(UniProcExecutor):
        def _init_executor(self) -> None:
            self.driver_worker = Worker(self.vllm_config, device="cpu", recorder=self.recorder)
            self.driver_worker.init_device()
            # (a duck-typed stand-in: load_model never runs here; a step calls only forward and compute_logits)
            self.driver_worker.model_runner.model = cast(Any, HostOnlyModel())

        def determine_num_available_blocks(self) -> int:
            return NUM_GPU_BLOCKS

        def initialize_from_config(self, num_gpu_blocks: int) -> None:
            # NOTE: the block accounting is the scheduler's and the block table the
            # runner's: both exist without KV tensors, which the stand-in never reads.
            self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks

    return HostOnlyExecutor


def write_model_dir(path: str) -> None:
    """config.json of the Qwen3-0.6B shape (no weights) and the GPU run's word-level tokenizer."""
    cfg = qwen3_06b_config()
    cfg.save_pretrained(path)
    write_word_tokenizer(path, cfg.vocab_size)


def host_only_llm(model_dir: str):
    """The GPU run's offline engine (bench/gpu_breakdown.py's settings) over HostOnlyExecutor;
    model_dir: an empty directory, filled with write_model_dir."""
    from vllm_anatomy import LLM
    from vllm_anatomy.executor.abstract import Executor
    write_model_dir(model_dir)
    executor_class = host_only_executor_class()
    # (this script only: the engine picks its executor class here; the engine is unchanged)
    with mock.patch.object(Executor, "get_class", staticmethod(lambda vllm_config: executor_class)):
        return LLM(model_dir, device="cpu", max_model_len=4096, max_num_seqs=1024, max_num_batched_tokens=16384,
                   async_scheduling=True, trace_level="off")


def run_workload(prompts: list[list[int]], max_tokens: list[int], gc_enabled: bool = True) -> dict:
    """The engine's host path over the workload: per-step records, GC events, memory."""
    from vllm_anatomy import SamplingParams
    from vllm_anatomy.sampling_params import RequestOutputKind

    # NOTE: one intra-op thread: the engine thread's own work is what is measured (on a GPU the
    # host does no tensor math), and a second OpenMP thread spinning beside it adds ms of noise.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as model_dir:
        llm = host_only_llm(model_dir)
        engine = llm.llm_engine
        # As bench/gpu_breakdown.py: one short warm-up request first.
        llm.generate([{"prompt_token_ids": list(range(1, 9))}], SamplingParams(max_tokens=16, temperature=0.0),
                     use_tqdm=False)
        clock = PhaseClock(time.thread_time)
        instrument(llm, clock)
        scheduler = engine.engine_core.scheduler
        counts = count_scheduled_tokens(scheduler, clock)
        steps: list[dict] = []
        finished: dict = {}            # kept to the end, as LLM.generate's _run_engine keeps its outputs
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if not gc_enabled:
            gc.disable()          # (--no-gc: what the run's host time would be without the collector)
        with GCLog() as gc_log:
            # NOTE: FINAL_ONLY, as LLM.generate asks; every request added before the first step.
            for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
                engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(
                    temperature=0.6, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))
            t_run = time.perf_counter()
            while engine.has_unfinished_requests():
                index = len(steps)
                gc_log.step = index
                clock.current = {}
                num_gc = len(gc_log.events)
                t0, w0 = time.thread_time(), time.perf_counter()
                outputs = engine.step()
                t1, w1 = time.thread_time(), time.perf_counter()
                gc_log.step = -1
                for out in outputs:
                    if out.finished:
                        finished[out.request_id] = out
                scheduled = counts[-1] if counts else None
                counts.clear()
                phases = dict(clock.current)
                stand_in = sum(phases.get(p, 0.0) for p in STAND_IN)
                steps.append({"step": index, "cpu_s": t1 - t0, "wall_s": w1 - w0, "host_s": t1 - t0 - stand_in,
                              "phases_s": phases, "num_finished": sum(o.finished for o in outputs),
                              "gc": [asdict(e) for e in gc_log.events[num_gc:]], "scheduled": scheduled})
            run_wall_s = time.perf_counter() - t_run
            gc_count_end = gc.get_count()
        gc.enable()
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracked_end = len(gc.get_objects())
        output_tokens = sum(len(o.outputs[0].token_ids) for o in finished.values())
        llm.shutdown()
    return {"steps": steps, "gc_events": [asdict(e) for e in gc_log.events], "gc_summary": gc_log.summary(),
            "run_wall_s": run_wall_s, "output_tokens": output_tokens, "num_finished": len(finished),
            "peak_rss_mb_before_run": rss_before / 1024, "peak_rss_mb_after_run": rss_after / 1024,
            "gc_count_at_end": list(gc_count_end), "gc_tracked_objects_at_end": tracked_end,
            "gc_enabled": gc_enabled}


def count_scheduled_tokens(scheduler, clock: PhaseClock) -> list[dict]:
    """Wrap scheduler.schedule (this script only) so each call appends its step's token
    counts, total and prompt, to the list returned; the counting's own time goes to the
    "bench" phase, which is not host work."""
    schedule = scheduler.schedule
    counts: list[dict] = []

    def schedule_and_count():
        out = schedule()
        t = clock.now()
        # (schedule() has advanced num_computed_tokens: a prompt token is one below num_prompt_tokens before it)
        prompt_tokens = sum(min(n, max(r.num_prompt_tokens - (r.num_computed_tokens - n), 0))
                            for req_id, n in out.num_scheduled_tokens.items()
                            if (r := scheduler.requests.get(req_id)) is not None)
        counts.append({"total": out.total_num_scheduled_tokens, "prompt": prompt_tokens})
        clock.current["bench"] = clock.current.get("bench", 0.0) + clock.now() - t
        return out
    scheduler.schedule = schedule_and_count
    return counts


def find_stalls(steps: list[dict], stall_s: float, window: int = NEIGHBOURS) -> list[dict]:
    """The steps whose host time exceeds the median of their neighbours (`window` steps on
    each side, the step included) by more than stall_s, each with that median, its excess
    and where in the run it falls (its index over the number of steps).

    NOTE: the neighbours' median, not the run's: a step's host work grows with its batch
    (256 requests at the start, a handful at the end), so against the run's median every
    full-batch step would count as a stall. A stall is a step slower than the steps around it.
    """
    host = [s["host_s"] for s in steps]
    n = len(steps)
    stalls = []
    for i, s in enumerate(steps):
        local = statistics.median(host[max(0, i - window):i + window + 1])
        if s["host_s"] - local > stall_s:
            stalls.append({**s, "at": round(i / max(n - 1, 1), 4), "local_median_s": local,
                           "excess_s": s["host_s"] - local})
    return stalls


def by_kind(steps: list[dict]) -> dict:
    """Suspects (2) and (3) of issue 34 apart: steps with prompt tokens (arrivals, prefill chunks),
    decode steps that finished requests, and the other decode steps; for each, how many, their
    median host ms and their median excess over the neighbours' median."""
    host = [s["host_s"] for s in steps]
    kinds: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode_finishing": [], "decode": []}
    for i, s in enumerate(steps):
        local = statistics.median(host[max(0, i - NEIGHBOURS):i + NEIGHBOURS + 1])
        kind = ("prefill" if s["scheduled"] and s["scheduled"]["prompt"] else
                "decode_finishing" if s["num_finished"] else "decode")
        kinds[kind].append((s["host_s"], s["host_s"] - local))
    return {kind: {"count": len(v), "median_host_ms": statistics.median(h for h, _ in v) * 1e3 if v else None,
                   "median_excess_ms": statistics.median(e for _, e in v) * 1e3 if v else None}
            for kind, v in kinds.items()}


def summarize(result: dict, stall_s: float) -> dict:
    """The totals the table prints: step medians, the stalls and how many of them a gen-2 collection explains."""
    steps = result["steps"]
    stalls = find_stalls(steps, stall_s)
    host = sorted(s["host_s"] for s in steps)
    median = statistics.median(host)
    gen2 = [s for s in stalls if any(e["generation"] == 2 for e in s["gc"])]
    with_gc = [s for s in stalls if s["gc"]]
    return {"num_steps": len(steps), "median_host_ms": median * 1e3,
            "p90_host_ms": host[int(0.9 * (len(host) - 1))] * 1e3,
            "p99_host_ms": host[int(0.99 * (len(host) - 1))] * 1e3, "max_host_ms": host[-1] * 1e3,
            "total_host_s": sum(host),
            "num_over_run_median": sum(h - median > stall_s for h in host),
            "num_stalls": len(stalls), "stall_excess_s": sum(s["excess_s"] for s in stalls),
            "num_stalls_with_gen2": len(gen2), "num_stalls_with_gc": len(with_gc),
            "by_kind": by_kind(steps),
            "gc_s_in_stalls": sum(e["duration_s"] for s in stalls for e in s["gc"]),
            "stalls": [{"step": s["step"], "at": s["at"], "host_ms": s["host_s"] * 1e3,
                        "excess_ms": s["excess_s"] * 1e3, "local_median_ms": s["local_median_s"] * 1e3,
                        "scheduled": s["scheduled"],
                        "num_finished": s["num_finished"],
                        "gc": [{"generation": e["generation"], "ms": e["duration_s"] * 1e3,
                                "collected": e["collected"]} for e in s["gc"]],
                        "top_phases_ms": dict(sorted(((p, v * 1e3) for p, v in s["phases_s"].items()),
                                                     key=lambda kv: -kv[1])[:3])}
                       for s in stalls]}


def print_table(summary: dict, result: dict, stall_ms: float) -> None:
    print(f"{'step':>5} {'at':>6} {'host ms':>8} {'excess':>7} {'tokens':>7} {'prompt':>7} {'fin':>4}  "
          f"{'GC (gen: ms)':24s} top phases (ms)")
    for s in summary["stalls"]:
        sched = s["scheduled"] or {"total": 0, "prompt": 0}
        gcs = " ".join(f"{g['generation']}:{g['ms']:.2f}" for g in s["gc"]) or "-"
        phases = ", ".join(f"{p} {v:.2f}" for p, v in s["top_phases_ms"].items())
        print(f"{s['step']:5d} {s['at']:6.3f} {s['host_ms']:8.2f} {s['excess_ms']:7.2f} {sched['total']:7d} "
              f"{sched['prompt']:7d} {s['num_finished']:4d}  {gcs:24s} {phases}")
    print("by kind: " + ", ".join(f"{k} {v['count']} steps, median {v['median_host_ms'] or 0:.3f} ms "
                                  f"(excess {v['median_excess_ms'] or 0:+.3f})" for k, v in summary["by_kind"].items()))
    gcs = result["gc_summary"]
    print(f"steps {summary['num_steps']}, host ms median {summary['median_host_ms']:.3f} p90 "
          f"{summary['p90_host_ms']:.3f} p99 {summary['p99_host_ms']:.3f} max {summary['max_host_ms']:.3f}; "
          f"stalls (> the neighbours' median + {stall_ms:g} ms): {summary['num_stalls']} = {summary['stall_excess_s'] * 1e3:.1f} ms excess, "
          f"{summary['num_stalls_with_gc']} with a collection, {summary['num_stalls_with_gen2']} of gen 2 ({summary['gc_s_in_stalls'] * 1e3:.1f} ms "
          "of GC inside stalls)")
    print("GC: " + ", ".join(f"{g}: {v['count']} = {v['total_s'] * 1e3:.1f} ms (max {v['max_s'] * 1e3:.2f})"
                             for g, v in gcs.items())
          + f"; peak RSS {result['peak_rss_mb_after_run']:.0f} MB; gc.get_count() at the end "
            f"{tuple(result['gc_count_at_end'])}; {result['num_finished']} requests, "
            f"{result['output_tokens']} output tokens")


def _rounded(value):
    """Floats to 7 decimals (0.1 us), through dicts and lists: the JSON's per-step records."""
    if isinstance(value, float):
        return round(value, 7)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=FULL.num_seqs)
    ap.add_argument("--max-output", type=int, default=FULL.max_output_len, help="cap on each output length")
    ap.add_argument("--no-gc", action="store_true",
                    help="the cyclic collector off for the run (gc.disable()): the counterfactual, not a fix")
    ap.add_argument("--stall-ms", type=float, default=1.0,
                    help="a stall: host time > the median of the 10 steps either side + this")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "bench/results/host_stalls_cpu.json"))
    args = ap.parse_args()
    prompts, max_tokens = nano_vllm_workload(FULL)
    prompts, max_tokens = prompts[:args.num_seqs], [min(m, args.max_output) for m in max_tokens[:args.num_seqs]]
    result = run_workload(prompts, max_tokens, gc_enabled=not args.no_gc)
    summary = summarize(result, args.stall_ms * 1e-3)
    print_table(summary, result, args.stall_ms)
    out = {"bench": "bench/host_stalls.py", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "python": platform.python_version(), "load_avg_at_end": os.getloadavg(),
           "clock": "time.thread_time (the thread's CPU time); GC durations in time.perf_counter",
           "workload": {"num_seqs": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                        "output_tokens": sum(max_tokens), "temperature": 0.6, "ignore_eos": True},
           "stall_ms": args.stall_ms, "summary": summary,
           **{k: v for k, v in result.items() if k not in ("steps",)}, "steps": _rounded(result["steps"])}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=None)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
