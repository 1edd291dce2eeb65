"""`vllm-anatomy export RUN --format jaeger|otlp-json|perfetto [-o FILE]`.

Converts a run store (tracing/store.py) into a file a viewer opens: Jaeger's
UI upload, OTLP JSON, or Chrome trace-event JSON for ui.perfetto.dev. Without
-o the file goes to the current directory, named after the run
(`run-....jaeger.json`): never next to the run (the shipped samples live in
the repository's tracked samples/ folder).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a recorded run for Jaeger or Perfetto")
    p.add_argument("run", help="the run store (.sqlite) to export")
    p.add_argument("--format", required=True, choices=["jaeger", "otlp-json", "perfetto"])
    p.add_argument("-o", "--output", default=None,
                   help="output file (default: RUN's name with .<format>.json, in the current directory; "
                        "'-' for stdout)")


def run(args: argparse.Namespace) -> int:
    from vllm_anatomy.tracing.exporters import EXPORTERS
    from vllm_anatomy.tracing.reader import TraceStoreError, open_run
    try:
        with open_run(args.run) as r:
            obj = EXPORTERS[args.format](r)
    except TraceStoreError as e:
        raise ValueError(str(e)) from e
    text = json.dumps(obj)
    if args.output == "-":
        sys.stdout.write(text + "\n")
        return 0
    out = args.output or f"{os.path.splitext(os.path.basename(args.run))[0]}.{args.format}.json"
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}")
    return 0
