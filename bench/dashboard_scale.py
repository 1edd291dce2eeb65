"""Can the dashboard open a big run? The GPU throughput workload's shape, recorded on the CPU.

    python bench/dashboard_scale.py [--num-seqs 256] [--min-len 100] [--max-len 1024]
                                    [--store DIR] [--out bench/results/dashboard_scale_cpu.json]

1. Record (once; kept in --store and reused): the throughput workload of
   bench/throughput.py (256 requests, prompt and output lengths uniform in
   [100, 1024], random token ids, seed 0, ignore_eos) through the real engine at
   trace level "full", with the GPU's scheduler defaults (a 16,384-token budget,
   max_num_seqs 1024): ~1,000 steps at batch 256, the run store a learner gets
   from `bench/throughput.py` on a GPU with tracing on. The model is a tiny random
   Llama (2 layers, hidden 64) with SmolLM2's tokenizer and vocabulary, so the CPU
   records it in minutes; what the dashboard reads (steps, requests, blocks, spans,
   snapshots) has the workload's shape whatever the model's width.
2. Time the dashboard on it, headless (streamlit.testing AppTest: the script runs
   and what it draws, not the browser's painting), each step a fresh measurement in
   one session, as a learner clicks: the run list, the first page (the inspector
   opened by a deep link), every page switch, step moves (next, a jump), and the
   process's peak RSS (--think S: S seconds on the first page before the first switch, as a
   learner would look at it; the run's tables are built in the background meanwhile). Targets (issue 15): run list and first page <= 5 s, every page
   switch and step move <= 2 s, memory bounded (no page loads every snapshot).
   Each row also has the process's CPU seconds (all its threads, the dashboard's
   background table builds included): on a shared, busy machine the wall time
   stretches with the load average (printed), the CPU time much less.

Prints a table; writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import sqlite3
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
APP = os.path.join(ROOT, "dashboard", "app.py")
TARGETS = {"run list": 5.0, "first page": 5.0, "page switch": 2.0, "step move": 2.0}


def tiny_model(path: str) -> str:
    """A 2-layer Llama with random weights, SmolLM2's vocabulary and tokenizer."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    import transformers
    from safetensors.torch import save_file

    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    src = str(ensure_default_model())
    os.makedirs(path, exist_ok=True)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0})
    cfg.save_pretrained(path)
    with torch.device("meta"):
        params = dict(transformers.AutoModelForCausalLM.from_config(cfg).named_parameters())
    gen = torch.Generator().manual_seed(0)
    weights = {n: (1 + 0.1 * torch.randn(p.shape, generator=gen)) if p.dim() == 1
               else torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5 for n, p in params.items()}
    save_file({n: w.contiguous() for n, w in weights.items()}, os.path.join(path, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), os.path.join(path, name))
    return path


