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

import msgspec
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


def _rows(path: str, sql: str, args: tuple = (), valid_only: bool = False) -> list[tuple]:
    """Rows of `sql` on a read-only connection; valid_only: as if `snapshots` held only the rows
    whose JSON parses (a temporary view of that name shadows the table for this connection)."""
    conn = connect_readonly(path)
    try:
        if valid_only:
            conn.execute("CREATE TEMP VIEW snapshots AS SELECT * FROM main.snapshots WHERE json_valid(data)")
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def _guarded_rows(path: str, sql: str, what: str, args: tuple = ()) -> tuple[list[tuple], list[str]]:
    """Rows of `sql` (any query over `snapshots` using SQLite's JSON functions), and the
    damaged rows it had to leave out.

    NOTE: SQLite's json_extract fails the whole query on one malformed document.
    The query runs as written first (the common case costs nothing more); only if
    it fails on bad JSON is it run again over the valid rows, and the others named."""
    try:
        return _rows(path, sql, args), []
    except sqlite3.OperationalError as e:
        if "JSON" not in str(e):
            raise
    bad = _rows(path, "SELECT id, step_id, kind FROM snapshots WHERE NOT json_valid(data) ORDER BY id")
    return _rows(path, sql, args, valid_only=True), [
        f"step {s}, {k!r} snapshot (row id {i}): malformed JSON, skipped ({what})" for i, s, k in bad]


_decode = msgspec.json.Decoder().decode


def _loads(text):
    return _decode(text) if text else None


# -- one pass over each snapshot kind -------------------------------------------------------------
# NOTE: a 1,000-step run at batch 256 holds ~240 MB of snapshot JSON. Every per-run
# table below comes from two passes (one per snapshot kind) that let SQLite pick
# the few fields needed (json_extract runs in C; the Python side decodes ~7 %
# of the bytes). The passes are kept per (run, version), shared by every session
# and page, read-only (st.cache_resource: no copy per call); at most a few runs at
# once, so memory stays bounded by the summaries, never every snapshot.
_STEP_SCAN_SQL = """SELECT step_id, time_ns, json_extract(data, '$.scheduler.step_record'),
  json_extract(data, '$.scheduler.kv_cache.usage'), json_extract(data, '$.scheduler_output.finished_req_ids'),
  json_extract(data, '$.block_pool_events'), json_extract(data, '$.scheduler_output.scheduled_new_reqs')
  FROM snapshots WHERE kind = 'step' ORDER BY step_id"""
# NOTE: json_each over an extracted sub-array parses only that array (json_each(data, path)
# would parse the whole snapshot again, once per queue).
_QUEUE_SCAN_SQL = """SELECT step_id,
  (SELECT json_group_array(json_array(json_extract(q.value, '$.request_id'), json_extract(q.value, '$.status')))
     FROM json_each(json_extract(data, '$.scheduler.waiting')) q),
  (SELECT json_group_array(json_array(json_extract(q.value, '$.request_id'), json_extract(q.value, '$.status')))
     FROM json_each(json_extract(data, '$.scheduler.running')) q),
  (SELECT json_group_array(json_array(json_extract(q.value, '$.request_id'), json_extract(q.value, '$.status')))
     FROM json_each(json_extract(data, '$.scheduler.skipped_waiting')) q)
  FROM snapshots WHERE kind = 'step' ORDER BY step_id"""
_RUNNER_META_SQL = """SELECT step_id, json_array_length(data, '$.input_batch.condense_moves'),
  json_extract(data, '$.prepare_inputs.cudagraph.mode'), json_extract(data, '$.prepare_inputs.cudagraph.num_tokens'),
  json_extract(data, '$.prepare_inputs.cudagraph.num_padded_tokens'),
  json_extract(data, '$.prepare_inputs.cudagraph.reason')
  FROM snapshots WHERE kind = 'model_runner' ORDER BY step_id"""
# NOTE: a step that recorded its sampled ids needs no input_ids (a prefill's can be 16k
# tokens): the token a request sampled at a step sits at position seq_len. Older runs
# (no sampled_token_ids) read the generated tokens back from the next steps' inputs.
_RUNNER_TOKENS_SQL = """SELECT step_id, json_extract(data, '$.prepare_inputs.req_ids'),
  json_extract(data, '$.prepare_inputs.seq_lens'), json_extract(data, '$.prepare_inputs.discard_request_indices'),
  json_extract(data, '$.sampled_token_ids'),
  CASE WHEN json_type(data, '$.sampled_token_ids') IS NULL
       THEN json_extract(data, '$.prepare_inputs.req_indices') END,
  CASE WHEN json_type(data, '$.sampled_token_ids') IS NULL THEN json_extract(data, '$.prepare_inputs.positions') END,
  CASE WHEN json_type(data, '$.sampled_token_ids') IS NULL THEN json_extract(data, '$.prepare_inputs.input_ids') END
  FROM snapshots WHERE kind = 'model_runner' ORDER BY step_id"""


