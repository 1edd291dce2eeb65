"""Record the pairs the Compare page ships (samples/compare/): the same prompts twice, one engine
argument changed, each run a small run store at trace level full.

    python scripts/record_compare_pairs.py                 # the CPU pairs (this machine)
    python scripts/record_compare_pairs.py --gpu --out-dir $OUT   # the GPU pairs (on a CUDA device)
    python scripts/record_compare_pairs.py --tp 2 --out-dir $OUT  # TP 1 vs 2 (a host with 2+ GPUs)
    python scripts/record_compare_pairs.py --only max-num-seqs    # one pair

The workload is the Compare page's own (dashboard/scenarios.py: PAIR_WORKLOAD: a shared system
prompt, a long prompt arriving mid-run, more requests than a small batch admits, a small KV pool;
for speculative decoding SPEC_PAIR_WORKLOAD: copy and edit prompts, where prompt lookup finds drafts),
driven by the live page's engine loop (dashboard/live_engine.py: drive). Each pair writes
<device>-<pair>-a.sqlite and -b.sqlite and its entry in pairs.json (title, knob, values, what to look
at); the run meta says which side of which pair it is. Needs the default model (`vllm-anatomy download`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# NOTE: one intra-op thread, as the live page's engine process (dashboard/live.py): on a small CPU shared
# with other work, torch's spinning threads made every step several times slower (OMP_NUM_THREADS overrides).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from dashboard.scenarios import NGRAM_K3  # noqa: E402  (after the path and thread setup above)

# name -> (knob, a, b, title, what to look at)
SPEC_PAIR = ("speculative_config", None, NGRAM_K3, "speculative decoding: off vs ngram (K = 3, prompt lookup 2–4)",
             "投机解码省轮次但涨每步时间: fewer steps per output token, each step longer; the acceptance length; "
             "the same greedy text")
CPU_PAIRS = {
    "max-num-seqs": ("max_num_seqs", 2, 8, "batch size: max_num_seqs 2 vs 8",
                     "time falls with fewer, fuller steps; memory and preemptions rise as more requests hold blocks"),
    "chunk-size": ("max_num_batched_tokens", 16, 64, "chunk size: max_num_batched_tokens 16 vs 64",
                   "the long prompt prefills in 4 chunks instead of 1: TTFT, steps, and the decodes beside it"),
    "prefix-caching": ("enable_prefix_caching", False, True, "prefix caching off vs on",
                       "the shared system prompt's blocks: hit tokens, shorter prefills, shared blocks"),
    "spec-decode": SPEC_PAIR,
}
GPU_PAIRS = {
    # NOTE: not the step time: with async scheduling a step's EngineCore.step span lasts until its output
    # is processed, after the next step is scheduled, so the median span grows (2.16 -> 3.95 ms on the
    # H100 pair) while tokens per second (+12 %) and TPOT (-14 %) show the gain. TTFT is the price (7.2 -> 14.9
    # ms): step 1's tokens are read after step 2's eager, fully traced launch (~5 ms of host time) returns.
    "async-scheduling": ("async_scheduling", False, True, "async scheduling off vs on",
                         "output tokens per second and TPOT, where the gain shows: step N+1 is scheduled "
                         "(placeholders standing in for the tokens step N has not sampled yet) and queued while "
                         "the GPU runs step N, so the GPU waits less for the host's Python; and, on the Timeline, "
                         "each step's EngineCore.step span starting before the previous one ends. Not the median "
                         "step time: it grows, as each step's span now also covers the next step's scheduling (§五). "
                         "And the price, TTFT: step N's tokens are read only after step N+1 has been launched, and "
                         "these prefill steps are eager and fully traced (about 5 ms of host time to launch), so the "
                         "median TTFT roughly doubles; a decode step's graph replay takes the host under a "
                         "millisecond"),
    "cuda-graphs": ("enforce_eager", True, False, "CUDA graphs off vs on",
                    "pure-decode steps: one replay instead of ~400 launches from Python"),
    "max-num-seqs": CPU_PAIRS["max-num-seqs"],
    "spec-decode": SPEC_PAIR,
}


def workload_name(w: dict) -> str:
    import dashboard.scenarios as sc
    return next(name for name in ("PAIR_WORKLOAD", "SPEC_PAIR_WORKLOAD") if getattr(sc, name) is w)


def device_tag() -> tuple[str, str]:
    import torch
    if not torch.cuda.is_available():
        return "cpu", "a CPU"
    name = torch.cuda.get_device_name()
    words = [w for w in name.split() if w[0].isalpha() and any(c.isdigit() for c in w)]
    return (words[0] if words else "cuda").lower(), name


def record(spec: dict, trace_dir: str, description: str) -> str:
    """One side: the spec's engine in-process (LLM), driven as the live page drives it."""
    from dashboard.live_engine import drive
    from vllm_anatomy import LLM
    from vllm_anatomy.engine.arg_utils import teaching_attention_backend
    llm = LLM(trace_level="full", trace_dir=trace_dir, attention_backend=teaching_attention_backend(),
              **spec["engine_args"])
    rec = llm.llm_engine.recorder
    rec.set_run_meta("pair", spec["pair"])
    rec.set_run_meta("description", description)
    outputs = drive(llm, spec)
    print({k: v[:40] for k, v in sorted(outputs.items())})
    path = rec.run_path
    llm.llm_engine.shutdown()
    with sqlite3.connect(path) as conn:          # one file to ship: the WAL folded in, compacted
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("VACUUM")
    return path


