"""The `vllm-anatomy` command.

    vllm-anatomy download [--force]          fetch + convert the default model
    vllm-anatomy generate [--prompt P ...]   a real generation on the default model
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
          f"({n_out / elapsed:.1f} tok/s); {int(m['vllm:engine_steps'])} engine steps, "
          f"prefix-cache hits {int(m['vllm:prefix_cache_hits'])}/{int(m['vllm:prefix_cache_queries'])} tokens, "
          f"{int(m['vllm:num_preemptions'])} preemptions", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from vllm_anatomy.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(prog="vllm-anatomy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="fetch and convert the default model")
    d.add_argument("--force", action="store_true", help="download and convert again")
    g = sub.add_parser("generate", help="generate with the offline LLM API")
    EngineArgs.add_cli_args(g)
    g.add_argument("--prompt", action="append", help="a user message (repeatable)")
    g.add_argument("--raw", action="store_true", help="send prompts as raw text (no chat template)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "download":
            from vllm_anatomy.model_executor.default_model import download_main
            return download_main(["--force"] if args.force else [])
        return _generate(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"vllm-anatomy: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