def _corrupt(path: str, e: Exception) -> RunError:
    return RunError(f"{os.path.basename(path)}: corrupt run store ({e})")


@st.cache_resource(max_entries=4, ttl=3600, show_spinner=False)
def step_scan(path: str, version: tuple) -> dict | RunError:
    """One pass over the "step" snapshots: per step (in step order) its time, step record,
    KV usage, finished ids and block-pool events; the prompt of every request. Shared: do
    not modify."""
    try:
        rows, bad = _guarded_rows(path, _STEP_SCAN_SQL, "step records")
    except sqlite3.Error as e:
        return _corrupt(path, e)
    scan = {"steps": [], "time_ns": [], "records": [], "usage": [], "finished": [], "events": [],
            "prompts": {}, "bad_rows": BadRows(bad)}
    for step_id, t, rec, usage, finished, events, new in rows:
        try:
            rec, finished, events, new = _loads(rec), _loads(finished), _loads(events), _loads(new)
            if not isinstance(rec, dict):
                raise ValueError("no step record")
            for r in new or []:
                scan["prompts"][str(r["req_id"])] = r["prompt_token_ids"]
        except (KeyError, TypeError, ValueError, AttributeError, msgspec.DecodeError) as e:
            scan["bad_rows"].append(f"step {step_id}, 'step' snapshot: unexpected content "
                                    f"({type(e).__name__}: {e}), skipped")
            continue
        scan["steps"].append(step_id)
        scan["time_ns"].append(t)
        scan["records"].append(rec)
        scan["usage"].append(usage or 0.0)
        scan["finished"].append(finished or [])
        scan["events"].append(events or [])
    return scan


@st.cache_resource(max_entries=4, ttl=3600, show_spinner=False)
def queue_statuses(path: str, version: tuple) -> dict[str, dict[int, str]] | RunError:
    """request id -> {step id: status} for every step whose snapshot has the request in the
    waiting, skipped-waiting or running queue (WAITING, WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RUNNING, or PREEMPTED while it waits to be recomputed): one pass reading two fields of
    each queue entry. Shared: do not modify."""
    try:
        rows, _ = _guarded_rows(path, _QUEUE_SCAN_SQL, "request statuses")
    except sqlite3.Error as e:
        return _corrupt(path, e)
    out: dict[str, dict[int, str]] = {}
    for step_id, waiting, running, skipped in rows:
        for q in (waiting, running, skipped):
            for req, status in _loads(q) or []:
                out.setdefault(str(req), {})[step_id] = status
    return out


@st.cache_resource(max_entries=4, ttl=3600, show_spinner=False)
def runner_meta(path: str, version: tuple) -> dict | RunError:
    """Per step, from the "model_runner" snapshots: condense moves and the CUDA-graph decision."""
    try:
        rows, bad = _guarded_rows(path, _RUNNER_META_SQL, "model runner")
    except sqlite3.Error as e:
        return _corrupt(path, e)
    return {"condense": {r[0]: r[1] or 0 for r in rows},
            "cudagraph": [(r[0], *r[2:]) for r in rows if r[2] is not None], "bad_rows": BadRows(bad)}


@st.cache_resource(max_entries=4, ttl=3600, show_spinner=False)
def runner_tokens(path: str, version: tuple) -> list[tuple] | RunError:
    """Per step, the token fields of prepare_inputs: (step, req_ids, seq_lens,
    discard_request_indices, sampled_token_ids or None, and only without sampled ids:
    req_indices, positions, input_ids). Shared: do not modify."""
    try:
        rows, _ = _guarded_rows(path, _RUNNER_TOKENS_SQL, "tokens")
    except sqlite3.Error as e:
        return _corrupt(path, e)
    out = []
    for step_id, req_ids, seq_lens, discard, sampled, req_idx, pos, ids in rows:
        if req_ids is None:
            continue
        try:
            out.append((step_id, _loads(req_ids), _loads(seq_lens) or [], _loads(discard) or [], _loads(sampled),
                        _loads(req_idx) or [], _loads(pos) or [], _loads(ids) or []))
        except msgspec.DecodeError:
            continue
    return out


