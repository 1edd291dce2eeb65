"""Loading a run store for the dashboard, cached and lazy.

Run-level tables (one row per step, spans, requests) are cached by (path, file
version): a live run's version changes at every commit, a finished run's never.
A step's snapshots are cached by (path, step_id) alone: a committed step never
changes. Step tables are read with SQLite's json_extract, so a run of thousands
of steps is summarised without decoding every block list in Python.

Every loader returns plain data; errors come back as RunError (shown by
`dashboard.state.show_error`), never as an exception in the page.
"""
from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass

import pandas as pd
import streamlit as st

from vllm_anatomy.tracing.reader import TraceStoreError, list_runs, open_run
from vllm_anatomy.tracing.store import connect


@dataclass
class RunError:
    message: str


def file_version(path: str) -> tuple:
    """Changes whenever a writer commits (WAL: the -wal file grows before the main file does)."""
    parts = []
    for p in (path, path + "-wal"):
        try:
            s = os.stat(p)
            parts += [s.st_mtime_ns, s.st_size]
        except OSError:
            parts += [0, 0]
    return tuple(parts)


@st.cache_data(ttl=2, show_spinner=False)
def runs_in(trace_dir: str) -> list[dict]:
    if not os.path.isdir(trace_dir):
        return []
    return [{k: r.get(k) for k in ("path", "run_id", "model", "device", "start_time_ns",
                                   "end_time_ns", "trace_level", "description", "error")} for r in list_runs(trace_dir)]


@st.cache_data(max_entries=64, show_spinner=False)
def run_info(path: str, version: tuple) -> dict | RunError:
    """meta + committed step ids, or why the file cannot be shown."""
    try:
        with open_run(path) as run:
            meta, steps = run.meta, run.steps()
    except TraceStoreError as e:
        return RunError(str(e))
    except (sqlite3.Error, OSError, ValueError) as e:
        return RunError(f"{path}: unreadable run store ({e})")
    if meta.get("trace_level") != "full":
        return RunError(f"{path}: recorded at trace level {meta.get('trace_level')!r}; the dashboard "
                        "needs per-step snapshots (trace_level=\"full\")")
    return {"meta": meta, "steps": steps}


@st.cache_data(max_entries=512, show_spinner=False)
def step_data(path: str, step_id: int) -> dict | RunError:
    """The "step" and "model_runner" snapshots of one committed step."""
    try:
        with open_run(path) as run:
            step, mr = run.snapshot(step_id), run.snapshot(step_id, "model_runner")
    except (TraceStoreError, sqlite3.Error, OSError, ValueError) as e:
        return RunError(f"{path}: cannot read step {step_id} ({e})")
    if step is None:
        return RunError(f"{path}: step {step_id} is not committed")
    return {"step": step, "mr": mr or {}}


def _rows(path: str, sql: str) -> list[tuple]:
    conn = connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


_STEP_SQL = """SELECT step_id, time_ns, json_extract(data, '$.scheduler.step_record'),
  json_extract(data, '$.scheduler.kv_cache.usage'), json_extract(data, '$.scheduler_output.finished_req_ids'),
  json_extract(data, '$.block_pool_events') FROM snapshots WHERE kind = 'step' ORDER BY step_id"""
_MR_SQL = """SELECT step_id, json_extract(data, '$.prepare_inputs'),
  json_array_length(data, '$.input_batch.condense_moves'), json_extract(data, '$.sampled_token_ids')
  FROM snapshots WHERE kind = 'model_runner' ORDER BY step_id"""


def _loads(text):
    return json.loads(text) if text else None


def _step_row(step_id, time_ns, rec, usage, finished, events) -> dict:
    sched = rec.get("scheduled", [])
    kinds = {s["kind"] for s in sched}
    hits = rec.get("prefix_hits", [])
    return {
        "step": step_id, "time_ns": time_ns,
        "tokens": sum(s["num_tokens"] for s in sched),
        "prefill_tokens": sum(s["num_tokens"] for s in sched if s["kind"] != "decode"),
        "decode_tokens": sum(s["num_tokens"] for s in sched if s["kind"] == "decode"),
        "num_scheduled": len(sched), "running": rec.get("num_running", 0), "waiting": rec.get("num_waiting", 0),
        "kv_usage": usage or 0.0, "preempted": len(rec.get("preempted_req_ids", [])),
        "hit_tokens": sum(h["num_hit_tokens"] for h in hits),
        "query_tokens": sum(h["num_query_tokens"] for h in hits),
        "finished": len(finished or []), "stop_reason": rec.get("admission_stop_reason"),
        "evictions": sum(len(e["block_ids"]) for e in events or [] if e["kind"] == "evict"),
        "mixed": "decode" in kinds and bool(kinds - {"decode"}),
        "chunked": "prefill_chunk" in kinds, "resumed": "resumed" in kinds,
        "budget": rec.get("token_budget_start", 0),
    }


