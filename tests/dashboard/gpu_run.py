"""A GPU-shaped run store made from a CPU-recorded one, for the dashboard tests.

There is no GPU on the test machine, so the tests take the real CPU run of the
session (tests/dashboard/conftest.py: recorded_run) and make it look like what
the engine writes on a GPU with CUDA graphs on (docs/trace-format.md):

- meta: device "cuda", compilation_config FULL_DECODE_ONLY with vLLM's default
  capture sizes;
- model_runner snapshots: prepare_inputs.cudagraph is what the real
  CudagraphDispatcher decides for each step's batch (pure decodes padded to a
  captured size replay a graph; anything with a prefill chunk runs eager);
- the host span GPUModelRunner._model_forward carries that decision;
- device-lane spans per step (written with RunStore.write_spans): the five
  phases back to back, and on eager steps one GPU.layer per decoder layer with
  GPU.kernel.reshape_and_cache and GPU.kernel.unified_attention inside it, plus
  GPU.kernel.compute_slot_mapping in prepare_inputs; start-up spans
  GPUModelRunner.warm_up and GPUModelRunner.capture_model > CUDAGraph.capture.

Device timings are invented, proportional to the host forward of each step (so the
device lane lines up with the host lanes); everything else is the real run.
"""
from __future__ import annotations

import json
import sqlite3
import uuid

from vllm_anatomy.config import CompilationConfig, default_capture_sizes
from vllm_anatomy.tracing.store import RunStore, to_json
from vllm_anatomy.worker.cudagraph import CudagraphDispatcher

NUM_LAYERS = 30          # SmolLM2-135M
KV_BYTES_PER_TOKEN = 3 * 64 * 2   # 3 KV heads × head_dim 64 × bf16, for K (same again for V)
US = 1000                # ns per µs


def copy_run(src: str, dst: str) -> None:
    """A consistent copy of a run store (SQLite's backup API: safe while WAL is in use)."""
    s, d = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        s.backup(d)
    finally:
        s.close()
        d.close()


def _hex(n: int) -> str:
    return uuid.uuid4().hex[:n] if n <= 32 else uuid.uuid4().hex


