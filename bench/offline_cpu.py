"""Offline generation speed on the CPU: vllm_anatomy's LLM.generate next to
Hugging Face transformers' generate, same prompts, same greedy settings, same run.

    .venv/bin/python bench/offline_cpu.py [--max-tokens 64] [--rounds 3] [--attention-backend auto]
                                          [--out bench/results/offline_cpu.json]

Prints a table and writes JSON. Two workloads: a single stream (1 request) and
16 concurrent requests (HF batched with left padding, its usual way to batch).
Both sides use torch's intra-op thread count as it is (the JSON's `threads`).

NOTE: the machine this runs on is usually shared, so its speed changes from
one second to the next. Each round runs our engine and then HF on the same
workload, back to back; a row reports the median over the rounds of each
side's tokens/s and of the per-round ratio (`ratio`, ours / HF), and keeps
every round (`rounds`) and the load average around the run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

QUESTIONS = [
    "What is the capital of France?", "Name three colors of the rainbow.", "What is 12 plus 30?",
    "Write one sentence about the sea.", "Who wrote Romeo and Juliet?", "What do bees make?",
    "Explain gravity to a child.", "Give me a synonym for happy.", "What is the boiling point of water?",
    "Name a famous painter.", "Why is the sky blue?", "What is a prime number?",
    "Suggest a name for a cat.", "What language is spoken in Brazil?", "How many legs does a spider have?",
    "What is photosynthesis?",
]


def bench_engine(llm, prompts, max_tokens):
    from vllm_anatomy import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n, dt


def bench_hf(model, prompts, max_tokens):
    pad = 2
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad)
        dt = time.perf_counter() - t
    return (out.shape[1] - width) * len(prompts), dt


def warm_up(llm, hf_model, prompt):
    from vllm_anatomy import SamplingParams
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    with torch.inference_mode():
        ids = torch.tensor([prompt[-8:]])
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                          pad_token_id=2)


def run_workload(name, llm, hf_model, prompts, max_tokens, rounds):
    per_round = []
    for _ in range(rounds):
        n_e, t_e = bench_engine(llm, prompts, max_tokens)
        n_h, t_h = bench_hf(hf_model, prompts, max_tokens)
        per_round.append({"engine_tok_s": n_e / t_e, "hf_tok_s": n_h / t_h, "ratio": (n_e / t_e) / (n_h / t_h),
                          "engine_s": t_e, "hf_s": t_h, "engine_tokens": n_e, "hf_tokens": n_h})
        print(f"  {name}: ours {n_e / t_e:.1f} tok/s, HF {n_h / t_h:.1f} tok/s, "
              f"ratio {per_round[-1]['ratio']:.2f}", flush=True)
    med = {k: statistics.median(r[k] for r in per_round) for k in ("engine_tok_s", "hf_tok_s", "ratio")}
    return {"workload": name, "requests": len(prompts), "max_tokens": max_tokens, **med,
            "engine_tokens": per_round[0]["engine_tokens"], "hf_tokens": per_round[0]["hf_tokens"],
            "rounds": per_round}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attention-backend", default="auto", help="our engine's (EngineArgs.attention_backend)")
    ap.add_argument("--out", default="bench/results/offline_cpu.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from vllm_anatomy import LLM
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
    model_dir = str(ensure_default_model())
    tok = get_tokenizer(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False) for q in QUESTIONS]
    llm = LLM(model_dir, attention_backend=args.attention_backend)
    backend = llm.llm_engine.vllm_config.model_config.attention_backend
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    warm_up(llm, hf_model, prompts[0])
    load_before = os.getloadavg()
    rows = [run_workload(name, llm, hf_model, batch, args.max_tokens, args.rounds)
            for name, batch in (("single stream", prompts[:1]), ("16 requests", prompts))]
    load_after = os.getloadavg()
    print(f"{'workload':<15}{'engine tok/s':>14}{'HF tok/s':>12}{'ratio':>8}   (medians of {args.rounds} rounds, "
          f"attention backend {backend!r}, {torch.get_num_threads()} threads)")
    for r in rows:
        print(f"{r['workload']:<15}{r['engine_tok_s']:>14.1f}{r['hf_tok_s']:>12.1f}{r['ratio']:>7.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "offline_cpu", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                   "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                   "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "attention_backend": backend, "rounds": args.rounds,
                   "load_average_1m": [load_before[0], load_after[0]], "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
