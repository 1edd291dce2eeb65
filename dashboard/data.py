"""Loading a run store for the dashboard, cached and lazy.

Run-level tables (one row per step, spans, requests) are cached by (path, file
version): a live run's version changes at every commit, a finished run's never.
A step's snapshots are cached by (path, step_id) alone: a committed step never
changes. Step tables are read with SQLite's json_extract, so a run of thousands
of steps is summarised without decoding every block list in Python.

Every loader returns plain data; errors come back as RunError (shown by
`dashboard.state.show_error`), never as an exception in the page. Run files are
opened read-only (tracing/store.py: connect_readonly): reading a live or crashed
run never changes its files. A row whose JSON is damaged is skipped and named
(`bad_rows_of(result)`, shown by `dashboard.state.show_bad_rows`); a step whose
own snapshot is damaged gives a RunError naming that row.
"""
from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass

import pandas as pd
import streamlit as st

from vllm_anatomy.tracing.reader import MalformedRowError, TraceStoreError, list_runs, open_run
from vllm_anatomy.tracing.store import connect_readonly


@dataclass
class RunError:
    message: str


class BadRows(list):
    """The rows a loader skipped: "step 12, 'step' snapshot (row id 345): malformed JSON"."""


def bad_rows_of(obj) -> list[str]:
    """The damaged rows a loader's result skipped (a DataFrame's attrs, a dict's "bad_rows")."""
    if isinstance(obj, pd.DataFrame):
        return list(obj.attrs.get("bad_rows", []))
    if isinstance(obj, dict):
        return list(obj.get("bad_rows", []))
    return []


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
    name, bad = os.path.basename(path), []
    try:
        with open_run(path) as run:
            step = run.snapshot(step_id)
            try:
                mr = run.snapshot(step_id, "model_runner")
            except MalformedRowError as e:       # the step can still be shown, without the worker's side
                mr, bad = None, [str(e).split(": ", 1)[-1]]
    except MalformedRowError as e:
        return RunError(f"{name}: step {step_id} cannot be shown: its {str(e).split(': ', 1)[-1]}")
    except (TraceStoreError, sqlite3.Error, OSError, ValueError) as e:
        return RunError(f"{name}: cannot read step {step_id} ({e})")
    if step is None:
        return RunError(f"{name}: step {step_id} is not committed")
    if not isinstance(step, dict):
        return RunError(f"{name}: step {step_id} cannot be shown: its 'step' snapshot is not an object")
    return {"step": step, "mr": mr if isinstance(mr, dict) else {}, "bad_rows": bad}


