"""Loading a run store for the dashboard, cached and lazy.

Run-level tables (one row per step, spans, requests) are cached by (path, file
version): a live run's version changes at every commit, a finished run's never.
A step's snapshots are cached by (path, step_id) alone: a committed step never
changes. Everything is read through tracing/reader.py and its typed contract
(tracing/snapshots.py): a step's snapshots strictly (Run.step_snapshot), run-level
tables from partial views of every step (Run.index), so a run of thousands of steps
is summarised without building every block list.

Every loader returns plain data; errors come back as RunError (shown by
`dashboard.state.show_error`), never as an exception in the page. Run files are
opened read-only (tracing/store.py: connect_readonly): reading a live or crashed
run never changes its files. A row whose JSON is damaged is skipped and named
(`bad_rows_of(result)`, shown by `dashboard.state.show_bad_rows`); a step whose
own snapshot is damaged gives a RunError naming that row.
"""
from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from typing import Any

import msgspec
import pandas as pd
import streamlit as st

from vllm_anatomy.tracing.reader import MalformedRowError, TraceStoreError, list_runs, open_run, verified_drafts
from vllm_anatomy.tracing.recorder import paused_gc
from vllm_anatomy.tracing.snapshots import ModelRunnerIndex, ModelRunnerTokensIndex, StepIndex


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
    """The "step" and "model_runner" snapshots of one committed step, read strictly through the
    contract (Run.step_snapshot / model_runner_snapshot), handed to the pages as plain data; with
    async scheduling also the late "spec_decode" ones of this step and the next ("spec",
    "next_spec": None when absent); "verified": the drafts the step verified, sync or async
    (reader.verified_drafts)."""
    name, bad = os.path.basename(path), []
    try:
        with open_run(path) as run:
            step = run.step_snapshot(step_id)
            try:
                mr = run.model_runner_snapshot(step_id)
            except MalformedRowError as e:       # the step can still be shown, without the worker's side
                mr, bad = None, [str(e).split(": ", 1)[-1]]
            # Async scheduling: this step's verification and the next one's (its drafts were proposed
            # after this step), recorded after the step snapshot (kind "spec_decode").
            late = {}
            for key, sid in (("spec", step_id), ("next_spec", step_id + 1)):
                try:
                    late[key] = run.spec_decode_snapshot(sid)
                except MalformedRowError as e:   # shown without it
                    late[key], bad = None, bad + [str(e).split(": ", 1)[-1]]
    except MalformedRowError as e:
        return RunError(f"{name}: step {step_id} cannot be shown: its {str(e).split(': ', 1)[-1]}")
    except (TraceStoreError, sqlite3.Error, OSError, ValueError) as e:
        return RunError(f"{name}: cannot read step {step_id} ({e})")
    if step is None:
        return RunError(f"{name}: step {step_id} is not committed")
    return {"step": msgspec.to_builtins(step), "mr": msgspec.to_builtins(mr) if mr is not None else {},
            **{k: msgspec.to_builtins(v) if v is not None else None for k, v in late.items()},
            "verified": msgspec.to_builtins(verified_drafts(step, late["spec"])), "bad_rows": bad}


def _corrupt(path: str, e: Exception) -> RunError:
    return RunError(f"{os.path.basename(path)}: corrupt run store ({e})")


def _bad(run) -> BadRows:
    """The rows the reader skipped, as the damaged-rows warning lists them."""
    return BadRows(f"{b.where}: {b.error}, skipped" for b in run.bad_rows)


# -- one pass over each snapshot kind -------------------------------------------------------------
# NOTE: a 1,000-step run at batch 256 holds ~240 MB of snapshot JSON. Every per-run table below
# comes from one pass per snapshot kind through the reader's partial views (Run.index with
# snapshots.StepIndex / ModelRunnerIndex: the decoder skips every field the view does not name,
# rows are streamed, never all held). The passes are kept per (run, version), shared by every
# session and page, read-only (st.cache_resource: no copy per call); at most a few runs at once,
# so memory stays bounded by the summaries, never every snapshot.
@st.cache_resource(max_entries=4, ttl=3600, show_spinner=False)
def step_scan(path: str, version: tuple) -> dict | RunError:
    """One pass over the "step" snapshots: per step (in step order) its time, step record (plain
    data), KV usage, finished ids and block-pool events; the prompt of every request; each request's
    status at every step whose queues (waiting, skipped-waiting, running) hold it. Shared: do not
    modify."""
    try:
        with open_run(path) as run:
            rows = run.index("step", StepIndex)
            bad = _bad(run)
    except TraceStoreError as e:
        return _corrupt(path, e)
    with paused_gc():           # (see Run.index)
        return _step_tables(rows, bad)


