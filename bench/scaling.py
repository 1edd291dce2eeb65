"""Scaling, side by side with vLLM: throughput as the work grows, in sequences and in context,
and the time to first token of one long prompt.

Runbook (H200, vLLM 0.26.0's slim bundle of ../shared/peers/vllm/ unpacked at /tmp/vllm-site):

    python bench/scaling.py --vllm-site /tmp/vllm-site
    python bench/plot_scaling.py            # on any machine: the JSON -> bench/results/scaling_h200.png

expected wall time about 5 minutes (vLLM's start-up 50-95 s, ours about 20 s, the
model written once, the ceilings, then about a minute of points per engine). The JSON
is written again after each engine, so a run cut short keeps what it measured.

    python bench/scaling.py --vllm-site SITE [--out bench/results/scaling_h200.json] [--skip-vllm] [--tiny]
                            [--series num_seqs,context,ttft] [--prefill-kernel [0|1|cudnn]]

Three series of random token ids in [0, 10000] on the Qwen3-0.6B-shaped model with random
bf16 weights of bench/vs_vllm.py (bench/side_by_side.py), max_model_len 8,320 (the longest
prompt plus its output). Throughput, each point one `LLM.generate`, temperature 0.6, ignore_eos:

    num_seqs   1, 4, 16, 64, 256, 1,024 sequences of 256 prompt tokens, 128 output tokens each
    context    64 sequences of 512, 1k, 2k, 4k, 8k prompt tokens, 128 output tokens each

and time to first token (TTFT), as bench/vs_vllm.py measures it at 1k (the wall time of
one `LLM.generate` of one prompt, max_tokens=1, greedy), here at three lengths and on a
fresh random prompt every call (vs_vllm.py repeats one prompt: a prefix-cache hit after
the first call):

    ttft       one request alone of 1k, 4k, 8k prompt tokens, max_tokens 1: a first call
               (kept as warmup_ms: the first prompt of that length, which pays any per-shape
               set-up such as a new cuDNN graph), then 5 calls, median in ms (all kept)

Each engine runs in ONE subprocess (vLLM exactly as ../shared/peers/vllm/ runs it, its
default multiprocess engine; ours in-process, its default) that starts the engine once
and then runs every point: first a warm-up of the point's shape (its own prompts, 16
output tokens: a CUDA graph or a Triton compile for a new shape is paid there), then
the measured run on fresh prompts (no prefix-cache hit). Each throughput point also
carries its roofline floor from bench/throughput.py's model (the weights and the live
KV read once per decode step at the copy rate, prefill at the matmul rate, both
measured here), so the plot can show how far from the floor each engine is as the
work grows. Prints a table per series and writes JSON (with "ttft_ratio": ours/vLLM
per length, <= 1 where ours is as fast); `--tiny` is the CPU smoke mode (tests/bench/).

`--prefill-kernel [0|1|cudnn]` runs ours with VLLM_ANATOMY_PREFILL_KERNEL set to it (bare:
1, fresh prefills of at least VLLM_ANATOMY_PREFILL_MIN_LEN tokens, `--prefill-min-len`,
through vllm_anatomy/kernels/prefill_attention.py; cudnn: those of at least
VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN tokens, `--prefill-sdpa-min-len`, through torch SDPA on
cuDNN, vllm_anatomy/kernels/prefill_attention_sdpa.py; left out: the engine's defaults,
1 and 2048); recorded as "prefill_kernel" in the JSON (and in ours' settings as read). `--series` takes a comma-separated list (repeatable). The
A/B of the long prompts, ours only, then against vLLM:

    python bench/scaling.py --skip-vllm --series context,ttft --out $OUT/scaling_ctx_off.json
    python bench/scaling.py --skip-vllm --series context,ttft --prefill-kernel --out $OUT/scaling_ctx_on.json
    python bench/scaling.py --skip-vllm --series context,ttft --prefill-kernel cudnn --out $OUT/scaling_ctx_cudnn.json
    python bench/scaling.py --vllm-site SITE --series context,ttft --prefill-kernel cudnn --out $OUT/scaling_ctx_vs_vllm.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import Engine, ceilings, run_subprocess, worker_env, write_models  # noqa: E402

THROUGHPUT_SERIES = ("num_seqs", "context")       # output tok/s, against the roofline floor
SERIES = THROUGHPUT_SERIES + ("ttft",)             # (the order a run measures them in)
PREFILL_KERNELS = ("0", "1", "cudnn")              # VLLM_ANATOMY_PREFILL_KERNEL (vllm_anatomy/envs.py)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The points of one run: the H200's (FULL) or the CPU smoke test's (TINY)."""
    num_seqs: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
    num_seqs_prompt_len: int = 256
    contexts: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    context_num_seqs: int = 64
    output_len: int = 128
    warmup_output_len: int = 16
    ttft_prompt_lens: tuple[int, ...] = (1024, 4096, 8192)
    ttft_repeats: int = 5

    @property
    def max_model_len(self) -> int:
        return max(self.contexts + self.ttft_prompt_lens + (self.num_seqs_prompt_len,)) + self.output_len

    def points(self, series: str) -> list[dict]:
        """Each point's x and shape: num_seqs sequences of prompt_len tokens, output_len out."""
        if series == "num_seqs":
            return [{"x": n, "num_seqs": n, "prompt_len": self.num_seqs_prompt_len, "output_len": self.output_len}
                    for n in self.num_seqs]
        if series == "ttft":
            return [{"x": n, "num_seqs": 1, "prompt_len": n, "output_len": 1} for n in self.ttft_prompt_lens]
        return [{"x": c, "num_seqs": self.context_num_seqs, "prompt_len": c, "output_len": self.output_len}
                for c in self.contexts]


