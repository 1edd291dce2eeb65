"""Spans of a run as tables for the timeline and the request journey.

Step-tree spans carry no step id of their own: they share the trace of their
root `EngineCore.step`, whose `vllm_anatomy.step_id` names the step. On a CPU
run the device lane shows the host timings of the device work (`_model_forward`,
`compute_logits`, `_sample`), as the Perfetto exporter does; spans recorded with
`vllm_anatomy.lane="device"` go there directly.

On a GPU the device lane has, per step, the phases `GPU.prepare_inputs`,
`GPU.model_forward` (with the CUDA-graph decision), `GPU.compute_logits`,
`GPU.sample`, `GPU.d2h`; on eager steps also one `GPU.layer` per decoder layer and,
at level full, one `GPU.kernel.<name>` per kernel launch (grid, tokens, bytes).
Each gets its row of the device lane (column `device_row`): phases, layers or kernels;
kernels also the layer they ran in (`kernel_layer`). With a draft model (speculative
decoding) the step also has the drafter's phase `GPU.propose_draft_token_ids` after
the target's (phases row), its forwards `GPU.draft_model_forward` (layers row) and
their kernels (kernels row); column `drafter` is true for all of them.
"""
from __future__ import annotations

import sqlite3

import pandas as pd
import streamlit as st

from dashboard.answers.source import worker_ranks
from dashboard.data import RunError
from vllm_anatomy.tracing.reader import TraceStoreError, open_run

DEVICE_WORK = ("GPUModelRunner._model_forward", "GPUModelRunner.compute_logits", "GPUModelRunner._sample")
DEVICE_LANE = "device"
# Containers the timeline does not draw (runs recorded since issue 30): a step's GPU.step holds its
# device phases (drawn one by one), a request's Request span its whole life in the engine.
NOT_DRAWN = frozenset({"GPU.step", "Request"})
# Span attributes kept as columns (None where a span does not have them).
ATTR_COLUMNS = {"vllm_anatomy.cudagraph_mode": "cudagraph_mode", "vllm_anatomy.num_padded_tokens": "num_padded_tokens",
                "vllm_anatomy.cudagraph_reason": "cudagraph_reason", "vllm_anatomy.layer": "layer",
                "vllm_anatomy.grid": "grid", "vllm_anatomy.num_tokens": "num_tokens", "vllm_anatomy.bytes": "bytes",
                "vllm_anatomy.cudagraph_size": "cudagraph_size",
                "vllm_anatomy.num_scheduled_tokens": "num_scheduled_tokens",
                "vllm_anatomy.drafter": "drafter", "vllm_anatomy.draft_forward": "draft_forward",
                "vllm_anatomy.padded_drafter_batch": "padded_drafter_batch"}


def device_row(name: str) -> str:
    """The row of the device lane a device span is drawn on."""
    if name in ("GPU.layer", "GPU.draft_model_forward"):      # (a draft model's forward holds kernels, as a layer)
        return "layers"
    if name.startswith("GPU.kernel."):
        return "kernels"
    return "phases"


def _depths(spans) -> dict[str, int]:
    parent = {s.span_id: s.parent_id for s in spans}
    depth: dict[str, int] = {}
    for s in spans:
        d, p, seen = 0, s.parent_id, 0
        while p in parent and seen < 64:
            d, p, seen = d + 1, parent[p], seen + 1
        depth[s.span_id] = d
    return depth


def _span_rows(spans, host_device: bool, ranks: dict[int, int] | None = None) -> list[dict]:
    """One row per span; its lane is its process, named as the Processes page names it
    (dashboard/processes.py: process_name; "WorkerProc rank 1 · pid 4242" for a rank of a
    tensor-parallel run: `ranks` maps pid -> rank)."""
    from dashboard.processes import process_name
    ranks = ranks or {}
    kinds: dict[str, set[int]] = {}
    for s in spans:
        kinds.setdefault(s.process_kind, set()).add(s.pid)
    step_of = {s.trace_id: s.step_id for s in spans if s.name == "EngineCore.step"}
    depth = _depths(spans)
    # NOTE: with several ranks every rank runs the same device work on its own slice of the
    # model at the same time: the device lane is the output rank's (0), not N overlapping copies.
    device_pids = {p for p, r in ranks.items() if r == 0} if len(ranks) > 1 else None
    rows = []
    for s in spans:
        if s.name in NOT_DRAWN:
            continue
        a = s.attributes
        rank = ranks.get(s.pid) if s.process_kind == "worker" else None
        lane = process_name(s.process_kind, s.pid, kinds, rank)
        base = {"name": s.name, "start_ns": s.start_ns, "end_ns": s.end_ns,
                "step_id": s.step_id if s.step_id is not None else step_of.get(s.trace_id),
                "request_id": s.request_id, "depth": depth[s.span_id],
                "sync_wait_ms": a.get("vllm_anatomy.sync_wait_ms"),
                "lane": lane, "rank": rank, "host_timing": False, "device_row": None,
                **{col: a.get(key) for key, col in ATTR_COLUMNS.items()}}
        if base["grid"] is not None:
            base["grid"] = str(list(base["grid"]))
        on_device_lane = device_pids is None or s.pid in device_pids
        if a.get("vllm_anatomy.lane") == "device":
            if on_device_lane:
                rows.append({**base, "lane": DEVICE_LANE, "depth": 0, "device_row": device_row(s.name)})
            continue
        rows.append(base)
        if host_device and s.name in DEVICE_WORK and on_device_lane:
            rows.append({**base, "lane": DEVICE_LANE, "depth": 0, "host_timing": True, "device_row": "phases"})
    return rows


