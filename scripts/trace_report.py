"""The trace shape of every shipped sample and of fresh live runs, by Jaeger's and Perfetto's rules.

    python scripts/trace_report.py                      # samples/*.sqlite
    python scripts/trace_report.py --live 3proc,tp      # and a fresh 3-process run and a TP=3 run (CPU: minutes)
    python scripts/trace_report.py RUN.sqlite ... --json out.json

One row per run (vllm_anatomy/tracing/trace_check.py says what each rule is):
    spans, traces, 1-span (single-span traces), warned (spans with a Jaeger clock-skew or
    missing-parent warning, Jaeger v1.75.0's rules with the run's host tags), strict (spans
    not within their parent, whatever the hosts), no-parent, other (traces that are neither a
    request's, a step's nor the start-up trace), split-req (requests whose own spans lie in
    more than one trace), requests, services, pf-overlap (partial overlaps on a Perfetto
    track), pf-flow (flow ends bound to no slice).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="run stores (default: samples/*.sqlite)")
    ap.add_argument("--live", default="", help="comma-separated: 3proc, tp (record fresh runs first)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    from vllm_anatomy.tracing.reader import open_run
    from vllm_anatomy.tracing.trace_check import check_run, format_table
    runs = [(os.path.basename(p), p) for p in (args.runs or sorted(glob.glob(os.path.join(ROOT, "samples", "*.sqlite"))))]
    live = [x for x in args.live.split(",") if x]
    if live:
        from tests.tracing.live_runs import tensor_parallel_run, three_process_run
        tmp = tempfile.mkdtemp(prefix="trace_report_")
        for kind in live:
            path = {"3proc": three_process_run, "tp": tensor_parallel_run}[kind](os.path.join(tmp, kind))
            runs.append((f"live {kind}", path))
    reports = []
    for _, path in runs:
        with open_run(path) as run:
            reports.append(check_run(run))
    print(format_table(reports, [n for n, _ in runs]))
    for (name, _), r in zip(runs, reports):
        for e in r.examples[:3]:
            print(f"  {name}: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"run": n, **r.row()} for (n, _), r in zip(runs, reports)], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
