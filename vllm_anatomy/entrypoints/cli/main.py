"""The `vllm-anatomy` command (mirrors vllm/entrypoints/cli/main.py).

Each subcommand lives in its own module with `add_parser(subparsers)` and
`run(args) -> int`:

    vllm-anatomy download [--force]          fetch + convert the default model
    vllm-anatomy generate [--prompt P ...]   a real generation with the offline LLM
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules under vllm_anatomy.entrypoints.cli, in help order.
SUBCOMMANDS = ["download", "generate", "serve", "export", "dashboard", "lesson"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-anatomy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name in SUBCOMMANDS:
        mod = importlib.import_module(f"vllm_anatomy.entrypoints.cli.{name}")
        mod.add_parser(sub)
        modules[name] = mod
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"vllm-anatomy: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