def record(store_dir: str, num_seqs: int, lo: int, hi: int) -> dict:
    """Record the workload (or reuse the run recorded before with the same shape)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    done = os.path.join(store_dir, "recorded.json")
    if os.path.exists(done):
        with open(done) as f:
            rec = json.load(f)
        if rec.get("shape") == [num_seqs, lo, hi] and os.path.exists(rec["path"]):
            return rec
    from vllm_anatomy import LLM, SamplingParams
    model = tiny_model(os.path.join(store_dir, "tiny-llama"))
    trace_dir = os.path.join(store_dir, "traces")
    shutil.rmtree(trace_dir, ignore_errors=True)
    rng = random.Random(0)
    prompts = [[rng.randint(0, 49151) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]
    outs = [rng.randint(lo, hi) for _ in range(num_seqs)]
    llm = LLM(model, trace_level="full", trace_dir=trace_dir, max_model_len=2 * hi + 16,
              max_num_batched_tokens=16384, max_num_seqs=1024)
    t = time.perf_counter()
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, seed=i) for i, o in enumerate(outs)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    seconds = time.perf_counter() - t
    path = llm.llm_engine.recorder.run_path
    llm.llm_engine.shutdown()
    rec = {"shape": [num_seqs, lo, hi], "path": path, "record_s": round(seconds, 1), **store_shape(path)}
    with open(done, "w") as f:
        json.dump(rec, f, indent=1)
    return rec


def store_shape(path: str) -> dict:
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        snaps = conn.execute("SELECT count(*), sum(length(data)) FROM snapshots").fetchone()
        steps = conn.execute("SELECT count(*) FROM snapshots WHERE kind = 'step'").fetchone()[0]
        spans = conn.execute("SELECT count(*), sum(length(attributes) + length(links) + length(events)) "
                             "FROM spans").fetchone()
    finally:
        conn.close()
    return {"steps": steps, "snapshot_rows": snaps[0], "snapshot_mb": round((snaps[1] or 0) / 2**20, 1),
            "span_rows": spans[0], "span_json_mb": round((spans[1] or 0) / 2**20, 1),
            "file_mb": round(os.path.getsize(path) / 2**20, 1)}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(path: str, rounds: int, think_s: float = 0.0) -> list[dict]:
    """AppTest through the dashboard as a learner would click, in one session per round."""
    from streamlit.testing.v1 import AppTest
    os.environ["VLLM_ANATOMY_TRACE_DIR"] = os.path.dirname(path)
    os.environ["VLLM_ANATOMY_SAMPLES_DIR"] = os.path.join(os.path.dirname(path), "no-samples")
    name = os.path.basename(path)
    rows = []

    def timed(kind: str, what: str, fn):
        c, t = time.process_time(), time.perf_counter()
        at = fn()
        dt, cpu = time.perf_counter() - t, time.process_time() - c
        errors = [e.value for e in at.exception]
        rows.append({"round": r, "kind": kind, "what": what, "seconds": round(dt, 3), "cpu_s": round(cpu, 3),
                     "loadavg_1m": round(os.getloadavg()[0], 1), "rss_mb": round(_rss_mb()), "ok": not errors,
                     "error": errors[0][:300] if errors else None})
        return at

    for r in range(rounds):
        from dashboard import data
        import streamlit as st
        st.cache_data.clear()          # each round from a cold cache (a fresh server)
        at = AppTest.from_file(APP, default_timeout=600)
        timed("run list", "landing page (run list, live form)", at.run)
        at = AppTest.from_file(APP, default_timeout=600)
        at.query_params.update({"run": name, "page": "inspector", "step": "500"})
        timed("first page", "inspector at step 500 by deep link", at.run)
        time.sleep(think_s)    # a learner looking at the first page (the run's tables build meanwhile)
        for page in ("timeline", "journey", "metrics", "lessons", "inspector"):
            at.session_state["goto_page"] = page
            timed("page switch", f"→ {page}", at.run)
        at.session_state["tab"] = "Worker (model runner)"       # the inspector's tabs (bind="query-params")
        timed("page switch", "→ inspector, Worker tab", at.run)
        info = data.run_info(path, data.file_version(path))
        if isinstance(info, data.RunError):      # (an unreadable store: say why, not "not subscriptable")
            raise RuntimeError(f"dashboard_scale: {info.message}")
        steps = info["steps"]
        for what, step in (("next step (501)", 501), ("next step (502)", 502), ("jump to step 900", 900),
                           ("jump to step 10", 10)):
            at.session_state["cursor"] = step if step in steps else steps[-1]
            timed("step move", what, at.run)
        at.session_state["goto_page"] = "timeline"
        timed("page switch", "→ timeline", at.run)
        for what, step in (("timeline: next step (11)", 11), ("timeline: jump to step 700", 700)):
            at.session_state["cursor"] = step if step in steps else steps[-1]
            timed("step move", what, at.run)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--store", default=os.path.join(os.path.expanduser("~"), ".cache", "vllm_anatomy", "bench",
                                                    "dashboard_scale"),
                    help="where the recorded run (~270 MB) and its tiny model are kept and reused")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--record-only", action="store_true")
    ap.add_argument("--think", type=float, default=0.0,
                    help="seconds between the first page and the first page switch (a learner reading it)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "dashboard_scale_cpu.json"))
    args = ap.parse_args()
    os.makedirs(args.store, exist_ok=True)
    rec = record(args.store, args.num_seqs, args.min_len, args.max_len)
    print(f"run store: {rec['path']}\n  {rec['steps']} steps, {rec['snapshot_rows']} snapshot rows "
          f"({rec['snapshot_mb']} MB of JSON), {rec['span_rows']} spans, file {rec['file_mb']} MB"
          + (f", recorded in {rec['record_s']} s" if rec.get("record_s") else ""))
    if args.record_only:
        return
    load0 = os.getloadavg()
    rows = measure(rec["path"], args.rounds, args.think)
    load1 = os.getloadavg()
    print(f"\n{'kind':<12} {'what':<40} {'seconds':>8} {'CPU s':>6} {'target':>7} {'load':>5} {'rss MB':>7}  ok")
    for row in rows:
        target = TARGETS[row["kind"]]
        flag = "" if row["ok"] else f"  ERROR {row['error']}"
        print(f"{row['kind']:<12} {row['what']:<40} {row['seconds']:>8.2f} {row['cpu_s']:>6.2f} {'≤' + str(target):>7} "
              f"{row['loadavg_1m']:>5.1f} {row['rss_mb']:>7}  {'yes' if row['seconds'] <= target and row['ok'] else 'NO'}"
              f"{flag}")
    worst = {k: max((r["seconds"] for r in rows if r["kind"] == k), default=None) for k in TARGETS}
    print("worst: " + ", ".join(f"{k} {v:.2f} s (target {TARGETS[k]} s)" for k, v in worst.items() if v is not None))
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "loadavg_before": load0, "loadavg_after": load1},
           "store": rec, "think_s": args.think, "targets_s": TARGETS, "worst_s": worst, "peak_rss_mb": round(_rss_mb()), "rows": rows,
           "command": "python " + " ".join(sys.argv)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