def make_gpu_like_run(src: str, dst: str, num_layers: int = NUM_LAYERS) -> dict:
    """Write the GPU-shaped copy of `src` to `dst`; return {step: decision dict}."""
    copy_run(src, dst)
    sizes = default_capture_sizes(512)
    cc = CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=sizes,
                           max_cudagraph_capture_size=sizes[-1])
    dispatcher = CudagraphDispatcher(cc)
    conn = sqlite3.connect(dst)
    conn.execute("PRAGMA journal_mode=DELETE")
    meta = {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta")}
    config = meta["config"]
    config["compilation_config"] = {"cudagraph_mode": cc.cudagraph_mode, "cudagraph_capture_sizes": sizes,
                                    "max_cudagraph_capture_size": sizes[-1]}
    config["model_config"]["device"] = "cuda"
    for key, value in (("device", "cuda"), ("config", config)):
        conn.execute("UPDATE meta SET value = ? WHERE key = ?", (to_json(value), key))

    decisions: dict[int, dict] = {}
    pis: dict[int, dict] = {}
    mr_rows = conn.execute("SELECT id, step_id, data FROM snapshots WHERE kind = 'model_runner'").fetchall()
    for row_id, step_id, text in mr_rows:
        mr = json.loads(text)
        pi = mr.get("prepare_inputs")
        if not pi:
            continue
        n = pi["num_scheduled_tokens"]
        decision = dispatcher.decide(sum(n), len(n), max(n)).to_dict()
        pi["cudagraph"] = decisions[step_id] = decision
        pis[step_id] = pi
        conn.execute("UPDATE snapshots SET data = ? WHERE id = ?", (to_json(mr), row_id))

    step_trace = dict(conn.execute("SELECT trace_id, step_id FROM spans WHERE name = 'EngineCore.step'").fetchall())
    host = {}
    for trace_id, span_id, name, start, end, attrs, service, kind, pid in conn.execute(
            "SELECT trace_id, span_id, name, start_ns, end_ns, attributes, service, process_kind, pid FROM spans "
            "WHERE name IN ('GPUModelRunner._prepare_inputs', 'GPUModelRunner._model_forward', "
            "'Worker.compile_or_warm_up_model')").fetchall():
        step = step_trace.get(trace_id)
        host[(name, step)] = (trace_id, span_id, start, end, json.loads(attrs), service, kind, pid)
        if name == "GPUModelRunner._model_forward" and step in decisions:
            d = decisions[step]
            a = json.loads(attrs)
            a.update({"vllm_anatomy.cudagraph_mode": d["mode"], "vllm_anatomy.cudagraph_reason": d["reason"],
                      "vllm_anatomy.num_padded_tokens": d["num_padded_tokens"]})
            conn.execute("UPDATE spans SET attributes = ? WHERE trace_id = ? AND span_id = ?",
                         (to_json(a), trace_id, span_id))
    conn.commit()
    conn.close()

    rows: list[tuple] = []

    def span(name, start, end, step, trace_id, parent, where, **attrs):
        span_id = _hex(16)
        a = {"vllm_anatomy.step_id": step, **attrs} if step is not None else attrs
        rows.append((trace_id, span_id, parent, name, "internal", int(start), int(end), to_json(a), "[]", "[]",
                     "UNSET", where[0], where[1], where[2], step, None))
        return span_id

    for step, d in sorted(decisions.items()):
        _, _, prep_start, _, _, service, kind, pid = host[("GPUModelRunner._prepare_inputs", step)]
        _, _, f0, f1, *_ = host[("GPUModelRunner._model_forward", step)]
        where = (service, kind, pid)
        pi = pis[step]
        trace_id, num_reqs, tokens = _hex(32), len(pi["req_ids"]), d["num_tokens"]
        dev = {"vllm_anatomy.lane": "device", "vllm_anatomy.timing": "cuda_event"}
        # Proportional to the host forward, so the device lane lines up with the host lanes.
        fwd = max(f1 - f0, num_layers * 100 * US)
        t, prep = prep_start + fwd // 200, fwd // 50
        span("GPU.prepare_inputs", t, t + prep, step, trace_id, None, where, **dev)
        if d["mode"] == "NONE":
            span("GPU.kernel.compute_slot_mapping", t + prep // 2, t + prep // 2 + prep // 8, step, trace_id, None,
                 where, **dev, **{"vllm_anatomy.grid": [num_reqs + 1], "vllm_anatomy.num_tokens": tokens,
                                  "vllm_anatomy.bytes": tokens * 20 + num_reqs * 8})
        t += prep
        fwd_start = t
        if d["mode"] == "FULL":
            t += fwd * 2 // 5            # a replay: no launch gaps
        else:
            kv_read = sum(pi["seq_lens"]) * 2 * KV_BYTES_PER_TOKEN
            layer_ns = fwd // num_layers
            for layer in range(num_layers):
                l0 = t
                span("GPU.layer", l0, l0 + layer_ns, step, trace_id, None, where, **dev,
                     **{"vllm_anatomy.layer": layer})
                k0 = l0 + layer_ns // 5
                span("GPU.kernel.reshape_and_cache", k0, k0 + layer_ns // 20, step, trace_id, None, where, **dev,
                     **{"vllm_anatomy.grid": [tokens, 3], "vllm_anatomy.num_tokens": tokens,
                        "vllm_anatomy.bytes": 4 * tokens * KV_BYTES_PER_TOKEN // 2 + 8 * tokens})
                k1 = l0 + layer_ns * 3 // 10
                span("GPU.kernel.unified_attention", k1, k1 + layer_ns // 5, step, trace_id, None, where,
                     **dev, **{"vllm_anatomy.grid": [num_reqs, 3], "vllm_anatomy.num_tokens": tokens,
                               "vllm_anatomy.bytes": kv_read + tokens * 576 * 2 * 2})
                t = l0 + layer_ns
        span("GPU.model_forward", fwd_start, t, step, trace_id, None, where, **dev,
             **{"vllm_anatomy.cudagraph_mode": d["mode"], "vllm_anatomy.num_padded_tokens": d["num_padded_tokens"]})
        for phase, share in (("compute_logits", 10), ("sample", 20), ("d2h", 100)):
            span(f"GPU.{phase}", t, t + fwd // share, step, trace_id, None, where, **dev)
            t += fwd // share

    # Start-up: warm-up, then one capture per size (largest first), inside compile_or_warm_up_model.
    trace_id, parent, start, end, _, service, kind, pid = host[("Worker.compile_or_warm_up_model", None)]
    where = (service, kind, pid)
    third = max(3, (end - start) // 3)
    span("GPUModelRunner.warm_up", start, start + third, None, trace_id, parent, where)
    cap = span("GPUModelRunner.capture_model", start + third, end, None, trace_id, parent, where,
               **{"vllm_anatomy.cudagraph_mode": cc.cudagraph_mode, "vllm_anatomy.num_capture_sizes": len(sizes)})
    each = max(1, (end - start - third) // len(sizes))
    for i, size in enumerate(sorted(sizes, reverse=True)):
        s0 = start + third + i * each
        span("CUDAGraph.capture", s0, s0 + each, None, trace_id, cap, where, **{"vllm_anatomy.cudagraph_size": size})

    store = RunStore.attach(dst)
    try:
        store.write_spans(rows)
    finally:
        store.close()
    return decisions


def pick_steps(path: str) -> dict:
    """Steps worth showing in a GPU run: the first graph replay (padded if any is) and an
    eager step with layer spans (the second, if there are two); plus every step's decision."""
    from vllm_anatomy.tracing.reader import open_run
    with open_run(path) as run:
        # (a snapshot or span outside any step has no step_id: it is no step to show)
        decisions = {s.step_id: s.data["prepare_inputs"]["cudagraph"] for s in run.snapshots("model_runner")
                     if s.step_id is not None and (s.data.get("prepare_inputs") or {}).get("cudagraph")}
        layer_steps = sorted({s.step_id for s in run.spans("GPU.layer") if s.step_id is not None})
    full = [k for k, d in sorted(decisions.items()) if d["mode"] == "FULL"]
    padded = [k for k in full if decisions[k]["num_padded_tokens"] > decisions[k]["num_tokens"]]
    eager = [k for k in layer_steps if decisions.get(k, {}).get("mode") == "NONE"]
    # NOTE: not the run's first eager step if there is another: its first kernel launches
    # may include a JIT compile, which is not what a typical eager step looks like.
    eager_step = next(iter(eager[1:] or eager), None)
    # A step for the timeline: an eager step among graph replays, away from the run's start.
    later = [k for k in eager if decisions and k > min(decisions) + 3]
    return {"decisions": decisions, "graph_step": next(iter(padded or full), None), "eager_step": eager_step,
            "timeline_step": next(iter(later), eager_step)}
