"""Where a long prompt's TTFT goes on the host: bench/gpu_breakdown.py --workload ttft:N --host-profile.

On an H200 (2026-12-07, bench/results/gpu_breakdown_ttft4096_h200.json) a fresh 4k prompt keeps the
GPU busy 10.7 ms, yet its TTFT unprofiled is 18-21 ms (bench/scaling.py's ttft series), and at 8k the
first prompt of that length took 33 ms where the next five took 41-43 ms. The CUDA profiler cannot
say why: it slows every launch by tens of microseconds, so under it the host is always the
bottleneck. This module times the same requests without it, three ways, each on fresh prompts
(no prefix-cache hit), each request alone, greedy, max_tokens 1:

  walls    the plain wall of each call (time.perf_counter around LLM.generate), in order: does
           the first call differ from the rest?
  phases   each engine step of each call, its host phases (bench/step_overhead.py's clock:
           schedule, prepare_inputs, forward_launch, compute_logits, ...), and every CUDA
           synchronisation the call made (torch.cuda.set_sync_debug_mode("warn"): an .item(), a
           pageable copy, a nonzero...), with the innermost vllm_anatomy frame that asked for it,
           and the CUDA caching allocator's events (mallocs, frees, retries behind a sync).
           A phase that takes the GPU's time is waiting for the device somewhere inside.
  cprofile the host's functions over the calls (cProfile), top by own time, per call: what
           ~350 eager launches of a prefill step cost in Python.

Each pass changes what it measures a little (the phase clock wraps ~12 methods; cProfile slows
Python several-fold), so only `walls` is a TTFT; the other two say where it goes. cprofile runs
before phases, whose clock stays wrapped around the engine once installed.
"""
from __future__ import annotations

import cProfile
import pstats
import statistics
import time
import traceback
import warnings
from typing import Any

SYNC_WARNING = "called a synchronizing CUDA operation"
TOP_FUNCTIONS = 25


def sync_site(stack: traceback.StackSummary) -> str:
    """'path:line function' of the innermost vllm_anatomy frame of a stack (else the innermost frame)."""
    frames = [f for f in stack if "vllm_anatomy" in f.filename] or list(stack)
    if not frames:
        return "?"
    f = frames[-1]
    path = f.filename[f.filename.rfind("vllm_anatomy"):] if "vllm_anatomy" in f.filename else f.filename
    return f"{path}:{f.lineno} {f.name}"


class SyncLog:
    """While entered: CUDA's sync debug mode at "warn" (a no-op off CUDA) and every warning it
    raises recorded as {"op": message, "site": sync_site(stack)}; other warnings pass through."""

    def __init__(self) -> None:
        self.syncs: list[dict[str, str]] = []
        self._mode: Any = None

    def __enter__(self) -> "SyncLog":
        import torch
        self._catch = warnings.catch_warnings()           # restores the filters and showwarning on exit
        self._catch.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            if SYNC_WARNING in text:
                self.syncs.append({"op": text.split("\n", 1)[0][:200],
                                   "site": sync_site(traceback.extract_stack()[:-1])})
            else:
                shown(message, category, filename, lineno, file, line)
        warnings.showwarning = show
        if torch.cuda.is_available():
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc_info) -> None:
        import torch
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc_info)


def allocator_events() -> dict[str, int]:
    """The CUDA caching allocator's event counters (gpu_breakdown.allocator_counts: device mallocs
    and frees, and alloc retries, each of which frees cached blocks behind a device-wide sync);
    {} off CUDA. Their change over a call says whether it paid for memory: a long prompt's first
    call gets fresh segments, and a later one that finds the pool fragmented may sync to retry."""
    import torch
    if not torch.cuda.is_available():
        return {}
    from gpu_breakdown import allocator_counts
    return allocator_counts()