FULL = Plan()
TINY = Plan(num_seqs=(1, 4), num_seqs_prompt_len=16, contexts=(32, 64), context_num_seqs=2, output_len=4,
            warmup_output_len=2, ttft_prompt_lens=(16, 48))


def parse_series(text: str) -> tuple[str, ...]:
    """`--series context,ttft` -> ("context", "ttft"); an unknown name is refused."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in SERIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown series {', '.join(unknown) or repr(text)}: "
                                         f"a comma-separated list of {', '.join(SERIES)}")
    return names


def draw(point: dict, rng: random.Random) -> list[list[int]]:
    return [[rng.randint(0, 10000) for _ in range(point["prompt_len"])] for _ in range(point["num_seqs"])]


# ---------------------------------------------------------------------------- the worker (one engine)

def run_worker(kind: str, model_dir: str, plan: Plan, series_run: tuple[str, ...] = SERIES) -> dict:
    engine = Engine(kind, model_dir, max_model_len=plan.max_model_len)
    engine.generate([list(range(1, 9))], [16], 0.0)                     # warm-up, as nano-vllm's bench
    result: dict[str, Any] = {"engine": kind, "startup_seconds": engine.startup_s, "settings": engine.settings()}
    rng = random.Random(0)
    for series in series_run:
        if series == "ttft":
            result["ttft"] = ttft_points(engine, plan, rng)
            continue
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


def ttft_points(engine: Engine, plan: Plan, rng: random.Random) -> list[dict]:
    """Time to first token per prompt length: one request alone, max_tokens 1, greedy, a fresh
    random prompt every call (no prefix-cache hit); one call first (warmup_ms), then
    plan.ttft_repeats calls, their median (ttft_ms) and all of them (samples_ms)."""
    points = []
    for point in plan.points("ttft"):
        warmup_s, _ = engine.generate(draw(point, rng), [1], 0.0)
        samples, generated = [], []
        for _ in range(plan.ttft_repeats):
            seconds, n = engine.generate(draw(point, rng), [1], 0.0)
            samples.append(1e3 * seconds)
            generated.append(n)
        points.append(point | {"ttft_ms": statistics.median(samples), "samples_ms": samples,
                               "warmup_ms": 1e3 * warmup_s, "output_tokens": generated})
    return points


# ---------------------------------------------------------------------------- the driver

def floors(plan: Plan, copy_bw: float, matmul_rate: float) -> dict:
    """Each point's roofline floor (bench/throughput.py's model: only the lengths matter)."""
    from throughput import roofline
    out: dict[str, list[dict]] = {}
    for series in THROUGHPUT_SERIES:
        out[series] = []
        for p in plan.points(series):
            roof = roofline([[0] * p["prompt_len"]] * p["num_seqs"], [p["output_len"]] * p["num_seqs"],
                            copy_bw, matmul_rate)
            out[series].append({"x": p["x"], "floor_seconds": roof["floor_seconds"],
                                "floor_tok_per_s": roof["floor_tok_per_s"]})
    return out


def add_fraction_of_floor(engine_result: dict, floor: dict) -> None:
    for series in THROUGHPUT_SERIES:
        for point, f in zip(engine_result.get(series, []), floor[series]):
            point["floor_tok_per_s"] = f["floor_tok_per_s"]
            point["fraction_of_floor"] = point["tok_per_s"] / f["floor_tok_per_s"]


def ttft_ratio(result: dict) -> list[dict] | None:
    """ours / vLLM of the median TTFT at each length (<= 1: ours as fast or faster), or None."""
    ours, vllm = result.get("vllm_anatomy", {}).get("ttft"), result.get("vllm", {}).get("ttft")
    if not ours or not vllm:
        return None
    return [{"x": o["x"], "ours_ms": o["ttft_ms"], "vllm_ms": v["ttft_ms"], "ours_over_vllm": o["ttft_ms"] / v["ttft_ms"]}
            for o, v in zip(ours, vllm)]


def print_table(result: dict, plan: Plan) -> None:
    engines = [(name, result[key]) for name, key in (("ours", "vllm_anatomy"), ("vLLM", "vllm"))
               if key in result and "error" not in result[key]]
    for series in result["series"]:        # the series this run measured (--series)
        if series == "ttft":
            print_ttft_table(engines)
            continue
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


def print_ttft_table(engines: list[tuple[str, dict]]) -> None:
    """Median TTFT per prompt length, each engine's first call beside it, and ours/vLLM."""
    print(f"{'prompt tokens':>14}" + "".join(f"{name + ' TTFT ms':>14}{'(1st)':>9}" for name, _ in engines)
          + (f"{'ours/vLLM':>11}" if len(engines) == 2 else ""))
    for i, point in enumerate(engines[0][1]["ttft"] if engines else []):
        row = f"{point['x']:>14}"
        for _, r in engines:
            p = r["ttft"][i]
            row += f"{p['ttft_ms']:>14.1f}{p['warmup_ms']:>9.1f}"
        if len(engines) == 2:
            row += f"{engines[0][1]['ttft'][i]['ttft_ms'] / engines[1][1]['ttft'][i]['ttft_ms']:>10.2f}x"
        print(row)
    if len(engines) == 2:
        print("(TTFT ours/vLLM: below 1.00x ours is faster)")


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-site", help="directory with an importable vLLM (the slim bundle, unpacked)")
    ap.add_argument("--skip-vllm", action="store_true", help="ours only")
    ap.add_argument("--out", default="bench/results/scaling_h200.json")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny model, tiny points, nominal ceilings")
    ap.add_argument("--worker-timeout", type=float, default=420, help="seconds one engine's subprocess may take")
    ap.add_argument("--prefill-kernel", nargs="?", const="1", default=None, choices=PREFILL_KERNELS,
                    help="ours with VLLM_ANATOMY_PREFILL_KERNEL set to this (bare: 1, long fresh prefills through "
                         "the Triton prefill kernel; cudnn: the longest through torch SDPA on cuDNN; "
                         "default: the engine's, 1)")
    ap.add_argument("--prefill-min-len", type=int,
                    help="ours with VLLM_ANATOMY_PREFILL_MIN_LEN set to this (default: the engine's, 2048)")
    ap.add_argument("--prefill-sdpa-min-len", type=int,
                    help="ours with VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN set to this (with --prefill-kernel cudnn; "
                         "default: the engine's, 2048)")
    ap.add_argument("--series", type=parse_series, action="append",
                    help=f"run only these series, comma-separated (repeatable; default: all of {','.join(SERIES)})")
    ap.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    return ap


