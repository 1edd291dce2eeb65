"""Speculative decoding's effect on output tok/s and TPOT: batch 1 and 64, with and without drafts.

    python bench/spec_decode.py                         # on a GPU: the full table (~5-8 min on an H100)
    python bench/spec_decode.py --tiny --model DIR      # a CPU smoke run (tests/bench/test_spec_decode_bench.py)

For each model -- the default SmolLM2-135M-Instruct and a Qwen3-0.6B-shaped model with
random bf16 weights (bench/throughput.py's) -- and each method -- off (synchronous
scheduling, as speculative decoding runs), off with async scheduling (the engine's
default on a GPU), ngram (K = 3, prompt lookup 2..4) and, for the default model,
draft_model (the model itself: every greedy draft accepted, the upper bound; and its
first 8 layers: a realistic, often-wrong draft) -- it runs two workloads:

    repetitive  the output repeats the prompt: copy and edit tasks (chat prompts) for a
                model with a chat template, greedy; for the random model a block of
                random tokens repeated 4 times (whatever it outputs, prompt lookup can
                only match what repeats)
    random      nano-vllm's: random token ids, input and output lengths uniform in
                [min_len, max_len], temperature 0.6, ignore_eos (the rejection sampler's
                random path; prompt lookup rarely finds a match)

at batch 1 (requests one after the other) and batch 64 (64 at once), one engine per
(model, method). Reported per run: output tok/s (output tokens / wall time), TPOT
(each request's (last token - first token) / (tokens - 1), mean), engine steps, and the
spec-decode counters: acceptance rate, mean acceptance length (1 + accepted / drafts)
and the acceptance rate per draft position. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

K = 3
COPY_TASKS = [
    "Repeat this paragraph exactly, word for word: The lighthouse keeper climbed the spiral stairs every "
    "evening at dusk, lit the great lamp, wound the clockwork that turned the lens, and wrote the weather "
    "in a leather logbook before the long night watch began.",
    "Rewrite this Python function with the variable `total` renamed to `acc`, changing nothing else:\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "Copy this list, adding the word 'fresh' before each item: apples, pears, plums, cherries, grapes, figs, "
    "lemons, limes, oranges, peaches.",
    "Extract every sentence containing the word 'river' from this text and print them unchanged: The river "
    "ran high in spring. Birds nested in the reeds. By summer the river was low and clear. Children swam "
    "near the old mill. In autumn the river carried leaves to the sea.",
]


def methods(model_dir: str, draft_dir: str | None, on_gpu: bool) -> dict[str, dict]:
    """name -> engine arguments."""
    ngram = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    out: dict[str, dict] = {"off": {"async_scheduling": False}}
    if on_gpu:
        out["off_async"] = {"async_scheduling": True}
    out["ngram"] = {"speculative_config": ngram}
    if draft_dir is not None:
        out["draft_self"] = {"speculative_config": {"method": "draft_model", "model": model_dir,
                                                    "num_speculative_tokens": K}}
        out["draft_cut"] = {"speculative_config": {"method": "draft_model", "model": draft_dir,
                                                   "num_speculative_tokens": K}}
    return out


def has_chat_template(model_dir: str) -> bool:
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            return "chat_template" in json.load(f)
    except OSError:
        return False


def repetitive_workload(llm, model_dir: str, n: int, max_tokens: int, vocab: int):
    """(prompts, SamplingParams list): copy/edit chat tasks, greedy; or repeated random blocks."""
    from vllm_anatomy import SamplingParams
    if has_chat_template(model_dir):
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": COPY_TASKS[i % len(COPY_TASKS)]}],
                                           tokenize=True, add_generation_prompt=True, return_dict=False)
                   for i in range(n)]
    else:
        rng = random.Random(1)
        prompts = []
        for _ in range(n):
            block = [rng.randint(3, vocab - 1) for _ in range(48)]
            prompts.append(block * 4)
    return prompts, [SamplingParams(temperature=0, max_tokens=max_tokens) for _ in prompts]


def random_workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0):
    """nano-vllm's workload: random ids, lengths uniform in [lo, hi], temperature 0.6, ignore_eos."""
    from vllm_anatomy import SamplingParams
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [SamplingParams(temperature=0.6, max_tokens=rng.randint(lo, hi), ignore_eos=True)
                     for _ in range(n)]


