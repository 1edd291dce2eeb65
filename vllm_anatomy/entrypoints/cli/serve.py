"""`vllm-anatomy serve`: the OpenAI-compatible HTTP server (mirrors `vllm serve`).

    vllm-anatomy serve --port 8000 --api-key secret --served-model-name smol
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Authorization: Bearer secret' \\
         -H 'Content-Type: application/json' \\
         -d '{"model": "smol", "messages": [{"role": "user", "content": "Hi!"}]}'

Tensor parallelism over two hosts (vLLM's flags; each host runs tp / nnodes ranks):

    host A:  vllm-anatomy serve -tp 4 --nnodes 2 --node-rank 0 --master-addr A --master-port 29501
    host B:  vllm-anatomy serve -tp 4 --nnodes 2 --node-rank 1 --master-addr A --master-port 29501 --headless

The headless node runs its ranks only (no engine, no API server) and exits
when the engine on node 0 shuts down, or when one of its ranks dies.
"""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from vllm_anatomy.entrypoints.openai.cli_args import make_arg_parser
    p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    make_arg_parser(p)
    p.add_argument("--headless", action="store_true",
                   help="run only this node's ranks (--node-rank >= 1 of --nnodes): no engine, no API server")


def run(args: argparse.Namespace) -> int:
    if args.headless:
        return run_headless(args)
    import asyncio

    from vllm_anatomy.entrypoints.openai.api_server import run_server
    from vllm_anatomy.entrypoints.openai.cli_args import validate_parsed_serve_args

    validate_parsed_serve_args(args)
    return asyncio.run(run_server(args))


def run_headless(args: argparse.Namespace) -> int:
    """A node other than 0: start its ranks and wait for them (vLLM: serve.py run_headless).

    Returns 0 when every rank ended cleanly (the engine shut down), 1 otherwise."""
    import signal

    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.executor.multiproc_executor import MultiprocExecutor

    vllm_config = EngineArgs.from_cli_args(args).create_engine_config()
    pc = vllm_config.parallel_config
    if pc.nnodes < 2 or pc.node_rank < 1:
        raise ValueError("--headless runs the ranks of a node other than 0: give --nnodes >= 2 and --node-rank >= 1")

    def signal_handler(signum, frame) -> None:
        raise SystemExit(128 + signum)      # leave through `finally`: the ranks are stopped

    signal.signal(signal.SIGTERM, signal_handler)
    signal.signal(signal.SIGINT, signal_handler)
    print(f"[vllm-anatomy] headless node {pc.node_rank} of {pc.nnodes}: ranks "
          f"{pc.node_rank * pc.local_world_size}..{(pc.node_rank + 1) * pc.local_world_size - 1} of "
          f"{pc.world_size}, meeting at {pc.master_addr}:{pc.master_port}", flush=True)
    executor = MultiprocExecutor(vllm_config)
    try:
        executor.start_worker_monitor(inline=True)
    finally:
        executor.shutdown()
    return 0 if all(w.proc.exitcode == 0 for w in executor.workers) else 1
