"""Record the sample runs that ship in samples/, for learners without a GPU.

    python scripts/record_sample_run.py [--processes 1|3] [--out samples/h100-smollm2-full.sqlite]
    python scripts/record_sample_run.py --tp 3          # on a CPU too: samples/cpu-smollm2-tp3-full.sqlite

Needs the default model (`vllm-anatomy download`), and a CUDA device unless
--tp is above 1. It runs the default model (SmolLM2-135M-Instruct, bf16 on a
GPU) at trace level `full` with CUDA graphs on, on a small, deliberately
tight engine so that one short run shows everything the dashboard can explain:
- a shared system prompt (chat template): prefix-cache hits;
- a long prompt with max_num_batched_tokens=128: chunked prefill, mixed steps;
- 24 KV blocks (16 tokens each) for 8 requests: preemption (recompute) and resumption;
- requests that finish early, whose freed blocks later requests reuse;
- the GPU's default graphs (FULL_AND_PIECEWISE), capped at 64 tokens so that all three
  ways a forward runs appear: pure-decode steps replayed as one full CUDA graph (padded
  to a capture size), mixed steps of at most 64 tokens as graph pieces around eager
  attention, and larger prefill steps eager, with per-layer and per-kernel device spans.
`--processes 1` (the default): the offline LLM in one process, with the GPU's
defaults (async scheduling on, warm-up before the first request).
`--processes 3`: as `vllm-anatomy serve` runs it — the API server, EngineCoreProc
in its own process and a worker behind the shared-memory ring
(`--distributed-executor-backend mp`) — the prompts sent over HTTP.
`--tp N`: the same prompts on N tensor-parallel ranks (`--processes 1` only;
the default model's 9 heads and 3 KV heads allow N = 3): every rank a worker
process with its lane, its all-reduces (after o_proj and down_proj, and the
embedding's) and the logits' all-gather, each a span of its own, and the
request's communication account. On a CPU the ranks talk over gloo and the
answers are shorter (32 tokens: every rank's collectives are spans, so the
store grows with ranks x steps x layers). The file is named after the
device (`h200-` on an H200, `cpu-` on a CPU).
It fails unless the run really contains each of these, and unless its traces
have the shape Jaeger and Perfetto show without complaint (tracing/trace_check.py:
no clock-skew warning, every span within its parent, one trace per request, no
trace outside a request, a step or the start-up, no Perfetto overlap). The run
store is checkpointed into one SQLite file.
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


# NOTE: max_cudagraph_capture_size 64 < max_num_batched_tokens 128: a step of more than 64
# tokens has no piecewise graph and runs eager, so the sample keeps eager steps (the only
# ones whose layers and kernels the device lane can time one by one). On a CPU: ignored.
ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, num_gpu_blocks_override=24,
                   cudagraph_mode="FULL_AND_PIECEWISE", max_cudagraph_capture_size=64)
GRAPHS = ("CUDA graphs on (FULL_AND_PIECEWISE, captured up to 64 tokens"
          ": larger steps run eager, their kernels timed one by one), ")
DESCRIPTION = ("Shipped sample: SmolLM2-135M-Instruct on {device}, trace level full, {graphs}"
               "{how} (scripts/record_sample_run.py {flags}).")


def device_tag() -> tuple[str, str]:
    """(file-name prefix, words) of the device this records on: ("h200", "an NVIDIA H200")."""
    import torch
    if not torch.cuda.is_available():
        return "cpu", "a CPU"
    name = torch.cuda.get_device_name()                    # "NVIDIA H200"
    return name.split()[-1].lower(), f"an {name}"


def record_one_process(trace_dir: str, tp: int = 1) -> str:
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(trace_level="full", trace_dir=trace_dir, tensor_parallel_size=tp, **ENGINE_ARGS)
    engine = llm.llm_engine
    tag, device_words = device_tag()
    on_gpu = tag != "cpu"
    how = ("one process (the offline LLM), async scheduling as on any GPU" if tp == 1 else
           f"the offline LLM with {tp} tensor-parallel ranks, each a worker process "
           f"({'NCCL' if on_gpu else 'gloo'})")
    engine.recorder.set_run_meta("description", DESCRIPTION.format(
        device=device_words, graphs=GRAPHS if on_gpu else "", how=how,
        flags="--processes 1" if tp == 1 else f"--tp {tp}"))
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                     for q in QUESTIONS + [LONG]]
    # Short answers first: they finish while the long prompt still prefills, and their freed
    # blocks go to the requests after them.
    longest = 64 if on_gpu else 32
    params = [SamplingParams(temperature=0, max_tokens=8 if i < 2 else longest) for i in range(len(conversations))]
    outs = llm.chat(conversations, params, use_tqdm=False)
    for o in outs:
        print(repr(o.outputs[0].text[:80]))
    path = engine.recorder.run_path
    engine.shutdown()
    return path


def record_three_processes(trace_dir: str) -> str:
    """The dashboard's own three-process launcher (dashboard/live_engine.py drive_http), headless."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dashboard.live_engine import drive_http
    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.tracing.factory import make_recorder
    config = EngineArgs(trace_level="full", trace_dir=trace_dir, distributed_executor_backend="mp",
                        **ENGINE_ARGS).create_engine_config()
    recorder = make_recorder(config, "frontend")
    recorder.set_run_meta("description", DESCRIPTION.format(
        device=device_tag()[1], graphs=GRAPHS,
        how="three processes (API server, EngineCoreProc, a worker behind the shared-memory ring)",
        flags="--processes 3"))
    prompts = [{"text": q, "system": SYSTEM, "arrive_step": 2 * i} for i, q in enumerate(QUESTIONS)]
    prompts.append({"text": LONG, "system": SYSTEM, "arrive_step": 3})
    outputs = drive_http(config, recorder, {"prompts": prompts, "max_tokens": 64, "ignore_eos": False})
    for i in sorted(outputs, key=int):
        print(repr(outputs[i][:80]))
    path = recorder.run_path
    recorder.shutdown()
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, choices=(1, 3), default=1)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (with --processes 1)")
    ap.add_argument("--out", default=None, help="default: samples/h100-smollm2-full.sqlite (1), "
                                                "samples/h100-smollm2-full-3proc.sqlite (3), "
                                                "samples/<device>-smollm2-tp<N>-full.sqlite (--tp N)")
    args = ap.parse_args()
    if args.tp > 1 and args.processes != 1:
        sys.exit("--tp records the offline LLM (--processes 1)")
    tag = device_tag()[0]
    if tag == "cpu" and args.tp == 1:
        sys.exit("record_sample_run.py needs a CUDA device (a CPU records only the --tp sample)")
    out = args.out or (f"samples/{tag}-smollm2-tp{args.tp}-full.sqlite" if args.tp > 1 else
                       f"samples/{tag}-smollm2-full.sqlite" if args.processes == 1 else
                       f"samples/{tag}-smollm2-full-3proc.sqlite")
    trace_dir = tempfile.mkdtemp(prefix="sample_run_")
    if args.processes == 1:
        path = record_one_process(trace_dir, args.tp)
    else:
        path = record_three_processes(trace_dir)
    checks = check(path, args.processes, args.tp, on_gpu=tag != "cpu")
    print(checks)
    if not all(checks.values()):
        sys.exit(f"the run lacks something it must show: {checks}")
    with sqlite3.connect(path) as conn:          # fold the WAL into the file: one file to ship
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("VACUUM")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    shutil.copyfile(path, out)
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB)")


