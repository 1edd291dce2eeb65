"""Host cost of the engine-side phases of one decode step, on the CPU (no model, no GPU).

Issue 20: at batch 256 a decode step's host time is as long as its GPU time on
the H200 (bench/results/step_overhead_h200.json). This bench times the three
per-step phases this side of the worker — Scheduler.schedule,
Scheduler.update_from_output and OutputProcessor.process_outputs — with
fabricated ModelRunnerOutputs (one sampled token per request per step, as the
scheduler tests do) and a word-level tokenizer of 10,000 words (detokenization
on, as LLM.generate has it).

Workload: `batch` requests with random token ids in [0, 10000) and prompt
lengths uniform in [100, 1024] (nano-vllm's bench.py), ignore_eos, long enough
max_tokens that none finishes while measured; the engine's defaults (prefix
caching on, chunked prefill on, log_stats on, FINAL_ONLY outputs as
LLM.generate asks; tracing off, so no step record); async scheduling on (the GPU default: update_from_output of
step N runs after schedule of step N+1) and off. After the prompts are prefilled
it times `--steps` decode steps and reports the median of each phase.

    python bench/host_cost.py                     # this tree
    python bench/host_cost.py --before 4582b2d     # and a worktree of that commit, interleaved
    python bench/host_cost.py --before 4582b2d --after HEAD   # both from worktrees: keep editing meanwhile
    python bench/host_cost.py --profile 256        # cProfile of the timed steps
    python bench/host_cost.py --tokenizer ~/.cache/vllm_anatomy/models/SmolLM2-135M-Instruct   # byte-level BPE

The clock is the thread's CPU time (time.thread_time): on a shared machine a
phase's wall time also counts the time other processes held the core, which
swamps the differences measured here (--wall: time.perf_counter instead).
With --before, each (tree, config) is measured in its own subprocess, the two
trees back to back, for --rounds rounds; the medians are over all steps of all
rounds, and the ratio is the median over rounds of each round's after/before
(paired in time, so a busy moment hits both). Writes bench/results/host_cost_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("schedule", "update_from_output", "process_outputs")


def _word_level_tokenizer(vocab_size: int = 10000):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", unk_token="t0")


def measure(batch: int, async_scheduling: bool, steps: int, seed: int = 0,
            profiler=None, clock=time.thread_time, tokenizer: str | None = None) -> dict[str, list[float]]:
    """Per-step seconds of each phase over `steps` decode steps (imports the tree on sys.path).
    profiler: a cProfile.Profile enabled around the timed steps only."""
    from collections import deque

    from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm_anatomy.core.kv_cache_utils import get_request_block_hasher, sha256
    from vllm_anatomy.core.outputs import ModelRunnerOutput
    from vllm_anatomy.core.request import Request
    from vllm_anatomy.engine.output_processor import OutputProcessor
    from vllm_anatomy.engine.protocol import EngineCoreRequest
    from vllm_anatomy.metrics.stats import IterationStats
    from vllm_anatomy.sampling_params import RequestOutputKind, SamplingParams

    max_model_len, block_size = 4096, 16
    sc = SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=max(batch, 1), max_model_len=max_model_len,
                         async_scheduling=async_scheduling)
    config = VllmConfig(ModelConfig(model="fake", max_model_len=max_model_len),
                        CacheConfig(block_size=block_size, enable_prefix_caching=True), sc)
    num_blocks = batch * (max_model_len // block_size) + 1
    import inspect
    scheduler_cls = sc.get_scheduler_cls()
    # NOTE: the signature, not an ImportError, tells the trees apart: the venv's
    # editable install can resolve a submodule an older tree lacks to /work/main's.
    if "num_gpu_blocks" in inspect.signature(scheduler_cls).parameters:      # (its __init__'s, less self)
        # an older tree: Scheduler(vllm_config, num_gpu_blocks)
        scheduler = scheduler_cls(config, num_gpu_blocks=num_blocks, log_stats=True)
    else:   # vLLM 0.27.1's constructor: Scheduler(vllm_config, kv_cache_config, structured_output_manager, ...)
        import torch

        from vllm_anatomy.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm_anatomy.structured_output import StructuredOutputManager
        config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])
        scheduler = scheduler_cls(config, kv_cache_config, StructuredOutputManager(config), block_size,
                                  log_stats=True)
    # As EngineCore has it with tracing off: no per-step SchedulerStepRecord
    # (an unused attribute on trees older than Scheduler.record_steps).
    scheduler.record_steps = False
    if tokenizer:
        from transformers import AutoTokenizer
        output_processor = OutputProcessor(AutoTokenizer.from_pretrained(tokenizer))
    else:
        output_processor = OutputProcessor(_word_level_tokenizer())
    hasher = get_request_block_hasher(block_size, sha256)
    rng = random.Random(seed)
    for i in range(batch):
        prompt = [rng.randint(0, 9999) for _ in range(rng.randint(100, 1024))]
        params = SamplingParams(max_tokens=max_model_len - 1024, ignore_eos=True, temperature=0.6,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        req_id = str(i)
        output_processor.add_request(EngineCoreRequest(req_id, prompt, params, time.time()), None)
        scheduler.add_request(Request(req_id, prompt, params, block_hasher=hasher))

    in_flight: deque = deque()
    depth = sc.max_concurrent_batches
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}

    def one_step(timed: bool) -> None:
        t0 = clock()
        so = scheduler.schedule()
        t1 = clock()
        # What the worker would return: one token per request that samples this step.
        req_ids = list(so.num_scheduled_tokens)
        sampled = [[] if scheduler.requests[r].is_prefill_chunk else [rng.randint(3, 9999)] for r in req_ids]
        in_flight.append((so, ModelRunnerOutput(req_ids, {r: k for k, r in enumerate(req_ids)}, sampled)))
        if len(in_flight) < depth:
            return  # async scheduling: step N's output is processed after step N+1 is scheduled
        t2 = clock()
        outputs = scheduler.update_from_output(*in_flight.popleft())
        t3 = clock()
        for eco in outputs.values():
            output_processor.process_outputs(eco.outputs, eco.timestamp, IterationStats())
        t4 = clock()
        if timed:
            times["schedule"].append(t1 - t0)
            times["update_from_output"].append(t3 - t2)
            times["process_outputs"].append(t4 - t3)

    # Prefill every prompt (16,384 tokens a step), then a few decode steps to settle.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
        one_step(False)
    for _ in range(5):
        one_step(False)
    import gc
    gc.collect()
    if profiler is not None:
        profiler.enable()
    for _ in range(steps):
        one_step(True)
    if profiler is not None:
        profiler.disable()
    assert len(scheduler.running) == batch, "a request finished or was preempted while measured"
    return times


def _add_sums(medians: dict[str, float]) -> None:
    """scheduler_total: the Scheduler's share (schedule + update_from_output); total: all three phases."""
    medians["scheduler_total"] = medians["schedule"] + medians["update_from_output"]
    medians["total"] = medians["scheduler_total"] + medians["process_outputs"]


