"""Scaling, side by side with vLLM: throughput as the work grows, in sequences and in context.

Runbook (H200, vLLM 0.26.0's slim bundle of ../shared/peers/vllm/ unpacked at /tmp/vllm-site):

    python bench/scaling.py --vllm-site /tmp/vllm-site
    python bench/plot_scaling.py            # on any machine: the JSON -> bench/results/scaling_h200.png

expected wall time about 5 minutes (vLLM's start-up 50-95 s, ours about 20 s, the
model written once, the ceilings, then about a minute of points per engine). The JSON
is written again after each engine, so a run cut short keeps what it measured.

    python bench/scaling.py --vllm-site SITE [--out bench/results/scaling_h200.json] [--skip-vllm] [--tiny]

Two series, each point one `LLM.generate` of random token ids in [0, 10000],
temperature 0.6, ignore_eos, on the Qwen3-0.6B-shaped model with random bf16 weights
of bench/vs_vllm.py (bench/side_by_side.py), max_model_len 8,320 (the longest prompt plus its output):

    num_seqs   1, 4, 16, 64, 256, 1,024 sequences of 256 prompt tokens, 128 output tokens each
    context    64 sequences of 512, 1k, 2k, 4k, 8k prompt tokens, 128 output tokens each

Each engine runs in ONE subprocess (vLLM exactly as ../shared/peers/vllm/ runs it, its
default multiprocess engine; ours in-process, its default) that starts the engine once
and then runs every point: first a warm-up of the point's shape (its own prompts, 16
output tokens: a CUDA graph or a Triton compile for a new shape is paid there), then
the measured run on fresh prompts (no prefix-cache hit). Each point also carries its
roofline floor from bench/throughput.py's model (the weights and the live KV read
once per decode step at the copy rate, prefill at the matmul rate, both measured
here), so the plot can show how far from the floor each engine is as the work grows.
Prints a table and writes JSON; `--tiny` is the CPU smoke mode (tests/bench/).

`--prefill-kernel` runs ours with VLLM_ANATOMY_PREFILL_KERNEL=1 (fresh prefills through
vllm_anatomy/kernels/prefill_attention.py; recorded as "prefill_kernel" in the JSON);
`--series context` runs only the context points. The A/B of the long prompts, ours only:

    python bench/scaling.py --skip-vllm --series context --out $OUT/scaling_ctx_off.json
    python bench/scaling.py --skip-vllm --series context --prefill-kernel --out $OUT/scaling_ctx_on.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import Engine, ceilings, run_subprocess, worker_env, write_models  # noqa: E402

SERIES = ("num_seqs", "context")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The points of one run: the H200's (FULL) or the CPU smoke test's (TINY)."""
    num_seqs: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
    num_seqs_prompt_len: int = 256
    contexts: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    context_num_seqs: int = 64
    output_len: int = 128
    warmup_output_len: int = 16

    @property
    def max_model_len(self) -> int:
        return max(self.contexts + (self.num_seqs_prompt_len,)) + self.output_len

    def points(self, series: str) -> list[dict]:
        """Each point's x and shape: num_seqs sequences of prompt_len tokens, output_len out."""
        if series == "num_seqs":
            return [{"x": n, "num_seqs": n, "prompt_len": self.num_seqs_prompt_len, "output_len": self.output_len}
                    for n in self.num_seqs]
        return [{"x": c, "num_seqs": self.context_num_seqs, "prompt_len": c, "output_len": self.output_len}
                for c in self.contexts]


FULL = Plan()
TINY = Plan(num_seqs=(1, 4), num_seqs_prompt_len=16, contexts=(32, 64), context_num_seqs=2, output_len=4,
            warmup_output_len=2)


def draw(point: dict, rng: random.Random) -> list[list[int]]:
    return [[rng.randint(0, 10000) for _ in range(point["prompt_len"])] for _ in range(point["num_seqs"])]


# ---------------------------------------------------------------------------- the worker (one engine)

def run_worker(kind: str, model_dir: str, plan: Plan, series_run: tuple[str, ...] = SERIES) -> dict:
    engine = Engine(kind, model_dir, max_model_len=plan.max_model_len)
    engine.generate([list(range(1, 9))], [16], 0.0)                     # warm-up, as nano-vllm's bench
    result = {"engine": kind, "startup_seconds": engine.startup_s, "settings": engine.settings()}
    rng = random.Random(0)
    for series in series_run:
        result[series] = []
        for point in plan.points(series):
            n = point["num_seqs"]
            # NOTE: the warm-up's prompts are other random ids than the measured
            # run's: with prefix caching on (both engines' default) the measured
            # run must not find its prompts cached.
            engine.generate(draw(point, rng), [plan.warmup_output_len] * n, 0.6)
            seconds, generated = engine.generate(draw(point, rng), [point["output_len"]] * n, 0.6)
            result[series].append(point | {"seconds": seconds, "output_tokens": generated,
                                           "tok_per_s": generated / seconds})
    engine.shutdown()
    return result


# ---------------------------------------------------------------------------- the driver