def _step_tables(rows: list, bad: BadRows) -> dict:
    scan: dict[str, Any] = {"steps": [], "time_ns": [], "records": [], "usage": [], "finished": [], "events": [],
                            "prompts": {}, "statuses": {}, "bad_rows": bad}
    statuses: dict[str, dict[int, str]] = scan["statuses"]
    for step_id, t, ix in rows:
        sched, out = ix.scheduler, ix.scheduler_output
        for q in (sched.waiting, sched.running, sched.skipped_waiting):
            for r in q:
                statuses.setdefault(r.request_id, {})[step_id] = r.status
        for r in out.scheduled_new_reqs:
            scan["prompts"][r.req_id] = r.prompt_token_ids
        if sched.step_record is None:
            bad.append(f"step {step_id}, 'step' snapshot: no step record, skipped")
            continue
        scan["steps"].append(step_id)
        scan["time_ns"].append(t)
        scan["records"].append(sched.step_record)
        scan["usage"].append(sched.kv_cache.usage)
        scan["finished"].append(out.finished_req_ids)
        scan["events"].append(ix.block_pool_events)
    return scan


def queue_statuses(path: str, version: tuple) -> dict[str, dict[int, str]] | RunError:
    """request id -> {step id: status} for every step whose snapshot has the request in the
    waiting, skipped-waiting or running queue (WAITING, WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RUNNING, or PREEMPTED while it waits to be recomputed). Shared: do not modify."""
    scan = step_scan(path, version)
    return scan if isinstance(scan, RunError) else scan["statuses"]


@st.cache_resource(max_entries=4, ttl=3600, show_spinner=False)
def runner_scan(path: str, version: tuple) -> dict | RunError:
    """One pass over the "model_runner" snapshots: per step its condense moves, CUDA-graph decision
    and token rows (step, req_ids, seq_lens, discard_request_indices, sampled_token_ids or None, and
    only without sampled ids: req_indices, positions, input_ids; a second pass reads those for runs
    recorded before sampled_token_ids). Shared: do not modify."""
    try:
        with open_run(path) as run:
            rows = run.index("model_runner", ModelRunnerIndex)
            old = {s: ix.prepare_inputs for s, _, ix in run.index("model_runner", ModelRunnerTokensIndex)} \
                if any(ix.sampled_token_ids is None and ix.prepare_inputs for _, _, ix in rows) else {}
            bad = _bad(run)
    except TraceStoreError as e:
        return _corrupt(path, e)
    condense, cudagraph, tokens = {}, [], []
    for step_id, _, ix in rows:
        condense[step_id] = len(ix.input_batch.condense_moves)
        pi = ix.prepare_inputs
        if pi is None:
            continue
        if pi.cudagraph is not None:
            c = pi.cudagraph
            cudagraph.append((step_id, c.mode, c.num_tokens, c.num_padded_tokens, c.reason, c.reason_code))
        back = old.get(step_id) if ix.sampled_token_ids is None else None
        tokens.append((step_id, pi.req_ids, pi.seq_lens, pi.discard_request_indices, ix.sampled_token_ids,
                       *((back.req_indices, back.positions, back.input_ids) if back else ([], [], [])),
                       pi.num_draft_tokens))
    return {"condense": condense, "cudagraph": cudagraph, "tokens": tokens, "bad_rows": bad}


def prefetch(path: str) -> None:
    """Build a finished run's tables in two background threads (each table once: a page that
    needs one waits for the thread that is building it instead of building it again).

    NOTE: the journey needs the two snapshot passes and the token index (one lane, in that order,
    then the step table the metrics and lessons need), the timeline (the first page after the
    inspector in the sidebar) the spans (the other lane). The passes are Python (msgspec) and
    share the GIL with the span table: the two lanes take turns, so a page switch after the first
    page of a big run finds its tables ready, or half built, whichever of the two it opens."""
    version = file_version(path)
    key = (path, version)
    if key in _prefetched:
        return
    if len(_prefetched) > 64:
        _prefetched.clear()
    _prefetched.add(key)
    info = run_info(path, version)
    device = str(info["meta"].get("device")) if isinstance(info, dict) else "cpu"

    def work(jobs) -> None:
        from dashboard import spans      # (spans imports this module)
        for fn, args in jobs(spans):
            try:
                fn(path, version, *args)
            except Exception:   # noqa: BLE001 - a page that needs it reports the error itself
                pass

    lanes = (lambda spans: ((step_scan, ()), (runner_scan, ()), (token_index, ()), (step_table, ())),
             lambda spans: ((spans.request_table, ()), (spans.span_table, (device,))))
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
    scan, runner = step_scan(path, version), runner_scan(path, version)
    if isinstance(scan, RunError):
        return scan
    if isinstance(runner, RunError):
        return runner
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