def top_functions(stats: pstats.Stats, calls: int, n: int = TOP_FUNCTIONS) -> list[dict]:
    """The n functions with the most own time: per call of the profiled workload (ms, calls)."""
    rows = []
    entries: dict = getattr(stats, "stats")          # {(path, line, name): (cc, ncalls, tottime, cumtime, callers)}
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in entries.items():
        where = path[path.rfind("vllm_anatomy"):] if "vllm_anatomy" in path else path.rsplit("/", 1)[-1]
        rows.append({"function": f"{where}:{line} {name}", "own_ms": 1e3 * tottime / calls,
                     "cum_ms": 1e3 * cumtime / calls, "calls": ncalls / calls})
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:n]


def host_profile(engine, prompt_sets: list[list[list[int]]]) -> dict:
    """The three passes (walls on prompt_sets[0], cprofile on [2], then phases on [1]: the phase clock
    stays installed), each a list of fresh prompts, one request at a time."""
    from gpu_breakdown import allocator_change
    from host_stalls import HostStepLog

    def one(prompt: list[int]) -> float:
        return 1e3 * engine.generate([prompt], [1], 0.0)[0]
    walls = [one(p) for p in prompt_sets[0]]
    # NOTE: cProfile before the phase clock: HostStepLog wraps the engine's methods for good, and
    # its wrappers would be profiled as the host's own work.
    profiler = cProfile.Profile()
    t = time.perf_counter()
    profiler.enable()
    for p in prompt_sets[2]:
        engine.generate([p], [1], 0.0)
    profiler.disable()
    profiled_ms = 1e3 * (time.perf_counter() - t) / len(prompt_sets[2])
    log = HostStepLog(engine.llm)
    phases = []
    for p in prompt_sets[1]:
        first_step = len(log.steps)
        before = allocator_events()
        with SyncLog() as syncs:
            wall = one(p)
        after = allocator_events()
        steps = [{"ms": (s["end_ns"] - s["start_ns"]) / 1e6,
                  "phases_ms": {k: 1e3 * v for k, v in sorted(s["phases_s"].items(), key=lambda kv: -kv[1])}}
                 for s in log.steps[first_step:]]
        phases.append({"wall_ms": wall, "steps": steps, "syncs": syncs.syncs,
                       "allocator": allocator_change(before, after)})
    return {"walls_ms": walls, "median_wall_ms": statistics.median(walls), "phases": phases,
            "cprofile_wall_ms_per_call": profiled_ms,
            "cprofile_top": top_functions(pstats.Stats(profiler), len(prompt_sets[2]))}


def print_host_profile(host: dict, first_call_ms: float | None = None) -> None:
    """The walls, the median call's steps and syncs, and the top functions."""
    first = f"first call of this length {first_call_ms:.2f} ms; " if first_call_ms is not None else ""
    print(f"unprofiled TTFT: {first}then " + ", ".join(f"{w:.2f}" for w in host["walls_ms"])
          + f" ms (median {host['median_wall_ms']:.2f})")
    calls = sorted(host["phases"], key=lambda c: c["wall_ms"])
    call = calls[len(calls) // 2]
    print(f"a median call under the phase clock ({call['wall_ms']:.2f} ms):")
    for i, step in enumerate(call["steps"]):
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(step["phases_ms"].items())[:5])
        print(f"  step {i}: {step['ms']:.2f} ms ({top})")
    syncs: dict[str, int] = {}
    for c in host["phases"]:
        for s in c["syncs"]:
            syncs[s["site"] + " :: " + s["op"][:80]] = syncs.get(s["site"] + " :: " + s["op"][:80], 0) + 1
    events: dict[str, int] = {}
    for c in host["phases"]:
        for k, v in c["allocator"].items():
            events[k] = events.get(k, 0) + v
    print(f"allocator events over {len(host['phases'])} calls: "
          + (", ".join(f"{k} {v:+d}" for k, v in sorted(events.items())) or "none"))
    print(f"CUDA syncs over {len(host['phases'])} calls: " + ("none" if not syncs else ""))
    for where, n in sorted(syncs.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d} x {where}")
    print(f"under cProfile ({host['cprofile_wall_ms_per_call']:.2f} ms a call), own time per call:")
    for r in host["cprofile_top"][:15]:
        print(f"  {r['own_ms']:7.3f} ms {r['calls']:7.1f} calls  {r['function']}")