def series_to_run(args: argparse.Namespace) -> tuple[str, ...]:
    """The --series named (every one given, in SERIES order), or all of them."""
    return tuple(s for s in SERIES if any(s in group for group in args.series or [SERIES]))


def main() -> None:
    args = arg_parser().parse_args()
    plan = TINY if args.tiny else FULL
    series_run = series_to_run(args)
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
        "prefill_kernel": args.prefill_kernel, "prefill_sdpa_min_len": args.prefill_sdpa_min_len,
        "prefill_min_len": args.prefill_min_len,
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
        cmd += ["--series", ",".join(series_run)]
        # (ours in-process, its default; vLLM's multiprocessing left to its default, as peers/vllm runs it)
        env = worker_env(kind, args.vllm_site, False if kind == "ours" else None)
        if kind == "ours":
            if args.prefill_kernel is not None:
                env["VLLM_ANATOMY_PREFILL_KERNEL"] = args.prefill_kernel
            if args.prefill_min_len is not None:
                env["VLLM_ANATOMY_PREFILL_MIN_LEN"] = str(args.prefill_min_len)
            if args.prefill_sdpa_min_len is not None:
                env["VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN"] = str(args.prefill_sdpa_min_len)
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
            result["ttft_ratio"] = ttft_ratio(result)
            save()
    print_table(result, plan)
    print(f"wrote {args.out}")
    failed = [k for k in ("vllm_anatomy", "vllm") if "error" in result.get(k, {})]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their errors are in {args.out})")


if __name__ == "__main__":
    main()