def spec_counters(llm) -> dict[str, float]:
    return {k: v for k, v in llm.get_metrics().items() if k.startswith("vllm:spec_decode") or k.endswith("steps")}


def measure(llm, prompts, params, batch: int) -> dict:
    """Generate; batch 1 = one request at a time. Output tok/s, TPOT, steps and spec counters (deltas)."""
    before = spec_counters(llm)
    outs = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    for start in range(0, len(prompts), batch):
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[start:start + batch]],
                             params[start:start + batch], use_tqdm=False)
    sync()
    seconds = time.perf_counter() - t
    after = spec_counters(llm)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
             for o in outs if o.metrics and o.metrics.first_token_time and len(o.outputs[0].token_ids) > 1]
    row = {"batch": batch, "num_requests": len(prompts), "output_tokens": n_out, "seconds": seconds,
           "output_tok_per_s": n_out / seconds, "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else None,
           "engine_steps": int(delta.get("vllm_anatomy:engine_steps", 0))}
    drafts = delta.get("vllm:spec_decode_num_drafts", 0)
    if drafts:
        draft_tokens = delta["vllm:spec_decode_num_draft_tokens"]
        accepted = delta["vllm:spec_decode_num_accepted_tokens"]
        row |= {"num_drafts": int(drafts), "num_draft_tokens": int(draft_tokens), "num_accepted_tokens": int(accepted),
                "acceptance_rate": accepted / draft_tokens, "mean_acceptance_length": 1 + accepted / drafts,
                "acceptance_per_position": [delta[f"vllm:spec_decode_num_accepted_tokens_per_pos:{p}"] / drafts
                                            for p in range(K)]}
    return row


def run_model(name: str, model_dir: str, draft_dir: str | None, args, on_gpu: bool) -> list[dict]:
    from vllm_anatomy import LLM, SamplingParams
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rows = []
    for method, engine_args in methods(model_dir, draft_dir, on_gpu).items():
        if args.methods and method not in args.methods:
            continue
        llm = LLM(model_dir, max_model_len=args.max_model_len, max_num_seqs=max(args.batches), **engine_args)
        llm.generate([{"prompt_token_ids": [5] * 16}], SamplingParams(max_tokens=8), use_tqdm=False)   # warm-up
        for workload in args.workloads:
            for batch in args.batches:
                n = batch if batch > 1 else args.num_seqs_batch1
                if workload == "repetitive":
                    prompts, params = repetitive_workload(llm, model_dir, n, args.max_tokens, vocab)
                else:
                    prompts, params = random_workload(n, args.min_len, args.max_len, vocab)
                row = {"model": name, "method": method, "workload": workload} | measure(llm, prompts, params, batch)
                rows.append(row)
                print_row(row)
        llm.llm_engine.shutdown()
        del llm
        if on_gpu:
            torch.cuda.empty_cache()
    return rows


HEADER = (f"{'model':<12}{'method':<12}{'workload':<12}{'batch':>6}{'tok/s':>10}{'TPOT ms':>9}{'steps':>7}"
          f"{'accept':>8}{'mean len':>9}  per position")


def print_row(r: dict) -> None:
    acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
    mean = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
    pos = " ".join(f"{p:.2f}" for p in r.get("acceptance_per_position", []))
    tpot = f"{r['tpot_ms']:.2f}" if r["tpot_ms"] is not None else "-"
    print(f"{r['model']:<12}{r['method']:<12}{r['workload']:<12}{r['batch']:>6}{r['output_tok_per_s']:>10.0f}"
          f"{tpot:>9}{r['engine_steps']:>7}{acc:>8}{mean:>9}  {pos}", flush=True)


