"""`vllm-anatomy generate`: a real generation with the offline LLM API.

    vllm-anatomy generate --prompt "What is a KV cache?" --max-num-batched-tokens 16
"""
from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about paged memory.",
    "Explain in one sentence what a KV cache is.",
    "List three prime numbers.",
]


def _generate(args: argparse.Namespace) -> int:
    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.entrypoints.llm import LLM
    from vllm_anatomy.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    cfg = llm.llm_engine.vllm_config
    print(f"[vllm-anatomy] model {cfg.model_config.model} on {cfg.model_config.device} "
          f"({str(cfg.model_config.dtype).removeprefix('torch.')}), "
          f"{cfg.cache_config.num_gpu_blocks} KV blocks of {cfg.cache_config.block_size} tokens, "
          f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    t1 = time.perf_counter()
    outputs = llm.chat(conversations, params) if not args.raw else llm.generate(prompts, params)
    elapsed = time.perf_counter() - t1
    n_out = 0
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        n_out += len(c.token_ids)
        print(f"\n>>> {prompt}\n{c.text}\n    [{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    m = llm.get_metrics()
    print(f"\n[vllm-anatomy] {len(prompts)} requests, {n_out} output tokens in {elapsed:.2f}s "
          f"({n_out / elapsed:.1f} tok/s); {int(m['vllm_anatomy:engine_steps'])} engine steps, "
          f"prefix-cache hits {int(m['vllm:prefix_cache_hits'])}/{int(m['vllm:prefix_cache_queries'])} tokens, "
          f"{int(m['vllm:num_preemptions'])} preemptions", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    from vllm_anatomy.engine.arg_utils import EngineArgs
    g = sub.add_parser("generate", help="generate with the offline LLM API")
    EngineArgs.add_cli_args(g)
    g.add_argument("--prompt", action="append", help="a user message (repeatable)")
    g.add_argument("--raw", action="store_true", help="send prompts as raw text (no chat template)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    return _generate(args)
