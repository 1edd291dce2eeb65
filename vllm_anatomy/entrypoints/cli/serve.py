"""`vllm-anatomy serve`: the OpenAI-compatible HTTP server (mirrors `vllm serve`).

    vllm-anatomy serve --port 8000 --api-key secret --served-model-name smol
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Authorization: Bearer secret' \\
         -H 'Content-Type: application/json' \\
         -d '{"model": "smol", "messages": [{"role": "user", "content": "Hi!"}]}'
"""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from vllm_anatomy.entrypoints.openai.cli_args import make_arg_parser
    p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    make_arg_parser(p)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from vllm_anatomy.entrypoints.openai.api_server import run_server
    from vllm_anatomy.entrypoints.openai.cli_args import validate_parsed_serve_args

    validate_parsed_serve_args(args)
    return asyncio.run(run_server(args))