def main() -> None:
    from dashboard.scenarios import pair_specs, pair_workload
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true", help="the GPU pairs (async scheduling, CUDA graphs, batch size)")
    ap.add_argument("--tp", type=int, default=1, help="record tensor_parallel_size 1 vs N")
    ap.add_argument("--only", default=None, help="one pair by name")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "samples", "compare"))
    args = ap.parse_args()
    tag, device = device_tag()
    if args.gpu and tag == "cpu":
        sys.exit("--gpu needs a CUDA device")
    pairs = dict(GPU_PAIRS if args.gpu else CPU_PAIRS)
    if args.tp > 1:
        pairs = {f"tp-{args.tp}": ("tensor_parallel_size", 1, args.tp, f"tensor parallelism: 1 vs {args.tp} ranks",
                                   "the communication account: 2 all-reduces per layer + 1, every step")}
    if args.only:
        pairs = {args.only: pairs[args.only]}
    os.makedirs(args.out_dir, exist_ok=True)
    manifest_path = os.path.join(args.out_dir, "pairs.json")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        manifest = {"pairs": []}
    for name, (knob, a, b, title, look) in pairs.items():
        full = f"{tag}-{name}"
        spec_a, spec_b = pair_specs(knob, a, b)
        entry = {"name": full, "title": title, "device": device, "knob": knob, "look_at": look,
                 "description": f"{title} on {device}: the Compare page's pair workload (dashboard/scenarios.py: "
                                f"{workload_name(pair_workload(knob))}), greedy, recorded by "
                                f"scripts/record_compare_pairs.py. Look at: {look}."}
        for side, spec, value in (("a", spec_a, a), ("b", spec_b, b)):
            trace_dir = tempfile.mkdtemp(prefix=f"pair_{full}_{side}_")
            path = record(spec, trace_dir, f"Compare sample, run {side.upper()} of “{title}” ({knob} = {value}).")
            file = f"{full}-{side}.sqlite"
            shutil.copyfile(path, os.path.join(args.out_dir, file))
            entry[side] = {"value": value, "file": file}
            print(f"wrote {file} ({os.path.getsize(os.path.join(args.out_dir, file)) / 1e6:.2f} MB)")
        manifest["pairs"] = [p for p in manifest["pairs"] if p["name"] != full] + [entry]
    manifest["pairs"].sort(key=lambda p: p["name"])
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {manifest_path}")


if __name__ == "__main__":
    main()