def _child(args) -> None:
    sys.path.insert(0, args.src)
    import vllm_anatomy
    assert vllm_anatomy.__file__.startswith(os.path.join(args.src, "")), vllm_anatomy.__file__
    out = {}
    clock = time.perf_counter if args.wall else time.thread_time
    for batch in args.batches:
        for async_scheduling in args.modes:
            out[f"{batch}/{async_scheduling}"] = measure(batch, bool(async_scheduling), args.steps, clock=clock,
                                                         tokenizer=args.tokenizer)
    json.dump(out, sys.stdout)


def _run_child(src: str, args, batch: int, async_scheduling: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--src", src, "--steps", str(args.steps),
           "--batches", str(batch), "--modes", str(async_scheduling), *(["--wall"] if args.wall else []),
           *(["--tokenizer", args.tokenizer] if args.tokenizer else [])]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=src).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--modes", type=int, nargs="+", default=[1, 0], help="async scheduling: 1 on, 0 off")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--before", help="git rev to measure side by side (a temporary worktree), or a directory "
                    "holding a tree")
    ap.add_argument("--after", help="git rev for the 'after' side (default: this working tree, which must "
                                    "then stay untouched while the bench runs)")
    ap.add_argument("--tokenizer", help="a tokenizer directory (e.g. the default model's byte-level BPE) "
                                        "instead of the word-level one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wall", action="store_true", help="time.perf_counter instead of the thread's CPU time")
    ap.add_argument("--profile", type=int, metavar="BATCH",
                    help="cProfile the timed steps at this batch (async scheduling) and print the top functions")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/host_cost_cpu.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    if args.profile:
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        measure(args.profile, True, args.steps, profiler=profiler, tokenizer=args.tokenizer)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
        return

    worktrees = []

    def worktree(rev: str) -> str:
        if os.path.isdir(rev):
            return rev          # a tree already checked out (e.g. `git archive REV | tar -x -C DIR`)
        path = tempfile.mkdtemp(prefix=f"host_cost_{rev}_")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev], check=True, capture_output=True)
        worktrees.append(path)
        return path

    trees = {"after": worktree(args.after) if args.after else ROOT}
    if args.before:
        trees = {"before": worktree(args.before), **trees}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {name: {} for name in trees}
    # Paired per round: after / before of the round's medians, run back to back.
    round_ratios: dict[str, dict[str, list[float]]] = {}
    try:
        for round_index in range(args.rounds if args.before else 1):
            # Which tree goes first alternates, so that neither always gets the quieter slot.
            order = list(trees.items())[::-1 if round_index % 2 else 1]
            for batch in args.batches:
                for async_scheduling in args.modes:
                    medians: dict[str, dict[str, float]] = {}
                    key = f"{batch}/{async_scheduling}"     # the child's only key (_child)
                    for name, src in order:
                        times = _run_child(src, args, batch, async_scheduling)[key]
                        medians[name] = {phase: statistics.median(v) for phase, v in times.items()}
                        _add_sums(medians[name])
                        for phase, values in times.items():
                            samples[name].setdefault(key, {}).setdefault(phase, []).extend(values)
                    if args.before:
                        for phase in medians["after"]:
                            round_ratios.setdefault(key, {}).setdefault(phase, []).append(
                                medians["after"][phase] / medians["before"][phase])
    finally:
        for path in worktrees:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], check=False)

    rows: list[dict[str, Any]] = []
    for key in samples["after"]:
        batch, async_scheduling = map(int, key.split("/"))
        row: dict[str, Any] = {"batch": batch, "async_scheduling": bool(async_scheduling)}
        for name in trees:
            ms = {phase: statistics.median(v) * 1e3 for phase, v in samples[name][key].items()}
            _add_sums(ms)
            row[f"{name}_ms"] = {k: round(v, 4) for k, v in ms.items()}
        if args.before:
            # The median over rounds of each round's after/before ratio (robust to a noisy round).
            row["ratio_after_over_before"] = {k: round(statistics.median(v), 3)
                                              for k, v in round_ratios[key].items()}
            row["ratio_per_round"] = {k: [round(x, 3) for x in v] for k, v in round_ratios[key].items()}
        rows.append(row)

    cols = ("schedule", "update_from_output", "process_outputs", "scheduler_total", "total")
    print(f"{'batch':>5} {'async':>5} {'tree':>6} " + " ".join(f"{c:>18}" for c in cols) + "   (median ms/step)")
    for row in rows:
        for name in trees:
            print(f"{row['batch']:>5} {str(row['async_scheduling']):>5} {name:>6} "
                  + " ".join(f"{row[f'{name}_ms'][c]:>18.3f}" for c in cols))
        if args.before:
            print(f"{'':>5} {'':>5} {'ratio':>6} " + " ".join(f"{row['ratio_after_over_before'][c]:>18.3f}"
                                                           for c in cols))
    def short(rev: str) -> str:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], capture_output=True,
                              text=True).stdout.strip()
    result = {
        "bench": "bench/host_cost.py", "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "load_avg_at_end": os.getloadavg(),
        "clock": "time.perf_counter (wall)" if args.wall else "time.thread_time (the thread's CPU time)",
        "after": short(args.after) if args.after else f"working tree at {short('HEAD')}",
        "tokenizer": args.tokenizer or "word-level, 10,000 words",
        "before": short(args.before) if args.before else None, "rounds": args.rounds if args.before else 1, "steps_per_round": args.steps,
        "workload": "batch requests, prompts uniform in [100, 1024] random ids < 10000, one token per request "
                    "per step, prefix caching on, log_stats on, tracing off (Scheduler.record_steps False: no step record), "
                    "FINAL_ONLY outputs, word-level tokenizer",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