@st.cache_data(max_entries=16, show_spinner=False)
def span_table(path: str, version: tuple, device: str) -> pd.DataFrame | RunError:
    try:
        with open_run(path) as run:
            spans = run.spans()
            ranks = worker_ranks(run.meta)
    except (TraceStoreError, sqlite3.Error, OSError) as e:
        return RunError(f"{path}: cannot read spans ({e})")
    has_device_spans = any(s.attributes.get("vllm_anatomy.lane") == "device" for s in spans)
    df = pd.DataFrame(_span_rows(spans, host_device=not has_device_spans, ranks=ranks))
    if not df.empty:
        df["dur_ms"] = (df["end_ns"] - df["start_ns"]) / 1e6
        df["kernel_layer"] = kernel_layers(df)
        df["kernel_draft_forward"] = held_by(df, "GPU.draft_model_forward", "draft_forward")
        # The device forward span has the mode and padded size; the reason is on the host
        # span of the same step, the tokens scheduled on its step span.
        host = df[(df["name"] == "GPUModelRunner._model_forward") & df["cudagraph_reason"].notna()]
        reason = dict(zip(host["step_id"], host["cudagraph_reason"]))
        fwd = (df["name"] == "GPU.model_forward") & df["cudagraph_reason"].isna()
        df.loc[fwd, "cudagraph_reason"] = df.loc[fwd, "step_id"].map(reason)
        steps = df[(df["name"] == "EngineCore.step") & df["num_scheduled_tokens"].notna()]
        fwd = df["name"] == "GPU.model_forward"
        df.loc[fwd, "num_scheduled_tokens"] = df.loc[fwd, "step_id"].map(
            dict(zip(steps["step_id"], steps["num_scheduled_tokens"])))
    return df


def kernel_layers(df: pd.DataFrame) -> pd.Series:
    """The decoder layer each GPU.kernel.* span ran in: the GPU.layer span of the same
    step whose interval holds the kernel's start (None outside every layer, e.g.
    compute_slot_mapping, which runs before the forward)."""
    return held_by(df, "GPU.layer", "layer")


def held_by(df: pd.DataFrame, holder: str, column: str) -> pd.Series:
    """For each GPU.kernel.* span, `column` of the `holder` span of the same step whose interval
    holds the kernel's start (its decoder layer, or its draft model forward); None outside them."""
    out = pd.Series([None] * len(df), index=df.index, dtype=object)
    dev = df[df["lane"] == DEVICE_LANE]
    layers = dev[dev["name"] == holder]
    kernels = dev[dev["device_row"] == "kernels"]
    if layers.empty or kernels.empty:
        return out
    for step, ks in kernels.groupby("step_id"):
        ls = layers[layers["step_id"] == step].sort_values("start_ns")
        if ls.empty:
            continue
        starts, ends, idx = ls["start_ns"].to_numpy(), ls["end_ns"].to_numpy(), ls[column].to_numpy()
        pos = starts.searchsorted(ks["start_ns"].to_numpy(), side="right") - 1
        for i, p, t in zip(ks.index, pos, ks["start_ns"].to_numpy()):
            if p >= 0 and t < ends[p]:
                out[i] = int(idx[p])
    return out


def _request_row(s) -> dict:
    a = s.attributes
    ev: dict[str, list[int]] = {}
    for e in s.events:
        ev.setdefault(e["name"], []).append(e["time_ns"])
    first = ev.get("FIRST_TOKEN", [None])[0]
    queued = ev.get("QUEUED", [s.start_ns])[0]
    out_tokens = a.get("gen_ai.usage.output_tokens")
    finished = ev.get("FINISHED", [None])[0]
    decode_ms = (finished - first) / 1e6 if finished and first else None
    return {"request_id": s.request_id or a.get("vllm_anatomy.request_id"),
            "start_ns": s.start_ns, "end_ns": s.end_ns, "events": s.events,
            "input_tokens": a.get("gen_ai.usage.input_tokens"), "output_tokens": out_tokens,
            "max_tokens": a.get("gen_ai.request.max_tokens"),
            "finish_reasons": a.get("gen_ai.response.finish_reasons"),
            "ttft_ms": (first - queued) / 1e6 if first else None,
            "itl_ms": decode_ms / (out_tokens - 1) if decode_ms is not None and out_tokens and out_tokens > 1 else None,
            "e2e_ms": (s.end_ns - s.start_ns) / 1e6,
            "num_preemptions": len(ev.get("PREEMPTED", [])),
            # n > 1: the parent request's id and this child's index (its ParentRequest span holds the children)
            "parent_request_id": a.get("vllm_anatomy.parent_request_id"), "child_index": a.get("vllm_anatomy.child_index")}


