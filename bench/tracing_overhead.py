"""Tracing overhead: output tok/s at trace levels off / spans / full, same prompts, same run.

    .venv/bin/python bench/tracing_overhead.py [--requests 16] [--max-tokens 32] [--rounds 3]
    python bench/tracing_overhead.py --gpu       # the 256-sequence workload on a GPU

CPU: the default model, three engines side by side, rounds interleaved so that
a noisy neighbour hurts every level alike. GPU: bench/throughput.py's workload
(256 sequences, lengths uniform in [100, 1024], Qwen3-0.6B shape, random bf16
weights, CUDA graphs on); one engine at a time (each sizes its KV cache to the
whole device), levels in the order given (repeat them for interleaved rounds;
the best round of each level counts).

Prints a table and writes bench/results/tracing_overhead_{cpu,h200}.json.
Targets: spans >= 0.95x and full >= 0.75x of off. "spans" and "full" write a
run store (SQLite) in a temporary trace_dir, as a traced run would.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any

TARGETS = {"spans": 0.95, "full": 0.75}
LEVELS = ("off", "spans", "full")


def make_prompts(tokenizer, n):
    base = ["What is the capital of France?", "Name three colors of the rainbow.", "What is 12 plus 30?",
            "Write one sentence about the sea.", "Who wrote Romeo and Juliet?", "What do bees make?",
            "Explain gravity to a child.", "Why is the sky blue?"]
    return [{"prompt_token_ids": tokenizer.encode(f"{base[i % len(base)]} ({i})")} for i in range(n)]


def measure(llm, prompts, sp) -> tuple[int, float]:
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs), dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--levels", default=",".join(LEVELS),
                    help="GPU: levels in the order to run them; repeat them (off,spans,off,spans) for rounds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results_dir = os.path.join(os.path.dirname(__file__), "results")
    if args.gpu:
        args.out = args.out or os.path.join(results_dir, "tracing_overhead_h200.json")
        return main_gpu(args)
    args.out = args.out or os.path.join(results_dir, "tracing_overhead_cpu.json")
    from vllm_anatomy import LLM, SamplingParams
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    model = str(ensure_default_model())
    trace_dir = tempfile.mkdtemp(prefix="tracing_overhead_")
    llms = {lvl: LLM(model, trace_level=lvl, trace_dir=None if lvl == "off" else trace_dir) for lvl in LEVELS}
    prompts = make_prompts(llms["off"].get_tokenizer(), args.requests)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in llms.values():                                   # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    rates: dict[str, list[float]] = {lvl: [] for lvl in LEVELS}
    for r in range(args.rounds):
        # NOTE: the order rotates each round: no level always runs first (or last).
        for lvl in LEVELS[r % 3:] + LEVELS[:r % 3]:
            n, dt = measure(llms[lvl], prompts, sp)
            rates[lvl].append(n / dt)
    for llm in llms.values():
        llm.llm_engine.shutdown()
    report(args, rates, trace_dir)


def main_gpu(args) -> None:
    import gc
    import sys

    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from throughput import qwen3_06b_config, workload, write_random_model

    from vllm_anatomy import LLM, SamplingParams
    trace_dir = tempfile.mkdtemp(prefix="tracing_overhead_")
    prompts, outs = workload(256, 100, 1024, qwen3_06b_config().vocab_size)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]
    levels = args.levels.split(",")
    args.requests, args.max_tokens = len(prompts), "U[100, 1024]"
    args.rounds = max(levels.count(lvl) for lvl in set(levels))
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as path:
        write_random_model(path)
        for lvl in levels:
            llm = LLM(path, max_model_len=4096, trace_level=lvl, trace_dir=None if lvl == "off" else trace_dir)
            llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
            n, dt = measure(llm, [{"prompt_token_ids": p} for p in prompts], params)
            rates.setdefault(lvl, []).append(n / dt)
            print(f"{lvl}: {n / dt:.0f} tok/s ({dt:.1f} s)", flush=True)
            llm.llm_engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    report(args, rates, trace_dir)


def report(args, rates, trace_dir) -> None:
    best = {lvl: max(r) for lvl, r in rates.items()}    # NOTE: best of rounds: least disturbed
    results: dict[str, Any]                         # (the JSON this bench writes)
    results = {"workload": {"requests": args.requests, "max_tokens": args.max_tokens, "ignore_eos": True,
                            "rounds": args.rounds},
               "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                           "loadavg_1m": os.getloadavg()[0]},
               "levels": {}}
    print(f"{'level':<6} {'tok/s (best)':>12} {'tok/s (median)':>15} {'x off':>7} {'target':>7}")
    for lvl in [lv for lv in LEVELS if lv in rates]:
        ratio = best[lvl] / best["off"]
        target = TARGETS.get(lvl)
        results["levels"][lvl] = {"tok_per_s_rounds": rates[lvl], "tok_per_s_best": best[lvl],
                                  "tok_per_s_median": statistics.median(rates[lvl]), "ratio_vs_off": ratio,
                                  "target": target, "meets_target": None if target is None else ratio >= target}
        print(f"{lvl:<6} {best[lvl]:>12.1f} {statistics.median(rates[lvl]):>15.1f} {ratio:>7.3f} "
              f"{'' if target is None else f'>={target}':>7}")
    size = sum(os.path.getsize(os.path.join(trace_dir, f)) for f in os.listdir(trace_dir))
    results["run_store_bytes"] = size
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"run stores: {size / 1e6:.1f} MB in {trace_dir}; wrote {args.out}")


if __name__ == "__main__":
    main()
