"""What one client's attack does to everyone else (issue 29): /health latency and a bystander's stream.

    .venv/bin/python bench/attacks_under_load.py                    # this checkout ("after")
    .venv/bin/python bench/attacks_under_load.py --before f7946ad   # and that commit first ("before")
    .venv/bin/python bench/attacks_under_load.py --only F2,F7       # some rows only
    .venv/bin/python bench/attacks_under_load.py --keep-before      # "after" only; the JSON's "before" kept

Each row of the issue (F1-F7, tests/e2e/isolation_attacks.py) runs against a live
`vllm-anatomy serve` (default model, CPU) while tests/e2e/attack_harness.py
measures: GET /health every 50 ms (worst latency, failures) and one long greedy
stream (its tokens/s in the --window seconds before the attack, and during the
attack: at least --window seconds, or as long as the attack lasts; also its
slowest 1-s window). A structured request first warms each server up (xgrammar
and the vocabulary load on the first one).
Rows F1-F6 are also measured under their control (the same requests made benign:
same prompts and max_tokens, sent at the same moments; isolation_attacks.as_control),
right after the attack: the "relative" column is the attack's ratio over the
control's, the bystander's slowdown that is harm rather than batch sharing.
The server runs with 256 file descriptors (F7: more sockets than that), and,
for "after", --header-read-timeout 2 --body-read-timeout 3 (so F7 fits in seconds).

Prints a table and writes JSON (default bench/results/attacks_under_load_cpu.json).

NOTE: "before" is another commit's tree (`git archive`), served from a temporary
directory with the same interpreter and model; its server has no timeout flags.
The machine this runs on may be shared: read the ratios (the same stream
before and during each attack), not absolute speeds.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile

import httpx


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))
from attack_harness import measure_attack, measure_with_control  # noqa: E402
from health_under_load import export_tree  # noqa: E402
from isolation_attacks import ATTACKS, CONTROLLED, as_control, prepare  # noqa: E402
from serve import start_server  # noqa: E402

MODEL = "smol"
FD_LIMIT = 256
AFTER_FLAGS = ["--header-read-timeout", "2", "--body-read-timeout", "3"]


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def statuses(outcome) -> str:
    """'400x5 200x1' from an attack's outcome (every "status" in it), or a short summary."""
    found: list[int] = []

    def walk(x) -> None:
        if isinstance(x, dict):
            if isinstance(x.get("status"), int):
                found.append(x["status"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(outcome)
    if isinstance(outcome, dict) and "sockets" in outcome:
        return f"{outcome['closed']}/{outcome['sockets']} closed, body {'closed' if outcome['slow_body_closed'] else 'open'}"
    return " ".join(f"{s}x{found.count(s)}" for s in sorted(set(found)))


def run_label(label: str, root: str, rev: str, rows: list[str], extra: list[str], log_dir: str,
              window_s: float) -> dict:
    prepare(MODEL)
    log_path = os.path.join(log_dir, f"server_{label}.log")
    with open(log_path, "wb") as log:
        proc, url = start_server(["--served-model-name", MODEL, "--max-model-len", "1024", *extra], root=root,
                                 log=log, preexec_fn=_low_fd_limit)
    results = []
    try:
        # Not an attack: the first structured request loads xgrammar and the vocabulary (in both processes).
        httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": MODEL, "prompt": "Answer:", "max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}})
        for row in rows:
            attack = ATTACKS[row]
            try:
                if row in CONTROLLED:
                    result = asyncio.run(measure_with_control(
                        url, MODEL, row, functools.partial(attack, url, MODEL),
                        functools.partial(as_control(attack), url, MODEL),
                        baseline_s=window_s, min_attack_s=window_s))
                else:
                    result = asyncio.run(measure_attack(url, MODEL, row, functools.partial(attack, url, MODEL),
                                                        baseline_s=window_s, min_attack_s=window_s))
                entry = {**result.as_dict(), "statuses": statuses(result.outcome)}
            except Exception as e:  # noqa: BLE001 - a broken server is a result too
                entry = {"name": row, "error": f"{type(e).__name__}: {e}"[:300]}
            results.append(entry)
            print(f"  {label:6} {row}: {entry.get('statuses', entry.get('error'))}", flush=True)
            if proc.poll() is not None:
                print(f"  {label:6} server exited ({proc.returncode}); remaining rows skipped", flush=True)
                break
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"label": label, "rev": rev, "server_args": extra, "log_bytes": os.path.getsize(log_path),
            "rows": results}


def print_table(runs: list[dict]) -> None:
    head = (f"{'run':6} {'row':3} {'attacker got':34} | {'/health max':>11} {'p50':>6} {'fail':>4} | "
            f"{'stream before':>13} {'during':>7} {'ratio':>6} {'worst 1s':>8} | {'attack s':>8} | "
            f"{'control':>7} {'ctl /health':>11} {'relative':>8}")
    print(head)
    print("-" * len(head))
    for run in runs:
        for r in run["rows"]:
            if "error" in r:
                print(f"{run['label']:6} {r['name']:3} ERROR {r['error'][:100]}")
                continue
            print(f"{run['label']:6} {r['name']:3} {r['statuses'][:34]:34} | {r['health_max_s']:>11.3f} "
                  f"{r['health_p50_s']:>6.3f} {r['health_failures']:>4} | {r['baseline_tok_s']:>13.2f} "
                  f"{r['attack_tok_s']:>7.2f} {r['rate_ratio']:>6.2f} {r['worst_1s_tok_s']:>8.2f} | "
                  f"{r['attack_s']:>8.1f} | {_control_cells(r)}")
        print(f"{run['label']:6} server log: {run['log_bytes']} bytes")


def _control_cells(r: dict) -> str:
    control = r.get("control")
    if not control:
        return f"{'-':>7} {'-':>11} {'-':>8}"
    return f"{control['rate_ratio']:>7.2f} {control['health_max_s']:>11.3f} {r['relative_ratio']:>8.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="a git revision to measure first, as 'before'")
    ap.add_argument("--only", default="", help="comma-separated rows (default: F1-F7)")
    ap.add_argument("--window", type=float, default=6.0,
                    help="seconds of the bystander's baseline window, and the least of its attack window")
    ap.add_argument("--keep-before", action="store_true",
                    help="without --before: keep the 'before' run of the existing --out JSON")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "attacks_under_load_cpu.json"))
    args = ap.parse_args()
    rows = [r for r in (args.only.split(",") if args.only else ATTACKS) if r]
    log_dir = tempfile.mkdtemp(prefix="attacks_under_load_logs_")     # the servers' logs (sizes go in the JSON)
    runs = []
    if args.keep_before and not args.before and os.path.exists(args.out):
        with open(args.out) as f:
            runs += [r for r in json.load(f)["runs"] if r["label"] == "before"]
    if args.before:
        tree = export_tree(args.before)
        try:
            runs.append(run_label("before", tree, args.before, rows, [], log_dir, args.window))
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    runs.append(run_label("after", REPO, f"{head} + working tree", rows, AFTER_FLAGS, log_dir, args.window))
    print_table(runs)
    result = {"bench": "attacks_under_load", "fd_limit": FD_LIMIT,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "loadavg_at_end": os.getloadavg()},
              "runs": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"wrote {args.out} (server logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
