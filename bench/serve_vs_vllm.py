"""`vllm-anatomy serve` vs `vllm serve`, one after the other on one GPU, under the same open-loop load.

Runbook (a GPU machine; vLLM 0.26.0's slim bundle of ../shared/peers/vllm/ unpacked at
/tmp/vllm-site, and bench/peers/device_wheels.sh's wheels installed at /tmp/site for both
servers' HTTP stacks):

    PYTHONPATH=/tmp/site python3 bench/serve_vs_vllm.py --vllm-site /tmp/vllm-site

about 6 minutes: vLLM's start-up (50-90 s), ours (~20 s), then per server one warm-up and
--rates × --seconds of load plus the drain. The JSON is written again after each server.

    python bench/serve_vs_vllm.py [--vllm-site SITE] [--rates 8,16,32,64,128] [--seconds 10]
        [--input-len 256:768] [--output-len 128] [--clients 4] [--slo-ttft-ms 500] [--slo-tpot-ms 25]
        [--servers vllm,ours] [--out bench/results/serve_vs_vllm_<card>.json] [--tiny]

The model is bench/throughput.py's Qwen3-0.6B shape with random bf16 weights (ours loads the
weights it writes; vLLM the same config with --load-format dummy) and a word-level tokenizer
over the whole vocabulary, so both servers detokenize the same way.

The load, like `vllm bench serve --dataset random`: for each offered rate r, requests arrive
as a Poisson process (exponential gaps, mean 1/r) for --seconds; each is a streamed
/v1/completions call with a random token-id prompt (length uniform in --input-len) and
exactly --output-len tokens (ignore_eos, greedy). NOTE: one Python client cannot read 20k
streamed tokens/s without becoming the bottleneck, so --clients processes each send a
Poisson stream of rate r / clients (the union of independent Poisson streams is Poisson
with the summed rate) and each times its own requests.

Per rate and server: TTFT, TPOT ((e2e - TTFT) / (tokens - 1), per request) and ITL (gaps
between streamed chunks) at p50/p99, output tok/s over the rate's window, and goodput: the
requests/s that met both SLOs (TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms). The knee is
the highest offered rate whose SLO attainment is >= 90 %. The verdict, as DESIGN.md's target
states it: ours' p99 TTFT and p99 TPOT <= vLLM's at every rate up to vLLM's knee, and our
knee at least as far right.

`--tiny` is the CPU smoke mode (tests/bench/): a tiny random Qwen3 on this machine, our own
server on both sides (no vLLM needed), two low rates, a few seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from serve import one_request, percentiles  # noqa: E402  (bench/serve.py)
from side_by_side import worker_env  # noqa: E402

MODEL_NAME = "model"
ATTAINMENT_AT_KNEE = 0.9


# -- the servers -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, model_dir: str, port: int, max_model_len: int, tiny: bool) -> list[str]:
    if kind == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--port", str(port),
                "--host", "127.0.0.1", "--served-model-name", MODEL_NAME, "--load-format", "dummy",
                "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.9",
                "--uvicorn-log-level", "warning"]
    serve = "import sys; from vllm_anatomy.entrypoints.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", serve, "serve", "--model", model_dir, "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", MODEL_NAME, "--max-model-len", str(max_model_len)]


def start_server(kind: str, label: str, model_dir: str, vllm_site: str | None, max_model_len: int,
                 tiny: bool, log_path: str) -> tuple[subprocess.Popen, str, float]:
    """Start one server in a session of its own (its engine processes die with it); (proc, url, start-up s)."""
    import httpx
    port = free_port()
    # (vLLM: the bundle first, then whatever PYTHONPATH holds: device_wheels.sh's /tmp/site)
    env = worker_env(kind, vllm_site, None)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1" if tiny else "8")
    t0 = time.perf_counter()
    log = open(log_path, "w")
    proc = subprocess.Popen(server_command(kind, model_dir, port, max_model_len, tiny), env=env, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{label} exited with code {proc.returncode}; its log: {tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"{label} did not answer /health within 600 s; its log: {tail(log_path)}")


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def tail(path: str, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


# -- the load --------------------------------------------------------------------------------------

def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    # NOTE: ids from 100 up skip a real vocabulary's special tokens (as bench/serve.py does).
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def client_main(url: str, rate: float, prompts: list[list[int]], output_len: int, seed: int,
                start_at: float) -> list[dict]:
    """One client process: its Poisson stream of `rate` req/s over `prompts`; a record per request."""
    return asyncio.run(_client(url, rate, prompts, output_len, seed, start_at))


async def _client(url: str, rate: float, prompts: list[list[int]], output_len: int, seed: int,
                  start_at: float) -> list[dict]:
    import httpx
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))

        async def timed(prompt: list[int]) -> dict:
            sent = time.time()
            rec = await one_request(client, MODEL_NAME, prompt, output_len)
            return rec | {"sent": sent}
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(timed(prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def run_rate(pool: ProcessPoolExecutor, url: str, rate: float, seconds: float, clients: int, lo: int, hi: int,
             output_len: int, vocab: int, seed: int) -> list[dict]:
    n = max(clients, round(rate * seconds))
    prompts = make_prompts(n, lo, hi, vocab, seed)
    start_at = time.time() + 1.0
    futures = [pool.submit(client_main, url, rate / clients, prompts[i::clients], output_len, seed * 100 + i, start_at)
               for i in range(clients)]
    return [rec for f in futures for rec in f.result()]


def summarize(rate: float, records: list[dict], slo_ttft_s: float, slo_tpot_s: float) -> dict:
    ok = [r for r in records if r["ok"]]
    for r in ok:
        r["tpot"] = (r["e2e"] - r["ttft"]) / max(1, r["output_tokens"] - 1)
    good = [r for r in ok if r["ttft"] <= slo_ttft_s and r["tpot"] <= slo_tpot_s]
    window = (max(r["sent"] + r["e2e"] for r in ok) - min(r["sent"] for r in records)) if ok else float("nan")
    ms = lambda values: {k: v * 1e3 for k, v in percentiles(values).items()}  # noqa: E731
    return {"offered_rate": rate, "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
            "errors": sorted({r["error"] for r in records if not r["ok"]})[:3],
            "window_s": window, "output_tok_per_s": sum(r["output_tokens"] for r in ok) / window if ok else 0.0,
            "request_throughput": len(ok) / window if ok else 0.0,
            "goodput_req_per_s": len(good) / window if ok else 0.0,
            "slo_attainment": len(good) / len(records) if records else 0.0,
            "ttft_ms": ms([r["ttft"] for r in ok]), "tpot_ms": ms([r["tpot"] for r in ok]),
            "itl_ms": ms([x for r in ok for x in r["itl"]]), "e2e_ms": ms([r["e2e"] for r in ok])}


def knee(rows: list[dict]) -> float | None:
    """The highest offered rate at which >= 90 % of requests met the SLOs (None: not even the lowest)."""
    passing = [r["offered_rate"] for r in rows if r["slo_attainment"] >= ATTAINMENT_AT_KNEE and not r["failed"]]
    return max(passing) if passing else None


def verdict(servers: dict) -> dict:
    """Ours' p99 TTFT and TPOT <= vLLM's at every rate up to vLLM's knee, and our knee >= vLLM's."""
    if not {"ours", "vllm"} <= servers.keys() or "rows" not in servers["ours"] or "rows" not in servers["vllm"]:
        return {"complete": False}
    v_knee, o_knee = servers["vllm"]["knee"], servers["ours"]["knee"]
    per_rate = []
    for o, v in zip(servers["ours"]["rows"], servers["vllm"]["rows"]):
        if v_knee is not None and o["offered_rate"] <= v_knee:
            per_rate.append({"rate": o["offered_rate"],
                             "ttft_p99_ratio": o["ttft_ms"]["p99"] / v["ttft_ms"]["p99"],
                             "tpot_p99_ratio": o["tpot_ms"]["p99"] / v["tpot_ms"]["p99"]})
    latency_ok = all(r["ttft_p99_ratio"] <= 1.0 and r["tpot_p99_ratio"] <= 1.0 for r in per_rate)
    knee_ok = v_knee is None or (o_knee is not None and o_knee >= v_knee)
    return {"complete": True, "per_rate_up_to_vllm_knee": per_rate, "ours_knee": o_knee, "vllm_knee": v_knee,
            "p99_latency_at_or_below_vllm": latency_ok, "knee_at_least_vllm": knee_ok, "met": latency_ok and knee_ok}


def print_table(name: str, rows: list[dict], knee_rate) -> None:
    print(f"\n{name}  (knee: {knee_rate} req/s)")
    head = (f"{'rate':>6} {'done':>5} {'fail':>4} {'out tok/s':>9} {'goodput':>7} {'SLO %':>6} | "
            f"{'TTFT p50':>8} {'p99':>8} | {'TPOT p50':>8} {'p99':>7} | {'ITL p50':>7} {'p99':>7}  (ms)")
    print(head)
    print("-" * len(head))
    for r in rows:
        t, p, i = r["ttft_ms"], r["tpot_ms"], r["itl_ms"]
        print(f"{r['offered_rate']:>6g} {r['completed']:>5} {r['failed']:>4} {r['output_tok_per_s']:>9.0f} "
              f"{r['goodput_req_per_s']:>7.1f} {100 * r['slo_attainment']:>6.1f} | {t['p50']:>8.1f} {t['p99']:>8.1f} | "
              f"{p['p50']:>8.2f} {p['p99']:>7.2f} | {i['p50']:>7.2f} {i['p99']:>7.2f}")


# -- one server, then the other ------------------------------------------------------------------

def bench_server(kind: str, label: str, args, model_dir: str, vocab: int, rates: list[float], tmp: str) -> dict:
    lo, hi = (int(x) for x in args.input_len.split(":"))
    log_path = os.path.join(tmp, f"{label}.log")
    proc, url, startup_s = start_server(kind, label, model_dir, args.vllm_site, args.max_model_len, args.tiny,
                                        log_path)
    try:
        with ProcessPoolExecutor(max_workers=args.clients) as pool:
            # Warm-up: a short burst (graphs, the first compile of each shape, connection set-up).
            run_rate(pool, url, max(2.0, rates[0]), 2.0 if args.tiny else 4.0, args.clients, lo, hi,
                     args.output_len, vocab, seed=999)
            rows = []
            for k, rate in enumerate(rates):
                print(f"[{time.strftime('%H:%M:%S')}] {label}: {rate:g} req/s ...", file=sys.stderr, flush=True)
                records = run_rate(pool, url, rate, args.seconds, args.clients, lo, hi, args.output_len, vocab,
                                   seed=k)
                rows.append(summarize(rate, records, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))
    finally:
        stop_server(proc)
    return {"label": label, "startup_s": startup_s, "rows": rows, "knee": knee(rows), "log_tail": tail(log_path, 1500)}


def write_models(tiny: bool, tmp: str) -> tuple[str, int]:
    """One directory both servers start from: config, ours' random weights, a word-level tokenizer."""
    model_dir = os.path.join(tmp, "model")
    os.makedirs(model_dir)
    from side_by_side import write_tiny_model
    from throughput import write_random_model
    if tiny:
        write_tiny_model(model_dir)
    else:
        write_random_model(model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        cfg["architectures"] = ["Qwen3ForCausalLM"]           # vLLM picks its model class by this
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    with open(os.path.join(model_dir, "config.json")) as f:
        return model_dir, json.load(f)["vocab_size"]


def device_name(tiny: bool) -> str:
    if tiny:
        return "cpu"
    import torch
    return torch.cuda.get_device_name(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-site", default=None, help="an importable vLLM (../shared/peers/vllm/)")
    ap.add_argument("--servers", default="vllm,ours", help="which servers, in this order")
    ap.add_argument("--rates", default="8,16,32,64,128", help="offered requests/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0, help="arrivals per rate last this long")
    ap.add_argument("--input-len", default="256:768", help="prompt tokens, uniform in lo:hi")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--clients", type=int, default=4, help="client processes sharing the load")
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=25.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny model, ours on both sides")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.rates = args.rates if args.rates != ap.get_default("rates") else "1,2"
        args.seconds = min(args.seconds, 3.0)
        args.input_len = args.input_len if args.input_len != ap.get_default("input_len") else "8:24"
        args.output_len = min(args.output_len, 8)
        args.clients = min(args.clients, 2)
        args.slo_ttft_ms, args.slo_tpot_ms = 30_000.0, 5_000.0
        args.max_model_len = min(args.max_model_len, 256)
    servers = args.servers.split(",")
    if "vllm" in servers and not args.tiny and not args.vllm_site:
        ap.error("--vllm-site is needed to start vLLM (or --servers ours)")
    rates = [float(x) for x in args.rates.split(",")]
    card = device_name(args.tiny)
    tag = "cpu" if args.tiny else ("h200" if "H200" in card else "h100" if "H100" in card else "gpu")
    out = args.out or os.path.join(ROOT, "bench", "results", f"serve_vs_vllm_{tag}.json")
    result: dict[str, Any]                          # (the JSON this bench writes)
    result = {"bench": "serve_vs_vllm", "device": card, "machine": {"platform": platform.platform(),
              "cpus": os.cpu_count()}, "workload": {"rates": rates, "seconds_per_rate": args.seconds,
              "input_len": args.input_len, "output_len": args.output_len, "clients": args.clients,
              "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "max_model_len": args.max_model_len,
              "model": "Qwen3-0.6B shape, random bf16 weights" if not args.tiny else "tiny random Qwen3"},
              "servers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, vocab = write_models(args.tiny, tmp)
        for name in servers:
            # NOTE: in the smoke mode "vllm" is our own server again (no vLLM on a CPU machine).
            kind = "ours" if args.tiny else name
            try:
                result["servers"][name] = bench_server(kind, name, args, model_dir, vocab, rates, tmp)
            except (RuntimeError, TimeoutError) as e:
                result["servers"][name] = {"error": str(e)}
            if "rows" in result["servers"][name]:
                print_table(name, result["servers"][name]["rows"], result["servers"][name]["knee"])
            else:
                print(f"\n{name}: {result['servers'][name]['error'][:2000]}")
            result["verdict"] = verdict(result["servers"])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w") as f:
                json.dump(result, f, indent=2)
    v = result["verdict"]
    if v.get("complete"):
        print(f"\nverdict on {card}: p99 TTFT/TPOT <= vLLM's up to its knee: {v['p99_latency_at_or_below_vllm']}; "
              f"knee ours {v['ours_knee']} vs vLLM {v['vllm_knee']} req/s: {v['knee_at_least_vllm']}")
        for r in v["per_rate_up_to_vllm_knee"]:
            print(f"  {r['rate']:>6g} req/s: TTFT p99 x{r['ttft_p99_ratio']:.2f}, TPOT p99 x{r['tpot_p99_ratio']:.2f}")
    print(f"wrote {out}")
    return 0 if all("rows" in s for s in result["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
