"""/health latency while one huge request is processed (issue 14: "one 12 MB prompt
blocked every endpoint for 12 s").

    .venv/bin/python bench/health_under_load.py                  # this checkout ("after")
    .venv/bin/python bench/health_under_load.py --before 516165f # and that commit first ("before")

For each scenario the bench starts one long stream (so there is an open stream
to stall), sends one big request, and meanwhile asks GET /health back to back
(20 ms apart) until the big request is answered. It reports the big request's
status and time, /health latency p50 / p99 / max over that window, and the
longest gap between two chunks of the open stream in it. Idle /health latency
comes first, as the floor. Prints a table, writes JSON
(default bench/results/health_under_load_cpu.json).

Scenarios (the limit is --body-limit, passed as --max-request-body-bytes):
  text_under_limit   a text prompt just under the body limit (~10 MB)
  text_over_limit    a text prompt just over it (413 expected)
  ids_under_limit    a token-id prompt just under the limit (~1.7 M ids)
  text_max_chars     the longest text the server tokenizes (max_model_len x the
                     longest token, in characters): tokenized, then refused as
                     too many tokens

NOTE: "before" is another commit's tree, exported with `git archive` into a
temporary directory and served from there (same interpreter, same model);
it has no body limit flag, so it reads everything. Numbers on a shared 2-core
machine are noisy: compare orders of magnitude, not milliseconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
from serve import percentiles, start_server  # noqa: E402

HEALTH_GAP_S = 0.02


def export_tree(rev: str) -> str:
    """`git archive rev` into a temporary directory (no change to this checkout)."""
    out = tempfile.mkdtemp(prefix=f"health_bench_{rev}_")
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=REPO, check=True,
                             capture_output=True).stdout
    tar_path = os.path.join(out, "tree.tar")
    with open(tar_path, "wb") as f:
        f.write(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(out, filter="data")
    os.remove(tar_path)
    return out


def bodies(limit: int, max_chars: int) -> dict[str, bytes]:
    """The big request bodies, by scenario (the text is "hello hello ...")."""
    head, tail = b'{"prompt": ', b', "max_tokens": 1}'

    def text_body(num_chars: int) -> bytes:
        return head + b'"' + (b"hello " * (num_chars // 6 + 1))[:num_chars] + b'"' + tail

    def ids_body(num_bytes: int) -> bytes:
        num_ids = (num_bytes - len(head) - len(tail)) // 6           # "1234, " is 6 bytes
        return head + b"[" + b", ".join([b"1234"] * num_ids) + b"]" + tail

    overhead = len(text_body(0))
    return {"text_under_limit": text_body(limit - 1024 - overhead),
            "text_over_limit": text_body(limit + 512 * 1024),
            "ids_under_limit": ids_body(limit - 1024),
            "text_max_chars": text_body(max_chars - 1)}      # the longest text that is tokenized


async def health_probe(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await client.get("/health")
        latencies.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.status_code
        await asyncio.sleep(HEALTH_GAP_S)
    return latencies


async def open_stream(client: httpx.AsyncClient, model: str, chunk_times: list[float]) -> None:
    body = {"model": model, "prompt": "Count: 1, 2, 3,", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk_times.append(time.perf_counter())


async def scenario(url: str, model: str, name: str, body: bytes) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client, \
            httpx.AsyncClient(base_url=url, timeout=600) as big_client:
        chunk_times: list[float] = []
        stream = asyncio.create_task(open_stream(client, model, chunk_times))
        while len(chunk_times) < 3:                     # the stream is flowing
            await asyncio.sleep(0.01)
        stop = asyncio.Event()
        probe = asyncio.create_task(health_probe(client, stop))
        t0 = time.perf_counter()
        r = await big_client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        t1 = time.perf_counter()
        stop.set()
        latencies = await probe
        # NOTE: wait for the stream's next chunk, so a gap that spans the whole
        # window (the loop was blocked) is seen, then stop the stream.
        seen = len(chunk_times)
        deadline = time.perf_counter() + 10
        while len(chunk_times) == seen and time.perf_counter() < deadline and not stream.done():
            await asyncio.sleep(0.01)
        stream.cancel()
        try:
            await stream
        except asyncio.CancelledError:
            pass
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:]) if b > t0 and a < t1]
    try:
        message = r.json()["error"]["message"][:120] if r.status_code != 200 else ""
    except (ValueError, KeyError, TypeError):
        message = r.text[:120]
    return {"scenario": name, "body_bytes": len(body), "status": r.status_code, "request_s": t1 - t0,
            "message": message, "health_s": {**percentiles(latencies), "max": max(latencies), "n": len(latencies)},
            "stream_max_gap_s": max(gaps) if gaps else None}


async def idle_health(url: str, n: int = 50) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        latencies = []
        for _ in range(n):
            t0 = time.perf_counter()
            await client.get("/health")
            latencies.append(time.perf_counter() - t0)
    return {**percentiles(latencies), "max": max(latencies), "n": n}


def run_label(label: str, root: str, rev: str, args: argparse.Namespace, limit_flag: bool) -> dict:
    extra = args.server_args.split() + (["--max-request-body-bytes", str(args.body_limit)] if limit_flag else [])
    proc, url = start_server(extra, root=root, quiet=True)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        max_chars = model["max_model_len"] * args.max_chars_per_token
        result = {"label": label, "rev": rev, "server_args": extra, "idle_health_s": asyncio.run(idle_health(url)),
                  "scenarios": []}
        for name, body in bodies(args.body_limit, max_chars).items():
            if name in args.skip:
                continue
            row = asyncio.run(scenario(url, model["id"], name, body))
            print(f"  {label:6} {name:17} -> {row['status']} in {row['request_s']:.2f} s", flush=True)
            result["scenarios"].append(row)
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def print_table(runs: list[dict]) -> None:
    head = (f"{'run':6} {'scenario':17} {'MB':>6} {'status':>6} {'req s':>7} | {'/health p50':>11} {'p99':>8} "
            f"{'max':>8} {'n':>4} | {'stream gap':>10}   (seconds)")
    print(head)
    print("-" * len(head))
    for run in runs:
        idle = run["idle_health_s"]
        print(f"{run['label']:6} {'idle':17} {'':>6} {'':>6} {'':>7} | {idle['p50']:>11.4f} {idle['p99']:>8.4f} "
              f"{idle['max']:>8.4f} {idle['n']:>4} |")
        for s in run["scenarios"]:
            h = s["health_s"]
            gap = f"{s['stream_max_gap_s']:.3f}" if s["stream_max_gap_s"] is not None else "-"
            print(f"{run['label']:6} {s['scenario']:17} {s['body_bytes'] / 1e6:>6.2f} {s['status']:>6} "
                  f"{s['request_s']:>7.2f} | {h['p50']:>11.4f} {h['p99']:>8.4f} {h['max']:>8.4f} {h['n']:>4} | "
                  f"{gap:>10}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="a git revision to measure first, as 'before'")
    ap.add_argument("--body-limit", type=int, default=10_500_000,
                    help="--max-request-body-bytes of the 'after' server (bytes; default 10.5 MB)")
    ap.add_argument("--max-chars-per-token", type=int, default=81,
                    help="the tokenizer's longest token in characters (SmolLM2: 81)")
    ap.add_argument("--server-args", default="", help="extra `vllm-anatomy serve` arguments")
    ap.add_argument("--skip", default="", help="comma-separated scenarios to skip")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "health_under_load_cpu.json"))
    args = ap.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    runs = []
    if args.before:
        tree = export_tree(args.before)
        try:
            runs.append(run_label("before", tree, args.before, args, limit_flag=False))
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    runs.append(run_label("after", REPO, f"{head} + working tree", args, limit_flag=True))
    print_table(runs)
    result = {"bench": "health_under_load", "body_limit": args.body_limit,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