@st.cache_data(max_entries=16, show_spinner=False)
def request_table(path: str, version: tuple) -> list[dict] | RunError:
    """One row per finished `llm_request` span (a span is written when it ends)."""
    try:
        with open_run(path) as run:
            reqs = run.requests()
    except (TraceStoreError, sqlite3.Error, OSError) as e:
        return RunError(f"{path}: cannot read request spans ({e})")
    rows = [_request_row(s) for s in reqs]
    return sorted(rows, key=lambda r: (not str(r["request_id"]).isdigit(),
                                       int(r["request_id"]) if str(r["request_id"]).isdigit() else 0,
                                       str(r["request_id"])))


# -- outliers on the timeline -------------------------------------------------------------------
OUTLIER_X = 5.0          # a step this many times the median step is flagged
JIT_X, JIT_MIN_MS = 20.0, 1.0


def step_flags(df: pd.DataFrame) -> dict[int, str]:
    """Steps that are not representative of the run, with why (span_table rows in, step id ->
    reason out): a step over OUTLIER_X times the median step, explained as a Triton JIT compile
    when one of its device spans took JIT_X times that span's median (the first launch of a
    kernel variant compiles it), else as the run's first step (first launches, warm caches),
    an eager forward among graph replays, or just "slow". The timeline opens away from them.
    (Device phases are not compared: an eager forward is legitimately many times a replay.)"""
    steps = df[df["name"] == "EngineCore.step"].dropna(subset=["step_id"])
    if len(steps) < 3:
        return {}
    med = float(steps["dur_ms"].median())
    slow = steps[steps["dur_ms"] > OUTLIER_X * med]
    if slow.empty:
        return {}
    first = int(steps["step_id"].min())
    dev = df[(df["lane"] == DEVICE_LANE) & ~df["host_timing"].astype(bool) & df["step_id"].notna()
             & df["device_row"].isin(["layers", "kernels"])]
    dev_med = dev.groupby("name")["dur_ms"].transform("median") if not dev.empty else None
    fwd = df[(df["name"] == "GPU.model_forward") & df["cudagraph_mode"].notna()]
    mode = dict(zip(fwd["step_id"].astype(int), fwd["cudagraph_mode"]))
    graphs = sum(m in ("FULL", "PIECEWISE") for m in mode.values())
    out = {}
    for step, dur in zip(slow["step_id"].astype(int), slow["dur_ms"]):
        times = f"{dur:.0f} ms, {dur / med:.0f}× the median step"
        jit = None
        if dev_med is not None:
            d = dev[dev["step_id"] == step]
            ratio = d["dur_ms"] / dev_med.loc[d.index]
            hot = d[(ratio > JIT_X) & (d["dur_ms"] > JIT_MIN_MS)]
            if not hot.empty:     # name the kernel, else the layer it ran in
                pick = hot[hot["device_row"] == "kernels"] if (hot["device_row"] == "kernels").any() else hot
                jit = pick.loc[pick["dur_ms"].idxmax()]
        if jit is not None and dev_med is not None:      # (jit is only found against dev_med)
            name = jit["name"].removeprefix("GPU.kernel.")
            if jit["name"] == "GPU.layer" and jit.get("layer") is not None and pd.notna(jit.get("layer")):
                name = f"decoder layer {int(jit['layer'])}"
            out[step] = (f"{times}: likely a Triton JIT compile — the first launch of a kernel variant "
                         f"compiles it ({name} took {jit['dur_ms']:.1f} ms, "
                         f"{jit['dur_ms'] / dev_med.loc[jit.name]:.0f}× its median)")
        elif step == first:
            out[step] = f"{times}: the run's first step (first launches, cold caches)"
        elif mode.get(step) == "NONE" and graphs:
            out[step] = f"{times}: eager forward (a prefill chunk) among CUDA graph replays"
        else:
            out[step] = f"{times}: slow step"
    return out


def representative_window(steps: list[int], flags: dict[int, str], cursor: int | None,
                          size: int = 5) -> tuple[int, int]:
    """`size` consecutive steps: around the cursor, shifted so that no flagged step but the cursor
    itself is in it when possible; with no cursor, the first such window of the run."""
    n = len(steps)
    size = min(size, n)
    starts = range(0, n - size + 1)

    def bad(i: int, keep: int | None) -> int:
        return sum(1 for s in steps[i:i + size] if s in flags and s != keep)
    if cursor in steps:
        c = steps.index(cursor)
        cands = [i for i in starts if i <= c < i + size]
        best = min(cands, key=lambda i: (bad(i, cursor), abs(i + size // 2 - c)))
    else:
        clean = [i for i in starts if bad(i, None) == 0]
        best = clean[0] if clean else 0
    return steps[best], steps[best + size - 1]

