"""Offline generation speed on the CPU: vllm_anatomy's LLM.generate next to
Hugging Face transformers' generate, same prompts, same greedy settings, same run.

    .venv/bin/python bench/offline_cpu.py [--max-tokens 64] [--out bench/results/offline_cpu.json]

Prints a table and writes JSON. Two workloads: a single stream (1 request) and
16 concurrent requests (HF batched with left padding, its usual way to batch).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
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


def bench_engine(model_dir, prompts, max_tokens):
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model_dir)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n, dt


def bench_hf(model_dir, prompts, max_tokens):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = 2
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad)
        dt = time.perf_counter() - t
    return (out.shape[1] - width) * len(prompts), dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/offline_cpu.json")
    args = ap.parse_args()
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
    model_dir = str(ensure_default_model())
    tok = get_tokenizer(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False) for q in QUESTIONS]
    rows = []
    for name, batch in (("single stream", prompts[:1]), ("16 requests", prompts)):
        n_e, t_e = bench_engine(model_dir, batch, args.max_tokens)
        n_h, t_h = bench_hf(model_dir, batch, args.max_tokens)
        rows.append({"workload": name, "requests": len(batch), "max_tokens": args.max_tokens,
                     "engine_tok_s": n_e / t_e, "hf_tok_s": n_h / t_h, "ratio": (n_e / t_e) / (n_h / t_h),
                     "engine_s": t_e, "hf_s": t_h, "engine_tokens": n_e, "hf_tokens": n_h})
    print(f"{'workload':<15}{'engine tok/s':>14}{'HF tok/s':>12}{'ratio':>8}")
    for r in rows:
        print(f"{r['workload']:<15}{r['engine_tok_s']:>14.1f}{r['hf_tok_s']:>12.1f}{r['ratio']:>7.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "offline_cpu", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                   "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                   "torch": torch.__version__, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
