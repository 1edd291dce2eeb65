"""Interleaved A/B of our engine's throughput on one GPU, in one call: two source trees,
or one tree under two environments, measured in alternation.

Why: separate device calls land on different machines, whose spread (~1.5 % on H100s)
hides a regression of that size. Here both variants run on the same card, in turn.

Runbook (on the device; the .git directory does not travel, so an old commit's package
is staged here first, into .gpu/, which git ignores, and carried):

    python bench/throughput_ab.py --export 386d464 .gpu/ab/386d464            # here
    python bench/throughput_ab.py --a .gpu/ab/386d464 --b . --rounds 3 \\
        --model-dir /tmp/ab-model --out $OUT/throughput_ab_386d464.json        # device, carry .gpu/ab/386d464
    python bench/throughput_ab.py --a-env VLLM_ANATOMY_PREFILL_KERNEL=0 --b-env VLLM_ANATOMY_PREFILL_KERNEL=1 \\
        --model-dir /tmp/ab-model --out $OUT/throughput_ab_prefill.json        # one tree, two settings
    python bench/throughput_ab.py --a-env VLLM_ANATOMY_PDL=0 --b-env VLLM_ANATOMY_PDL=1 \
        --model-dir /tmp/ab-model --out $OUT/throughput_ab_pdl_tuned.json      # PDL, GEMMs at =tuned
    python bench/throughput_ab.py --a-env VLLM_ANATOMY_PDL=0 --a-env VLLM_ANATOMY_SKINNY_GEMM=1 \
        --b-env VLLM_ANATOMY_PDL=1 --b-env VLLM_ANATOMY_SKINNY_GEMM=1 \
        --model-dir /tmp/ab-model --out $OUT/throughput_ab_pdl_skinny1.json    # PDL, every GEMM split-K
    (one K=V per --a-env/--b-env; repeat the flag for more. PDL's prefetch helps only the
    GEMMs that run through the split-K kernel: at =tuned cuBLAS keeps most shapes, so try both.)
    python bench/throughput_ab.py --shape smollm2-135m --a-env VLLM_ANATOMY_FUSE_ROPE_KVCACHE=0 \
        --b-env VLLM_ANATOMY_FUSE_ROPE_KVCACHE=1 --model-dir /tmp/ab-model-smollm2 \
        --out $OUT/throughput_ab_fuse_rope_kv.json                            # Llama's RoPE + KV write
    (--shape smollm2-135m: the default model's shape, a Llama without q/k norm, for what only a
    Llama takes; give it its own --model-dir: a directory holding the other shape is refused.)

    python bench/throughput_ab.py [--a TREE] [--b TREE] [--a-env K=V ...] [--b-env K=V ...]
        [--a-label NAME] [--b-label NAME] [--rounds 3] [--shape qwen3-0.6b|smollm2-135m]
        [--model-dir DIR] [--out FILE] [--tiny] [--trace-level off|spans|full]

A tree is a directory holding a `vllm_anatomy/` package (default: this checkout). The
package imports nothing from outside its folder (only the CLI's `lesson` and `dashboard`
commands read ../lessons and ../dashboard), so `--export REV DIR` writes just
`git archive REV vllm_anatomy` into DIR (and any subpackage REV's pyproject.toml maps to
another folder, put back in place), with a marker file naming REV. Give the same tree
and environment twice (an A/A run) to see the noise floor of the card itself.

Each measurement is a fresh subprocess with PYTHONPATH = the variant's tree, then whatever
PYTHONPATH held (the device's wheels in /tmp/site), and the variant's environment over
ours' usual one: bench/vs_vllm.py's "ours" throughput worker exactly (its run_worker:
in-process engine, default settings, trace level off, nano-vllm's warm-up, then
nano-vllm's workload: 256 sequences, prompts and outputs uniform in [100, 1024],
temperature 0.6, ignore_eos, Qwen3-0.6B-shaped random bf16 weights (or --shape
smollm2-135m's), written once and shared). The bench code is this checkout's; only the engine comes from the tree. Each
worker reports the `vllm_anatomy.__file__` it imported; a sample from the wrong tree
stops the run.

Order: rounds alternate A B, B A, A B, ... (ABBA): a drift over the call (clocks and
heat, the Triton cache filled by the first run, the page cache) favours neither variant
over each pair of rounds, where ABAB would always give B the later slot. B/A is taken
per round, from its two adjacent runs; the summary is each variant's median tok/s and
the median, min and max of those paired ratios. (On a fresh machine the first run fills
Triton's on-disk cache; a kernel first compiled inside the timed workload would slow
round 1's A alone, which the median of three ratios discounts: see each sample's
startup_seconds.)

Wall time on an H100 (estimate): per run ~5 s of imports, ~20 s start-up (CUDA graphs),
~7 s of workload (134k output tokens at ~19.5k tok/s): ~35 s, so ~70 s a round; 3 rounds
~3.5 min, plus ~20 s to write the model (once per --model-dir). Two 3-round A/Bs sharing
--model-dir fit one 10-minute call (~7.5 min).

`--tiny` is the CPU smoke mode (tests/bench/): a tiny random Qwen3, 4 short sequences.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import ROOT, run_subprocess, worker_env, write_models  # noqa: E402
from vs_vllm import FULL, TINY, run_worker, tok_per_s, workload_record  # noqa: E402

MARKER = "throughput_ab_export.json"     # written by --export beside the package
# --shape: the model the workload runs on (random bf16 weights), and the model_type its config.json says.
SHAPES = {"qwen3-0.6b": ("Qwen3-0.6B shape, random bf16 weights", "qwen3"),
          "smollm2-135m": ("SmolLM2-135M shape (Llama, no q/k norm), random bf16 weights", "llama")}


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str                    # "a" or "b"
    label: str
    tree: str                   # absolute path of the directory holding vllm_anatomy/
    env: dict[str, str]


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            sys.exit(f"--a-env/--b-env take KEY=VALUE, not {pair!r}")
        if key == "PYTHONPATH":
            sys.exit("PYTHONPATH is set per variant from its tree: use --a/--b")
        env[key] = value
    return env


def make_variant(key: str, tree: str, env_pairs: list[str], label: str | None) -> Variant:
    tree = os.path.abspath(tree)
    if not os.path.isfile(os.path.join(tree, "vllm_anatomy", "__init__.py")):
        sys.exit(f"--{key} {tree}: no vllm_anatomy/ package there (stage one with --export REV DIR)")
    env = parse_env(env_pairs)
    return Variant(key, label or " ".join([os.path.relpath(tree)] + [f"{k}={v}" for k, v in env.items()]), tree, env)


def git(cwd: str, *args: str) -> str | None:
    out = subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def tree_rev(tree: str) -> dict:
    """The commit a tree holds: --export's marker, else the git checkout's HEAD (if the tree
    is a checkout's root: on the device the .git directory is not there)."""
    marker = os.path.join(tree, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            return json.load(f)
    if git(tree, "rev-parse", "--show-toplevel") != os.path.realpath(tree):
        return {"rev": None, "source": "no marker, not a git checkout"}
    return {"rev": git(tree, "rev-parse", "HEAD"), "source": "git checkout",
            "vllm_anatomy_dirty": bool(git(tree, "status", "--porcelain", "--", "vllm_anatomy"))}


def export(rev: str, dest: str) -> None:
    """`git archive REV vllm_anatomy` unpacked into DEST, and a marker naming REV."""
    full = git(ROOT, "rev-parse", "--verify", f"{rev}^{{commit}}")
    if not full:
        sys.exit(f"--export: {rev!r} is not a commit of {ROOT}")
    if os.path.exists(os.path.join(dest, "vllm_anatomy")):
        sys.exit(f"--export: {dest}/vllm_anatomy exists already (remove it first)")
    os.makedirs(dest, exist_ok=True)
    for package, folder in package_folders(full).items():
        archive = subprocess.run(["git", "-C", ROOT, "archive", f"{full}:{folder}"], capture_output=True, check=True)
        target = os.path.join(dest, *package.split("."))
        os.makedirs(target, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(target, filter="data")
    with open(os.path.join(dest, MARKER), "w") as f:
        json.dump({"rev": full, "subject": git(ROOT, "log", "-1", "--format=%s", full), "source": "--export",
                   "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=2)
    print(f"exported {full[:12]} into {dest}: carry it and pass --a {dest}")


def package_folders(rev: str) -> dict[str, str]:
    """{package: folder in REV's tree} of vllm_anatomy and every subpackage REV's pyproject.toml
    maps elsewhere ([tool.setuptools.package-dir]).

    NOTE: from 2026-12-05 to 2026-12-06 the Triton kernels lived in the repo's top-level
    `kernels/` and were installed as `vllm_anatomy.kernels`; an export of such a commit must
    put them back under the package, or its engine fails to import them."""
    folders = {"vllm_anatomy": "vllm_anatomy"}
    text = git(ROOT, "show", f"{rev}:pyproject.toml")
    if text:
        # NOTE: tomllib is imported here, not at the top: it is Python >= 3.11's, the package
        # admits 3.10 (requires-python) and only --export reads TOML.
        if sys.version_info < (3, 11):
            raise SystemExit("--export reads REV's pyproject.toml with tomllib: it needs Python >= 3.11")
        else:
            import tomllib
            mapped = tomllib.loads(text).get("tool", {}).get("setuptools", {}).get("package-dir", {})
            folders |= {pkg: folder for pkg, folder in mapped.items() if pkg.startswith("vllm_anatomy.")}
    return folders


def order(rounds: int) -> list[str]:
    return ["ab" if i % 2 == 0 else "ba" for i in range(rounds)]


def in_tree(file: str | None, tree: str) -> bool:
    package = os.path.join(tree, "vllm_anatomy", "__init__.py")
    return file is not None and os.path.realpath(file) == os.path.realpath(package)


def measure(v: Variant, model_dir: str, tiny: bool, timeout_s: float, trace_level: str = "off") -> dict:
    """One fresh subprocess of vs_vllm's "ours" throughput worker, importing from v.tree."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model-dir", model_dir,
           "--env-keys", ",".join(v.env), "--trace-level", trace_level] + (["--tiny"] if tiny else [])
    env = worker_env("ours", None, multiprocess=False, tree=v.tree) | v.env
    r = run_subprocess(f"{v.label} ({v.tree} {v.env})", cmd, env, timeout_s)
    return r | {"variant": v.key, "isolated": in_tree(r.get("vllm_anatomy_file"), v.tree)}


def worker(model_dir: str, env_keys: list[str], tiny: bool, trace_level: str = "off") -> dict:
    result = run_worker("ours", model_dir, trace_level, ["throughput"], TINY if tiny else FULL)
    return result | {"vllm_anatomy_file": sys.modules["vllm_anatomy"].__file__,
                     "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM") or k in env_keys}}


def summarize(samples: list[dict]) -> dict:
    done = [(s["round"], s["variant"], s["throughput"]["tok_per_s"]) for s in samples if tok_per_s(s)]
    by_variant = {k: [t for _, v, t in done if v == k] for k in "ab"}
    by_round: dict[int, dict[str, float]] = {}
    for rnd, v, t in done:
        by_round.setdefault(rnd, {})[v] = t
    ratios = [r["b"] / r["a"] for _, r in sorted(by_round.items()) if len(r) == 2]
    return {"median_tok_per_s": {k: statistics.median(t) if t else None for k, t in by_variant.items()},
            "ratios_b_over_a": ratios,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None)}


def print_round(samples: list[dict], rnd: int, first: bool) -> None:
    if first:
        print(f"{'round':>5}  {'order':5}{'A tok/s':>10}{'A s':>8}{'B tok/s':>10}{'B s':>8}{'B/A':>8}")
    got = {s["variant"]: s for s in samples if s["round"] == rnd}
    cells = []
    for k in "ab":
        t = got.get(k, {}).get("throughput")
        cells.append(f"{t['tok_per_s']:>10.0f}{t['seconds']:>8.2f}" if t else f"{'failed':>10}{'':>8}")
    ratio = summarize([s for s in samples if s["round"] == rnd])["ratio_median"]
    order_s = " ".join(s["variant"].upper() for s in samples if s["round"] == rnd)
    print(f"{rnd:>5}  {order_s:5}{cells[0]}{cells[1]}{'' if ratio is None else f'{ratio:.4f}':>8}", flush=True)


def print_summary(result: dict) -> None:
    s = result["summary"]
    for k, v in result["variants"].items():
        med = s["median_tok_per_s"][k]
        rev = v["tree_rev"].get("rev")
        # (on the device the .git of the copied tree may be older than its files: say so)
        rev_text = f"{rev}{', vllm_anatomy/ differs from it' if v['tree_rev'].get('vllm_anatomy_dirty') else ''}"
        print(f"{k.upper()} = {v['label']}: tree {v['tree']} (rev {rev_text}), env {v['env']}: "
              f"median {'-' if med is None else f'{med:.0f}'} tok/s")
    if s["ratio_median"] is not None:
        print(f"B/A per round: {', '.join(f'{r:.4f}' for r in s['ratios_b_over_a'])}; median {s['ratio_median']:.4f} "
              f"(min {s['ratio_min']:.4f}, max {s['ratio_max']:.4f})")


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k in "ab":
        ap.add_argument(f"--{k}", default=ROOT, metavar="TREE", help="a directory holding vllm_anatomy/ (default: this checkout)")
        ap.add_argument(f"--{k}-env", action="append", default=[], metavar="K=V", help="an environment override (repeatable)")
        ap.add_argument(f"--{k}-label", help="a name for the table and the JSON")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of one run each (ABBA order)")
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b",
                    help="the model's shape (GPU runs; --tiny writes its own tiny Qwen3)")
    ap.add_argument("--model-dir", help="write the model here, or reuse the one written here before (default: a temp dir)")
    ap.add_argument("--out", default="bench/results/throughput_ab.json")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny model, tiny workload")
    ap.add_argument("--trace-level", choices=["off", "spans", "full"], default="off",
                    help="both variants' trace level (e.g. spans, to A/B a tracing change)")
    ap.add_argument("--worker-timeout", type=float, default=300, help="seconds one run's subprocess may take")
    ap.add_argument("--export", nargs=2, metavar=("REV", "DIR"), help="local only: stage REV's vllm_anatomy/ into DIR")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--env-keys", default="", help=argparse.SUPPRESS)
    return ap


def check_shape(model_dir: str, shape: str, tiny: bool) -> None:
    """A reused --model-dir must hold the --shape asked for (its config's model_type)."""
    if tiny:
        return
    with open(os.path.join(model_dir, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type != SHAPES[shape][1]:
        sys.exit(f"--model-dir {model_dir} holds a {model_type!r} model, not --shape {shape}: give another directory")


def run_rounds(args: argparse.Namespace, variants: dict[str, Variant], model_dir: str, result: dict) -> bool:
    """The rounds in ABBA order; the JSON saved after every sample. False at the first
    failed run or one that imported the engine from the wrong tree."""
    def save() -> None:
        result["summary"] = summarize(result["samples"])
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    for rnd, pair in enumerate(result["order"], 1):
        for slot, key in enumerate(pair):
            sample = (measure(variants[key], model_dir, args.tiny, args.worker_timeout, args.trace_level)
                      | {"round": rnd, "slot": slot})
            result["samples"].append(sample)
            save()
            if "error" in sample or not sample["isolated"]:
                print(f"stopped: run {key.upper()} of round {rnd} "
                      f"{'failed' if 'error' in sample else 'imported ' + str(sample.get('vllm_anatomy_file'))}")
                return False
        print_round(result["samples"], rnd, first=rnd == 1)
    return True


def main() -> None:
    args = arg_parser().parse_args()
    if args.worker:
        keys = [k for k in args.env_keys.split(",") if k]
        print("RESULT " + json.dumps(worker(args.model_dir, keys, args.tiny, args.trace_level)), flush=True)
        return
    if args.export:
        export(*args.export)
        return
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    if args.tiny and args.shape != "qwen3-0.6b":
        sys.exit("--shape is for GPU runs: --tiny writes its own tiny Qwen3")
    variants = {k: make_variant(k, getattr(args, k), getattr(args, f"{k}_env"), getattr(args, f"{k}_label"))
                for k in "ab"}
    import torch
    if not torch.cuda.is_available() and not args.tiny:
        sys.exit("bench/throughput_ab.py needs a CUDA device (or --tiny, the CPU smoke mode)")
    result = {
        "bench": "throughput_ab", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "machine": platform.node(), "smoke": args.tiny, "argv": sys.argv[1:],
        "workload": workload_record(TINY if args.tiny else FULL, args.tiny)
        | ({} if args.tiny else {"model": SHAPES[args.shape][0]}), "shape": args.shape, "rounds": args.rounds,
        "trace_level": args.trace_level, "order": order(args.rounds),
        "variants": {k: {"label": v.label, "tree": v.tree, "tree_rev": tree_rev(v.tree), "env": v.env}
                     for k, v in variants.items()},
        "samples": [],
    }
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as vllm_dir:
        model_dir = os.path.abspath(args.model_dir or tmp)
        result["model_reused"] = os.path.exists(os.path.join(model_dir, "config.json"))
        if result["model_reused"]:
            check_shape(model_dir, args.shape, args.tiny)
        else:
            os.makedirs(model_dir, exist_ok=True)
            if args.shape == "qwen3-0.6b":
                write_models(model_dir, vllm_dir, args.tiny)
            else:
                from throughput import smollm2_135m_config, write_random_model
                write_random_model(model_dir, cfg=smollm2_135m_config())
        ok = run_rounds(args, variants, model_dir, result)
    print_summary(result)
    print(f"wrote {args.out}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
