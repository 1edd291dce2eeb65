"""`vllm-anatomy download [--force]`: fetch and convert the default model."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("download", help="fetch and convert the default model")
    p.add_argument("--force", action="store_true", help="download and convert again")


def run(args: argparse.Namespace) -> int:
    from vllm_anatomy.transformers_utils.default_model import download_main
    return download_main(["--force"] if args.force else [])