def floors(plan: Plan, copy_bw: float, matmul_rate: float) -> dict:
    """Each point's roofline floor (bench/throughput.py's model: only the lengths matter)."""
    from throughput import roofline
    out = {}
    for series in SERIES:
        out[series] = []
        for p in plan.points(series):
            roof = roofline([[0] * p["prompt_len"]] * p["num_seqs"], [p["output_len"]] * p["num_seqs"],
                            copy_bw, matmul_rate)
            out[series].append({"x": p["x"], "floor_seconds": roof["floor_seconds"],
                                "floor_tok_per_s": roof["floor_tok_per_s"]})
    return out


def add_fraction_of_floor(engine_result: dict, floor: dict) -> None:
    for series in SERIES:
        for point, f in zip(engine_result.get(series, []), floor[series]):
            point["floor_tok_per_s"] = f["floor_tok_per_s"]
            point["fraction_of_floor"] = point["tok_per_s"] / f["floor_tok_per_s"]


def print_table(result: dict, plan: Plan) -> None:
    engines = [(name, result[key]) for name, key in (("ours", "vllm_anatomy"), ("vLLM", "vllm"))
               if key in result and "error" not in result[key]]
    for series in result["series"]:        # the series this run measured (--series)
        head = "sequences" if series == "num_seqs" else "prompt tokens"
        print(f"{head:>14}" + "".join(f"{name + ' tok/s':>14}{'% floor':>9}" for name, _ in engines)
              + f"{'floor tok/s':>13}" + (f"{'ours/vLLM':>11}" if len(engines) == 2 else ""))
        for i, f in enumerate(result["floor"][series]):
            row = f"{f['x']:>14}"
            for _, r in engines:
                p = r[series][i]
                row += f"{p['tok_per_s']:>14.0f}{100 * p['fraction_of_floor']:>8.1f}%"
            row += f"{f['floor_tok_per_s']:>13.0f}"
            if len(engines) == 2:
                row += f"{engines[0][1][series][i]['tok_per_s'] / engines[1][1][series][i]['tok_per_s']:>10.2f}x"
            print(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-site", help="directory with an importable vLLM (the slim bundle, unpacked)")
    ap.add_argument("--skip-vllm", action="store_true", help="ours only")
    ap.add_argument("--out", default="bench/results/scaling_h200.json")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny model, tiny points, nominal ceilings")
    ap.add_argument("--worker-timeout", type=float, default=420, help="seconds one engine's subprocess may take")
    ap.add_argument("--prefill-kernel", action="store_true",
                    help="ours with VLLM_ANATOMY_PREFILL_KERNEL=1 (fresh prefills through the prefill kernel)")
    ap.add_argument("--series", choices=SERIES, action="append",
                    help="run only this series (repeatable; default: both)")
    ap.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    plan = TINY if args.tiny else FULL
    series_run = tuple(s for s in SERIES if s in (args.series or SERIES))
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args.worker, args.model_dir, plan, series_run)), flush=True)
        return
    if not args.vllm_site and not args.skip_vllm:
        sys.exit("--vllm-site is required (see ../shared/peers/vllm/README.md), or --skip-vllm")
    import torch
    if not torch.cuda.is_available() and not args.tiny:
        sys.exit("bench/scaling.py needs a CUDA device (or --tiny, the CPU smoke mode)")

    copy, mm = ceilings(args.tiny)
    result = {
        "bench": "scaling", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "machine": platform.node(), "smoke": args.tiny,
        "model": "tiny random Qwen3 (smoke)" if args.tiny else "Qwen3-0.6B shape, random bf16 weights",
        "max_model_len": plan.max_model_len, "temperature": 0.6, "ignore_eos": True,
        "plan": dataclasses.asdict(plan),
        "series": {s: plan.points(s) for s in series_run},
        "prefill_kernel": args.prefill_kernel,
        "copy_ceiling_bytes_per_s": copy["bytes_per_s"], "matmul_ceiling_flop_per_s": mm["flop_per_s"],
        "ceilings_nominal": args.tiny, "floor": floors(plan, copy["bytes_per_s"], mm["flop_per_s"]),
    }

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    def spawn(kind: str, model_dir: str) -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--model-dir", model_dir]
        cmd += ["--tiny"] if args.tiny else []
        for series in series_run:
            cmd += ["--series", series]
        # (ours in-process, its default; vLLM's multiprocessing left to its default, as peers/vllm runs it)
        env = worker_env(kind, args.vllm_site, False if kind == "ours" else None)
        if kind == "ours":
            env["VLLM_ANATOMY_PREFILL_KERNEL"] = "1" if args.prefill_kernel else "0"
        r = run_subprocess(f"{kind}: {len(series_run)} series", cmd, env, args.worker_timeout)
        if "error" not in r:
            add_fraction_of_floor(r, result["floor"])
        return r

    with tempfile.TemporaryDirectory() as ours_dir, tempfile.TemporaryDirectory() as vllm_dir:
        vllm_dir, result["vllm_model_config"] = write_models(ours_dir, vllm_dir, args.tiny)
        result["vllm_anatomy"] = spawn("ours", ours_dir)
        save()
        if not args.skip_vllm:
            result["vllm"] = spawn("vllm", vllm_dir)
            save()
    print_table(result, plan)
    print(f"wrote {args.out}")
    failed = [k for k in ("vllm_anatomy", "vllm") if "error" in result.get(k, {})]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their errors are in {args.out})")


if __name__ == "__main__":
    main()