def _rows(path: str, sql: str, args: tuple = ()) -> list[tuple]:
    conn = connect_readonly(path)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def _guarded_rows(path: str, sql: str, what: str) -> tuple[list[tuple], list[str]]:
    """Rows of `sql` (over `snapshots`, selecting json_extract of `data`), and the damaged rows.

    NOTE: SQLite's json_extract fails the whole query on one malformed document.
    The query runs as written first (the common case costs nothing more); only if
    it fails on bad JSON is it run again over the valid rows, and the others named."""
    try:
        return _rows(path, sql), []
    except sqlite3.OperationalError as e:
        if "JSON" not in str(e):
            raise
    guarded = sql.replace("FROM snapshots WHERE", "FROM snapshots WHERE json_valid(data) AND")
    bad = _rows(path, "SELECT id, step_id, kind FROM snapshots WHERE " + sql.split(" WHERE ", 1)[1].split(
        " ORDER BY")[0] + " AND NOT json_valid(data) ORDER BY id")
    return _rows(path, guarded), [f"step {s}, {k!r} snapshot (row id {i}): malformed JSON, skipped ({what})"
                                  for i, s, k in bad]


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
        rows, bad = _guarded_rows(path, _STEP_SQL, "step table")
        mr, bad_mr = _guarded_rows(path, _MR_SQL, "step table")
        cg, bad_cg = _guarded_rows(path, _CG_SQL, "step table")
    except sqlite3.Error as e:
        return RunError(f"{path}: corrupt run store ({e})")
    bad = BadRows(bad + [b for b in bad_mr if b not in bad_cg] + bad_cg)
    mr_rows, cg_rows = {r[0]: r for r in mr}, {r[0]: r for r in cg}
    out = []
    for step_id, t, rec, usage, finished, events in rows:
        try:
            row = _step_row(step_id, t, _loads(rec) or {}, usage, _loads(finished), _loads(events))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            bad.append(f"step {step_id}, 'step' snapshot: unexpected content ({type(e).__name__}: {e}), skipped")
            continue
        m = mr_rows.get(step_id)
        row["condense_moves"] = (m[2] or 0) if m else 0
        c = cg_rows.get(step_id)
        row["cudagraph_mode"] = c[1] if c else None
        row["cudagraph_padding"] = (c[3] or 0) - (c[2] or 0) if c and c[1] is not None else 0
        out.append(row)
    df = pd.DataFrame(out)
    if not df.empty:
        df["t_s"] = (df["time_ns"] - df["time_ns"].iloc[0]) / 1e9
    df.attrs["bad_rows"] = bad
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
        rows, bad = _guarded_rows(path, _CG_SQL, "CUDA-graph decisions")
    except sqlite3.Error as e:
        return RunError(f"{path}: corrupt run store ({e})")
    df = pd.DataFrame([r for r in rows if r[1] is not None], columns=CG_COLUMNS)
    df.attrs["bad_rows"] = bad
    return df


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
        rows, _ = _guarded_rows(path, _STEP_SQL, "step records")
    except sqlite3.Error as e:
        return RunError(f"{path}: corrupt run store ({e})")
    out = {}
    for r in rows:
        rec = _loads(r[2])
        if isinstance(rec, dict):
            out[r[0]] = {**rec, "finished_req_ids": _loads(r[4]) or [], "time_ns": r[1]}
    return out


@st.cache_data(max_entries=32, show_spinner=False)
def token_index(path: str, version: tuple) -> dict | RunError:
    """Tokens by request and position, and the token each request sampled at each step.

    Prompt tokens come from SchedulerOutput.scheduled_new_reqs; a generated token is
    known once it is fed back as an input (prepare_inputs.input_ids at its position),
    or directly when the runner snapshot has `sampled_token_ids`.
    """
    try:
        new_rows, _ = _guarded_rows(path, "SELECT json_extract(data, '$.scheduler_output.scheduled_new_reqs') "
                                          "FROM snapshots WHERE kind = 'step' ORDER BY step_id", "tokens")
        mr_rows, _ = _guarded_rows(path, _MR_SQL, "tokens")
    except sqlite3.Error as e:
        return RunError(f"{path}: corrupt run store ({e})")
    tokens: dict[str, dict[int, int]] = {}
    for (new,) in new_rows:
        for r in _loads(new) or []:
            tokens.setdefault(r["req_id"], {}).update(enumerate(r["prompt_token_ids"]))
    sampled: dict[int, dict[str, list]] = {}
    for step_id, pi, _, direct in mr_rows:
        pi = _loads(pi) or {}
        if not isinstance(pi, dict):
            continue
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


def startup_marks(path: str, span_names: list[str]) -> dict[str, int]:
    """When the start-up marks of a (live) run happened, in ns since the epoch: "store"
    (the run store was created), each start-up span's end, "first_step" (the first
    step's snapshot). Only what is committed so far; {} when the file cannot be read.
    Not cached: called about once a second while a live engine starts."""
    marks: dict[str, int] = {}
    try:
        conn = connect_readonly(path)
    except sqlite3.Error:
        return marks
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'start_time_ns'").fetchone()
        if row:
            marks["store"] = int(json.loads(row[0]))
        marks_sql = ", ".join("?" * len(span_names))
        for name, end in conn.execute(f"SELECT name, max(end_ns) FROM spans WHERE name IN ({marks_sql}) "
                                      "GROUP BY name", tuple(span_names)):
            marks[name] = end
        row = conn.execute("SELECT time_ns FROM snapshots WHERE kind = 'step' ORDER BY step_id LIMIT 1").fetchone()
        if row:
            marks["first_step"] = row[0]
    except (sqlite3.Error, ValueError, TypeError):
        pass
    finally:
        conn.close()
    return marks