CG_COLUMNS = ["step", "mode", "num_tokens", "num_padded_tokens", "reason", "reason_code"]


@st.cache_data(max_entries=32, show_spinner=False)
def cudagraph_steps(path: str, version: tuple) -> pd.DataFrame | RunError:
    """The CUDA-graph decision of every step (CudagraphDispatcher.dispatch, recorded in
    prepare_inputs.cudagraph); empty for runs recorded before it was traced."""
    runner = runner_scan(path, version)
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
    """Tokens by request and position ("tokens"), and what each request emitted at each step
    ("sampled": step -> request -> [position, token, more tokens...]: the position of its first
    output token, then the tokens the step emitted from there: one, or with speculative decoding
    the accepted drafts and the target's own token). Shared between sessions: do not modify.

    Prompt tokens come from SchedulerOutput.scheduled_new_reqs; a generated token is
    known once it is fed back as an input (prepare_inputs.input_ids at its position),
    or directly when the runner snapshot has `sampled_token_ids`.
    """
    scan, runner = step_scan(path, version), runner_scan(path, version)
    if isinstance(scan, RunError):
        return scan
    if isinstance(runner, RunError):
        return runner
    with paused_gc():           # (a table of every token of every request: see Run.index)
        return _token_index(scan, runner["tokens"])


def _token_index(scan: dict, runner: list[tuple]) -> dict:
    tokens: dict[str, dict[int, int]] = {req: dict(enumerate(ids)) for req, ids in scan["prompts"].items()}
    sampled: dict[int, dict[str, list]] = {}
    for step_id, req_ids, seq_lens, discard, direct, req_indices, positions, input_ids, num_drafts in runner:
        for row, pos, tok in zip(req_indices, positions, input_ids):      # (runs without sampled ids)
            tokens.setdefault(req_ids[row], {})[pos] = tok
        discard = set(discard)
        sampled[step_id] = {}
        for i, (req, seq_len) in enumerate(zip(req_ids, seq_lens)):
            if i not in discard:
                row = direct[i] if direct and i < len(direct) else []
                # NOTE: spec decode: a row verified num_drafts[i] drafts; its outputs start at the first draft's position.
                first = seq_len - (num_drafts[i] if i < len(num_drafts) else 0)
                out = [t for t in row if t >= 0]       # (-1: a rejected position, padding at the end)
                sampled[step_id][req] = [first, *out] if out else [first, None]
                for j, t in enumerate(out):
                    tokens.setdefault(req, {})[first + j] = t
    for step in sampled.values():
        for req, entry in step.items():
            if entry[1] is None:
                entry[1] = tokens.get(req, {}).get(entry[0])
    return {"tokens": tokens, "sampled": sampled}


def tokenizer_path(model_dir: str) -> str | None:
    """The run's tokenizer.json: next to the weights it was recorded with, else (a run recorded on
    another machine, as the shipped samples are: their model path is the recording machine's) in this
    machine's model cache under the same model name (`vllm-anatomy download`'s directory); None if neither."""
    from vllm_anatomy.transformers_utils.default_model import get_cache_dir
    name = os.path.basename((model_dir or "").rstrip("/"))
    here = [os.path.join(model_dir or "", "tokenizer.json")]
    if name:
        here.append(os.path.join(str(get_cache_dir()), "models", name, "tokenizer.json"))
    return next((p for p in here if os.path.isfile(p)), None)


@st.cache_resource(show_spinner=False)
def _load_tokenizer(path: str):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


def tokenizer_for(model_dir: str):
    """The run's tokenizer (tokenizer_path), or None."""
    path = tokenizer_path(model_dir)
    return _load_tokenizer(path) if path is not None else None


def decode(meta: dict, ids: list[int]) -> str | None:
    """The text of token ids, or None where the run's tokenizer is not on this machine."""
    tok = tokenizer_for(meta.get("model", ""))
    return tok.decode(ids, skip_special_tokens=False) if tok is not None else None


def startup_marks(path: str, span_names: list[str]) -> dict[str, int]:
    """When the start-up marks of a (live) run happened, in ns since the epoch: "store"
    (the run store was created), each start-up span's end, "first_step" (the first
    step's snapshot). Only what is committed so far; {} when the file cannot be read.
    Not cached: called about once a second while a live engine starts."""
    try:
        with open_run(path) as run:
            marks = {"store": int(run.meta["start_time_ns"]), **run.span_ends(span_names)}
            first = run.first_step_time_ns()
    except (TraceStoreError, KeyError, ValueError, TypeError):
        return {}
    if first is not None:
        marks["first_step"] = first
    return marks