def prefetch(path: str) -> None:
    """Build a finished run's tables in two background threads (each table once: a page that
    needs one waits for the thread that is building it instead of building it again).

    NOTE: SQLite releases the GIL while it runs a query, so the two passes (and the page's
    own work) use both cores of a small machine; a page switch after the first page of a
    big run then finds its tables ready, or half built."""
    version = file_version(path)
    key = (path, version)
    if key in _prefetched:
        return
    if len(_prefetched) > 64:
        _prefetched.clear()
    _prefetched.add(key)

    def work(jobs) -> None:
        from dashboard import spans      # (spans imports this module)
        for fn, args in jobs(spans):
            try:
                fn(path, version, *args)
            except Exception:   # noqa: BLE001 - a page that needs it reports the error itself
                pass

    info = run_info(path, version)
    device = str(info["meta"].get("device")) if isinstance(info, dict) else "cpu"
    # NOTE: the timeline (the first page after the inspector in the sidebar) needs the spans,
    # metrics and lessons the step table, the journey everything (its queue statuses are
    # a slow pass, so they come early).
    lanes = (lambda spans: ((step_scan, ()), (queue_statuses, ()), (runner_meta, ()), (step_table, ())),
             lambda spans: ((spans.request_table, ()), (spans.span_table, (device,)), (runner_tokens, ()),
                            (token_index, ())))
    import threading

    from streamlit.runtime.scriptrunner import add_script_run_ctx
    for jobs in lanes:
        thread = threading.Thread(target=work, args=(jobs,), name="dashboard-prefetch", daemon=True)
        add_script_run_ctx(thread)
        thread.start()


_prefetched: set = set()


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
    scan, runner = step_scan(path, version), runner_meta(path, version)
    for x in (scan, runner):
        if isinstance(x, RunError):
            return x
    bad = BadRows(scan["bad_rows"] + [b for b in runner["bad_rows"] if b not in scan["bad_rows"]])
    cg_rows = {r[0]: r for r in runner["cudagraph"]}
    out = []
    for step_id, t, rec, usage, finished, events in zip(scan["steps"], scan["time_ns"], scan["records"],
                                                        scan["usage"], scan["finished"], scan["events"]):
        try:
            row = _step_row(step_id, t, rec, usage, finished, events)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            bad.append(f"step {step_id}, 'step' snapshot: unexpected content ({type(e).__name__}: {e}), skipped")
            continue
        row["condense_moves"] = runner["condense"].get(step_id, 0)
        c = cg_rows.get(step_id)
        row["cudagraph_mode"] = c[1] if c else None
        row["cudagraph_padding"] = (c[3] or 0) - (c[2] or 0) if c else 0
        out.append(row)
    df = pd.DataFrame(out)
    if not df.empty:
        df["t_s"] = (df["time_ns"] - df["time_ns"].iloc[0]) / 1e9
    df.attrs["bad_rows"] = bad
    return df


CG_COLUMNS = ["step", "mode", "num_tokens", "num_padded_tokens", "reason"]


@st.cache_data(max_entries=32, show_spinner=False)
def cudagraph_steps(path: str, version: tuple) -> pd.DataFrame | RunError:
    """The CUDA-graph decision of every step (CudagraphDispatcher.dispatch, recorded in
    prepare_inputs.cudagraph); empty for runs recorded before it was traced."""
    runner = runner_meta(path, version)
    if isinstance(runner, RunError):
        return runner
    df = pd.DataFrame(runner["cudagraph"], columns=CG_COLUMNS)
    df.attrs["bad_rows"] = runner["bad_rows"]
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


@st.cache_resource(max_entries=4, ttl=3600, show_spinner=False)
def step_records(path: str, version: tuple) -> dict[int, dict] | RunError:
    """step id -> SchedulerStepRecord + finished ids + time_ns (for the request journey).
    Shared between sessions: do not modify."""
    scan = step_scan(path, version)
    if isinstance(scan, RunError):
        return scan
    return {s: {**rec, "finished_req_ids": fin, "time_ns": t}
            for s, t, rec, fin in zip(scan["steps"], scan["time_ns"], scan["records"], scan["finished"])}


@st.cache_resource(max_entries=4, ttl=3600, show_spinner=False)
def token_index(path: str, version: tuple) -> dict | RunError:
    """Tokens by request and position, and the token each request sampled at each step.
    Shared between sessions: do not modify.

    Prompt tokens come from SchedulerOutput.scheduled_new_reqs; a generated token is
    known once it is fed back as an input (prepare_inputs.input_ids at its position),
    or directly when the runner snapshot has `sampled_token_ids`.
    """
    scan, runner = step_scan(path, version), runner_tokens(path, version)
    for x in (scan, runner):
        if isinstance(x, RunError):
            return x
    tokens: dict[str, dict[int, int]] = {req: dict(enumerate(ids)) for req, ids in scan["prompts"].items()}
    sampled: dict[int, dict[str, list]] = {}
    for step_id, req_ids, seq_lens, discard, direct, req_indices, positions, input_ids in runner:
        for row, pos, tok in zip(req_indices, positions, input_ids):      # (runs without sampled ids)
            tokens.setdefault(req_ids[row], {})[pos] = tok
        discard = set(discard)
        sampled[step_id] = {}
        for i, (req, seq_len) in enumerate(zip(req_ids, seq_lens)):
            if i not in discard:
                tok = direct[i][0] if direct and i < len(direct) and direct[i] else None
                sampled[step_id][req] = [seq_len, tok]
                if tok is not None and tok >= 0:
                    tokens.setdefault(req, {})[seq_len] = tok
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
