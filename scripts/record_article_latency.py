"""The article's §七 at its own size, on a GPU: lesson 8 on Llama-2-7B in FP16 (load_format="dummy": the
published config's shapes, random weights, nothing downloaded), its table printed, its numbers written as
JSON, its run store kept as a sample for the dashboard.

    python scripts/record_article_latency.py --out-dir $OUT                 # one GPU: Llama-2-7B, batch 1 vs 32
    python scripts/record_article_latency.py --model meta-llama/Llama-2-70b-hf -tp 4 --out-dir $OUT
                                                                            # a 70B-class model over 4 GPUs

Writes, in --out-dir (default: bench/results for the JSON, samples/ for the run):
    article_latency_<gpu>[_tp<N>].json           the table (article | ours at batch 1 | ours at batch 32), the
                                                 copy rate measured on this card, weights and K/V read per
                                                 step, the floors, every measurement of lesson 8
    <gpu>-llama2-7b-dummy-article.sqlite         the run (trace level full), one SQLite file, with a description
                                                 (<gpu>-llama2-70b-dummy-tp<N>-article.sqlite for the 70B)
Needs the default model's tokenizer (`vllm-anatomy download`) and a CUDA GPU with ~25 GB free (7B).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LESSON = os.path.join(ROOT, "lessons", "08_latency_table.py")
SHORT = {"meta-llama/Llama-2-7b-hf": "llama2-7b", "meta-llama/Llama-2-70b-hf": "llama2-70b"}


def gpu_tag() -> tuple[str, str]:
    """(file-name tag, name) of the GPU: ("h100", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200")."""
    import torch
    if not torch.cuda.is_available():
        sys.exit("record_article_latency.py needs a CUDA GPU (the article's model is 13.5 GB in FP16)")
    name = torch.cuda.get_device_name()
    words = [w for w in name.split() if w[0].isalpha() and any(c.isdigit() for c in w)]
    return (words[0] if words else name.split()[-1]).lower(), name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--dtype", default="float16", help="the article's FP16 (bfloat16 reads the same bytes)")
    ap.add_argument("--out-dir", default=None, help="where the JSON and the sample go (default: the repository)")
    args = ap.parse_args()
    tag, name = gpu_tag()
    tp = args.tensor_parallel_size
    suffix = f"_tp{tp}" if tp > 1 else ""
    json_dir = args.out_dir or os.path.join(ROOT, "bench", "results")
    sample_dir = args.out_dir or os.path.join(ROOT, "samples")
    out_json = os.path.join(json_dir, f"article_latency_{tag}{suffix}.json")
    short = SHORT.get(args.model, os.path.basename(args.model.rstrip("/")).lower())
    out_run = os.path.join(sample_dir, f"{tag}-{short}-dummy{suffix.replace('_', '-')}-article.sqlite")
    trace_dir = tempfile.mkdtemp(prefix="article_latency_")
    cmd = [sys.executable, LESSON, "--model", args.model, "--load-format", "dummy", "--dtype", args.dtype,
           "--json", out_json] + (["-tp", str(tp)] if tp > 1 else [])
    env = {**os.environ, "VLLM_ANATOMY_LESSON_TRACE_DIR": trace_dir, "PYTHONPATH": ROOT + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)
    with open(out_json) as f:
        result = json.load(f)
    path = os.path.join(trace_dir, result["run"])
    with sqlite3.connect(path) as conn:          # fold the WAL into the file: one file to ship
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        desc = (f"Shipped sample: {args.model} (load_format dummy: the published config's shapes, random weights) "
                f"in {args.dtype} on {name}" + (f" x {tp} (TP={tp})" if tp > 1 else "") + ", the article's §七 "
                "setup: prompt 512, batch 1 then 32, CUDA graphs on, trace level full "
                "(scripts/record_article_latency.py).")
        conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('description', ?)", (json.dumps(desc),))
        conn.commit()
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("VACUUM")
    os.makedirs(sample_dir, exist_ok=True)
    shutil.copyfile(path, out_run)
    print(f"wrote {out_json} and {out_run} ({os.path.getsize(out_run) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