def check(path: str, processes: int, tp: int = 1, on_gpu: bool = True) -> dict:
    """What the run must show, read back from its run store alone."""
    from vllm_anatomy.tracing.reader import open_run
    from vllm_anatomy.tracing.trace_check import check_run
    with open_run(path) as run:
        meta = run.meta
        spans = run.spans()
        shape = check_run(run)
        print({k: v for k, v in shape.row().items()}, *shape.examples, sep="\n  ")
        records = [run.snapshot(i)["scheduler"]["step_record"] for i in run.steps()]
        events = [e for i in run.steps() for e in (run.snapshot(i).get("block_pool_events") or [])]
    forwards = [s for s in spans if s.name == "GPUModelRunner._model_forward"]
    modes = {s.attributes.get("vllm_anatomy.cudagraph_mode") for s in forwards}
    finished_then_reused = _freed_by_a_finish_then_reused(records, events)
    out = {"preemption": any(r["preempted_req_ids"] for r in records),
           "prefix_hit": any(h["num_hit_tokens"] for r in records for h in r["prefix_hits"]),
           "chunked_prefill": any(x["kind"] == "prefill_chunk" for r in records for x in r["scheduled"]),
           "finish_then_reuse": finished_then_reused,
           "eager_step": "NONE" in modes,
           "processes": len({s.pid for s in spans}) >= processes,
           "trace_shape": not any((shape.jaeger_warnings, shape.strict_violations, shape.missing_parents,
                                   shape.single_span_traces, shape.other_traces, shape.split_requests,
                                   shape.perfetto_overlaps, shape.perfetto_unbound_flows))}
    if on_gpu:
        out |= {"graph_replay": "FULL" in modes,
                "piecewise_step": "PIECEWISE" in modes,
                "kernel_spans": any(s.name.startswith("GPU.kernel.") for s in spans),
                "layer_spans": any(s.name == "GPU.layer" for s in spans)}
    if tp > 1:
        # Every rank: its own worker process, and all-reduces of its own on every step it ran.
        rank_pids = [r["pid"] for r in meta.get("ranks") or []]
        reduces = {s.pid for s in spans if s.name == "GroupCoordinator.all_reduce"}
        out |= {"ranks": meta.get("tensor_parallel_size") == tp and len(set(rank_pids)) == tp,
                "all_reduce_every_rank": len(rank_pids) == tp and reduces >= set(rank_pids)}
    return out


def _freed_by_a_finish_then_reused(records: list[dict], events: list[dict]) -> bool:
    """Some block freed when its request finished is later allocated to another request."""
    preempted = {rid for r in records for rid in r["preempted_req_ids"]}
    freed_by: dict[int, str] = {}
    for e in events:
        req = e.get("request_id")
        if e["kind"] == "free" and req and req not in preempted:
            freed_by.update({b: req for b in e["block_ids"]})
        elif e["kind"] == "allocate" and req and any(freed_by.get(b) not in (None, req) for b in e["block_ids"]):
            return True
    return False


if __name__ == "__main__":
    main()
