"""Online serving latency, like `vllm bench serve`: Poisson arrivals at several request rates.

    .venv/bin/python bench/serve.py                              # starts its own server (CPU defaults)
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000 --request-rates 1,4,inf

Each request is a streaming /v1/completions call with a random token-id prompt
of --input-len tokens and exactly --output-len generated tokens (ignore_eos),
vLLM's "random" dataset. Per request rate it reports, as vllm bench serve does:
TTFT (time to first token), ITL (inter-token latency: gaps between streamed
chunks), E2E latency, each at p50/p90/p99, plus request and output-token
throughput. Prints a table and writes JSON (default bench/results/serve_cpu.json).

NOTE: arrivals are a Poisson process: inter-arrival gaps drawn from an
exponential distribution with mean 1/rate (rate "inf" sends everything at
once). Latencies are measured on this client's clock, so they include HTTP,
JSON and detokenization, not only the engine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    s = sorted(values)

    def pct(q: float) -> float:   # nearest-rank on the sorted list
        return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]
    return {"p50": pct(50), "p90": pct(90), "p99": pct(99), "mean": sum(s) / len(s)}


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunk_times, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return {"ok": False, "error": data["error"]["message"]}
            if data.get("usage"):
                usage = data["usage"]
            if data["choices"] and data["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
    end = time.perf_counter()
    if not chunk_times:
        return {"ok": False, "error": "no tokens"}
    return {"ok": True, "ttft": chunk_times[0] - start, "e2e": end - start,
            "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "output_tokens": usage["completion_tokens"] if usage else len(chunk_times)}


async def run_rate(url: str, model: str, rate: float, prompts: list[list[int]], output_len: int,
                   seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        tasks = []
        t0 = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, model, prompt, output_len)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "request_rate": rate if rate != float("inf") else "inf", "num_requests": len(prompts),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration, "total_output_tokens": out_tokens,
        "ttft_s": percentiles([r["ttft"] for r in ok]),
        "itl_s": percentiles([x for r in ok for x in r["itl"]]),
        "e2e_s": percentiles([r["e2e"] for r in ok]),
    }


def random_prompts(n: int, input_len: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    # NOTE: ids from 100 up skip the special tokens (<|endoftext|>, <|im_start|>, ...).
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(n)]


# The `vllm-anatomy` entry point, run with this interpreter (`-m ...cli.main` warns: the
# package imports main first).
_SERVE = "import sys; from vllm_anatomy.entrypoints.cli.main import main; sys.exit(main(sys.argv[1:]))"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], root: str = REPO, quiet: bool = False, log=None,
                 preexec_fn=None) -> tuple[subprocess.Popen, str]:
    """`vllm-anatomy serve` of the tree at `root` (another checkout: its own package is imported)
    on a free loopback port, once /health answers: (process, base URL). log: an open file for
    the server's stdout and stderr; preexec_fn: run in the child first (e.g. to lower a limit)."""
    port = free_port()
    cmd = [sys.executable, "-c", _SERVE, "serve", "--port", str(port), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": root} if root != REPO else {})}
    stdout = log if log is not None else (subprocess.DEVNULL if quiet else None)
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=stdout, stderr=log, preexec_fn=preexec_fn)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise TimeoutError("server did not become healthy")


def print_table(rows: list[dict]) -> None:
    head = (f"{'rate':>6} {'done':>5} {'req/s':>6} {'out tok/s':>9} | {'TTFT p50':>8} {'p90':>7} {'p99':>7} | "
            f"{'ITL p50':>8} {'p90':>7} {'p99':>7} | {'E2E p50':>8} {'p90':>7} {'p99':>7}   (seconds)")
    print(head)
    print("-" * len(head))
    for r in rows:
        t, i, e = r["ttft_s"], r["itl_s"], r["e2e_s"]
        print(f"{str(r['request_rate']):>6} {r['completed']:>5} {r['request_throughput']:>6.2f} "
              f"{r['output_throughput']:>9.1f} | {t['p50']:>8.3f} {t['p90']:>7.3f} {t['p99']:>7.3f} | "
              f"{i['p50']:>8.3f} {i['p90']:>7.3f} {i['p99']:>7.3f} | {e['p50']:>8.3f} {e['p90']:>7.3f} "
              f"{e['p99']:>7.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    ap.add_argument("--request-rates", default="0.5,2,inf", help="comma-separated requests/s; inf = burst")
    ap.add_argument("--num-prompts", type=int, default=12, help="requests per rate")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="--max-model-len 512",
                    help="extra `vllm-anatomy serve` arguments when starting a server")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "serve_cpu.json"))
    args = ap.parse_args()
    rates = [float(x) for x in args.request_rates.split(",")]
    proc = None
    if args.url is None:
        proc, url = start_server(args.server_args.split())
    else:
        url = args.url.rstrip("/")
    try:
        model = args.model or httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
        asyncio.run(one_request_warmup(url, model, prompts[0]))
        rows = [asyncio.run(run_rate(url, model, rate, prompts, args.output_len, args.seed)) for rate in rates]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print_table(rows)
    result = {"bench": "serve", "url": url if args.url else "local (started by the bench)", "model": model,
              "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "results": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


async def one_request_warmup(url: str, model: str, prompt: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_request(client, model, prompt, 2)


if __name__ == "__main__":
    sys.exit(main())
