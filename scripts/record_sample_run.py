"""Record the GPU sample run that ships in samples/, for learners without a GPU.

    python scripts/record_sample_run.py [--out samples/h200-smollm2-full.sqlite]

Needs a CUDA device and the default model (`vllm-anatomy download`). It runs
the default model (SmolLM2-135M-Instruct, bf16) at trace level `full` with
CUDA graphs on, on a small, deliberately tight engine so that one short run
shows everything the dashboard can explain:
- a shared system prompt (chat template): prefix-cache hits;
- a long prompt with max_num_batched_tokens=128: chunked prefill, mixed steps;
- 24 KV blocks (16 tokens each) for 8 requests: preemption (recompute) and resumption;
- pure-decode steps padded to a capture size and replayed as CUDA graphs,
  eager prefill steps with per-layer and per-kernel device spans.
It fails unless the run really contains a preemption, a prefix hit, a graph
replay and an eager step. The run store is checkpointed into one SQLite file.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tempfile

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a haiku about the sea.",
    "What do bees make?",
    "Give one tip for learning to cook.",
    "Explain what a CPU does to a child.",
]
LONG = ("Summarise this paragraph in one sentence: The engine keeps a paged key-value cache. "
        "Each request owns a list of fixed-size blocks, and a block table maps the request's "
        "logical blocks to physical ones. When memory runs out, the scheduler preempts the most "
        "recently admitted request, frees its blocks and puts it back at the front of the waiting "
        "queue; when it is scheduled again it recomputes its tokens, often finding most of them "
        "still in the prefix cache because freed blocks keep their hashes until they are evicted. "
        "Decode steps in which every request adds exactly one token are replayed as CUDA graphs.")
SYSTEM = "You are a concise, friendly assistant. Answer briefly and plainly."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="samples/h200-smollm2-full.sqlite")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("record_sample_run.py needs a CUDA device")
    from vllm_anatomy import LLM, SamplingParams
    trace_dir = tempfile.mkdtemp(prefix="sample_run_")
    llm = LLM(trace_level="full", trace_dir=trace_dir, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=128, num_gpu_blocks_override=24)
    engine = llm.llm_engine
    engine.recorder.set_run_meta("description", "Shipped sample: SmolLM2-135M-Instruct on an NVIDIA H200, "
                                 "trace level full, CUDA graphs on (scripts/record_sample_run.py).")
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                     for q in QUESTIONS + [LONG]]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    for o in outs:
        print(repr(o.outputs[0].text[:80]))
    m = llm.get_metrics()
    path = engine.recorder.run_path
    engine.shutdown()
    checks = check(path, m)
    print(checks)
    if not all(checks.values()):
        sys.exit(f"the run lacks something it must show: {checks}")
    with sqlite3.connect(path) as conn:          # fold the WAL into the file: one file to ship
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("VACUUM")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    shutil.copyfile(path, args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB)")


def check(path: str, metrics: dict) -> dict:
    from vllm_anatomy.tracing.reader import open_run
    with open_run(path) as run:
        spans = run.spans()
    forwards = [s for s in spans if s.name == "GPUModelRunner._model_forward"]
    modes = {s.attributes.get("vllm_anatomy.cudagraph_mode") for s in forwards}
    return {"preemption": metrics["vllm:num_preemptions"] > 0, "prefix_hit": metrics["vllm:prefix_cache_hits"] > 0,
            "graph_replay": "FULL" in modes, "eager_step": "NONE" in modes,
            "kernel_spans": any(s.name.startswith("GPU.kernel.") for s in spans),
            "layer_spans": any(s.name == "GPU.layer" for s in spans)}


if __name__ == "__main__":
    main()