@st.cache_data(max_entries=32, show_spinner=False)
def step_table(path: str, version: tuple) -> pd.DataFrame | RunError:
    """One row per committed step: what the metrics, lessons and journey pages need."""
    try:
        rows = _rows(path, _STEP_SQL)
        mr_rows = {r[0]: r for r in _rows(path, _MR_SQL)}
        cg_rows = {r[0]: r for r in _rows(path, _CG_SQL)}
    except sqlite3.Error as e:
        return RunError(f"{path}: corrupt run store ({e})")
    out = []
    for step_id, t, rec, usage, finished, events in rows:
        row = _step_row(step_id, t, _loads(rec) or {}, usage, _loads(finished), _loads(events))
        mr = mr_rows.get(step_id)
        row["condense_moves"] = (mr[2] or 0) if mr else 0
        cg = cg_rows.get(step_id)
        row["cudagraph_mode"] = cg[1] if cg else None
        row["cudagraph_padding"] = (cg[3] or 0) - (cg[2] or 0) if cg and cg[1] is not None else 0
        out.append(row)
    df = pd.DataFrame(out)
    if not df.empty:
        df["t_s"] = (df["time_ns"] - df["time_ns"].iloc[0]) / 1e9
    return df


_CG_SQL = """SELECT step_id, json_extract(data, '$.prepare_inputs.cudagraph.mode'),
  json_extract(data, '$.prepare_inputs.cudagraph.num_tokens'),
  json_extract(data, '$.prepare_inputs.cudagraph.num_padded_tokens'),
  json_extract(data, '$.prepare_inputs.cudagraph.reason')
  FROM snapshots WHERE kind = 'model_runner' ORDER BY step_id"""
CG_COLUMNS = ["step", "mode", "num_tokens", "num_padded_tokens", "reason"]


@st.cache_data(max_entries=32, show_spinner=False)
def cudagraph_steps(path: str, version: tuple) -> pd.DataFrame | RunError:
    """The CUDA-graph decision of every step (CudagraphDispatcher.dispatch, recorded in
    prepare_inputs.cudagraph); empty for runs recorded before it was traced."""
    try:
        rows = _rows(path, _CG_SQL)
    except sqlite3.Error as e:
        return RunError(f"{path}: corrupt run store ({e})")
    return pd.DataFrame([r for r in rows if r[1] is not None], columns=CG_COLUMNS)


def first_graph_step(path: str) -> int | None:
    """The first step that replayed a CUDA graph (padded, if any step was), else None."""
    cg = cudagraph_steps(path, file_version(path))
    if isinstance(cg, RunError) or cg.empty:
        return None
    full = cg[cg["mode"] == "FULL"]
    padded = full[full["num_padded_tokens"] > full["num_tokens"]]
    pick = padded if not padded.empty else full
    return int(pick["step"].iloc[0]) if not pick.empty else None


@st.cache_data(max_entries=32, show_spinner=False)
def step_records(path: str, version: tuple) -> dict[int, dict] | RunError:
    """step id -> SchedulerStepRecord + finished ids (for the request journey)."""
    try:
        rows = _rows(path, _STEP_SQL)
    except sqlite3.Error as e:
        return RunError(f"{path}: corrupt run store ({e})")
    return {r[0]: {**(_loads(r[2]) or {}), "finished_req_ids": _loads(r[4]) or [], "time_ns": r[1]}
            for r in rows}


@st.cache_data(max_entries=32, show_spinner=False)
def token_index(path: str, version: tuple) -> dict | RunError:
    """Tokens by request and position, and the token each request sampled at each step.

    Prompt tokens come from SchedulerOutput.scheduled_new_reqs; a generated token is
    known once it is fed back as an input (prepare_inputs.input_ids at its position),
    or directly when the runner snapshot has `sampled_token_ids`.
    """
    try:
        new_rows = _rows(path, "SELECT json_extract(data, '$.scheduler_output.scheduled_new_reqs') "
                               "FROM snapshots WHERE kind = 'step'")
        mr_rows = _rows(path, _MR_SQL)
    except sqlite3.Error as e:
        return RunError(f"{path}: corrupt run store ({e})")
    tokens: dict[str, dict[int, int]] = {}
    for (new,) in new_rows:
        for r in _loads(new) or []:
            tokens.setdefault(r["req_id"], {}).update(enumerate(r["prompt_token_ids"]))
    sampled: dict[int, dict[str, list]] = {}
    for step_id, pi, _, direct in mr_rows:
        pi = _loads(pi) or {}
        req_ids = pi.get("req_ids", [])
        for row, pos, tok in zip(pi.get("req_indices", []), pi.get("positions", []), pi.get("input_ids", [])):
            tokens.setdefault(req_ids[row], {})[pos] = tok
        discard = set(pi.get("discard_request_indices", []))
        direct = _loads(direct)
        sampled[step_id] = {}
        for i, (req, seq_len) in enumerate(zip(req_ids, pi.get("seq_lens", []))):
            if i not in discard:
                sampled[step_id][req] = [seq_len, direct[i][0] if direct and direct[i] else None]
    for step in sampled.values():
        for req, entry in step.items():
            if entry[1] is None:
                entry[1] = tokens.get(req, {}).get(entry[0])
    return {"tokens": tokens, "sampled": sampled}


@st.cache_resource(show_spinner=False)
def tokenizer_for(model_dir: str):
    """The run's tokenizer (tokenizer.json next to the weights), or None."""
    path = os.path.join(model_dir or "", "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


def decode(meta: dict, ids: list[int]) -> str | None:
    tok = tokenizer_for(meta.get("model", ""))
    return tok.decode(ids, skip_special_tokens=False) if tok is not None else None