def speedups(rows: list[dict]) -> list[dict]:
    """Each speculative run against the synchronous baseline of the same model, workload and batch."""
    base = {(r["model"], r["workload"], r["batch"]): r for r in rows if r["method"] == "off"}
    out = []
    for r in rows:
        b = base.get((r["model"], r["workload"], r["batch"]))
        if b is None or r["method"] == "off":
            continue
        out.append({"model": r["model"], "method": r["method"], "workload": r["workload"], "batch": r["batch"],
                    "tok_per_s_ratio": r["output_tok_per_s"] / b["output_tok_per_s"],
                    "tpot_ratio": r["tpot_ms"] / b["tpot_ms"] if r["tpot_ms"] and b["tpot_ms"] else None,
                    "steps_ratio": r["engine_steps"] / b["engine_steps"] if b["engine_steps"] else None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["default", "qwen3-0.6b"],
                    help="default | qwen3-0.6b (random weights, GPU) | a model directory")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="off off_async ngram draft_self draft_cut (default: all that apply)")
    ap.add_argument("--workloads", nargs="+", default=["repetitive", "random"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--num-seqs-batch1", type=int, default=4, help="requests run one after the other at batch 1")
    ap.add_argument("--max-tokens", type=int, default=256, help="repetitive workload: output tokens per request")
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--draft-layers", type=int, default=8, help="layers of the default model's cut draft")
    ap.add_argument("--tiny", action="store_true", help="a CPU smoke run: batches 1 and 2, 8 tokens, short prompts")
    ap.add_argument("--out", default=None, help="JSON path (default: bench/results/spec_decode_<device>.json, "
                                                "or $OUT/spec_decode.json when OUT is set)")
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available()
    if args.tiny:
        args.batches, args.max_tokens, args.min_len, args.max_len = [1, 2], 8, 8, 24
        args.num_seqs_batch1, args.max_model_len = 2, min(args.max_model_len, 512)
    device = torch.cuda.get_device_name().replace(" ", "_").lower() if on_gpu else "cpu"
    out_path = args.out or (os.path.join(os.environ["OUT"], "spec_decode.json") if os.environ.get("OUT")
                            else f"bench/results/spec_decode_{device}.json")
    print(HEADER)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            if name == "default":
                from vllm_anatomy.transformers_utils.default_model import ensure_default_model
                from vllm_anatomy.transformers_utils.draft_model_utils import write_truncated_draft
                model_dir = str(ensure_default_model())
                draft_dir = write_truncated_draft(model_dir, args.draft_layers, os.path.join(tmp, "draft"))
            elif name == "qwen3-0.6b":
                if not on_gpu:
                    print("qwen3-0.6b: skipped (its random weights are written on a GPU)")
                    continue
                from throughput import write_random_model   # bench/throughput.py
                model_dir, draft_dir = os.path.join(tmp, "qwen3"), None
                os.makedirs(model_dir)
                write_random_model(model_dir)
            else:
                model_dir, draft_dir = name, None
            rows += run_model(os.path.basename(name.rstrip("/")) if os.path.isdir(name) else name,
                              model_dir, draft_dir, args, on_gpu)
    ratios = speedups(rows)
    print("\nagainst 'off' (synchronous scheduling) of the same model, workload and batch:")
    print(f"{'model':<12}{'method':<12}{'workload':<12}{'batch':>6}{'tok/s x':>9}{'TPOT x':>8}{'steps x':>8}")
    for r in ratios:
        tpot = f"{r['tpot_ratio']:.2f}" if r["tpot_ratio"] else "-"
        steps = f"{r['steps_ratio']:.2f}" if r["steps_ratio"] else "-"
        print(f"{r['model']:<12}{r['method']:<12}{r['workload']:<12}{r['batch']:>6}{r['tok_per_s_ratio']:>9.2f}"
              f"{tpot:>8}{steps:>8}")
    result = {"bench": "spec_decode", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
              "torch": torch.__version__, "num_speculative_tokens": K, "args": vars(args), "runs": rows,
              "vs_off": ratios}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
