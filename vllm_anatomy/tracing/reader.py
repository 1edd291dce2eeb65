"""Reading run stores: `open_run(path)` and `list_runs(trace_dir)`.

Works while the run is still being written (WAL readers never block writers)
and after a crash: what was committed is there. A step counts as committed
once its "step" snapshot is: EngineCore records it last in the step.

Reading never changes a run's files (store.connect_readonly: no checkpoint, no
WAL recovery written back, no -shm created). A row whose JSON does not parse
(a damaged file) is reported, not raised as a bare ValueError: `snapshot()`
raises MalformedRowError (a TraceStoreError) naming the row; `spans()` and
`snapshots()` skip it and list it in `run.bad_rows`.

Snapshots are read typed through the contract in tracing/snapshots.py:
`step_snapshot(i)` / `model_runner_snapshot(i)` decode one step's records strictly (a
snapshot that does not match raises MalformedRowError naming it), `index(kind, view)` reads
a partial view of every step for run-level tables, `verified_drafts(i)` a step's
speculative-decoding verifications wherever they were recorded (async scheduling: late).
`snapshot()` / `snapshots()` give the stored JSON as plain data. Runs of schema_version 1
(recorded before the contract) are upgraded as they are read (`_upgrade_v1`).
"""
from __future__ import annotations

import functools
import glob
import json
import os
import sqlite3
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

import msgspec

from vllm_anatomy.tracing.recorder import paused_gc
from vllm_anatomy.tracing.snapshots import SNAPSHOT_TYPES
from vllm_anatomy.tracing.store import SCHEMA_VERSION, SPAN_COLUMNS, connect_readonly

if TYPE_CHECKING:
    from vllm_anatomy.tracing.snapshots import ModelRunnerSnapshot, SpecDecodeRecord, SpecDecodeSnapshot, StepSnapshot

T = TypeVar("T")

# NOTE: msgspec's decoder, not json.loads: a big run has tens of thousands of span rows and
# snapshots of hundreds of KB; it is many times faster and gives the same plain data.
_decode = msgspec.json.Decoder().decode
_typed_decoders: dict[type, msgspec.json.Decoder] = {}

# Versions this reader reads: SCHEMA_VERSION as stored, older ones through an upgrade.
OLDEST_READABLE_VERSION = 1


class TraceStoreError(Exception):
    """The file is not a readable vllm_anatomy run store."""


class MalformedRowError(TraceStoreError):
    """One row of the run store does not parse (its JSON is damaged)."""


@dataclass
class BadRow:
    """A row skipped because its JSON does not parse: which one, and why."""
    table: str          # "spans" | "snapshots"
    where: str          # e.g. "step 12, 'step' snapshot (row id 345)"
    error: str

    def __str__(self) -> str:
        return f"{self.table}: {self.where}: {self.error}"


@dataclass
class SpanRow:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    links_json: str = field(repr=False)    # `links`, decoded when first read
    status: str | None = None
    service: str = ""
    process_kind: str = ""
    pid: int = 0
    step_id: int | None = None
    request_id: str | None = None
    # (span_details: an instrumentation scope other than ours, a status message; runs before it: these)
    scope_name: str = "vllm_anatomy"
    scope_version: str = ""
    status_message: str = ""

    @functools.cached_property
    def links(self) -> list[dict[str, Any]]:
        """[{trace_id, span_id, attributes}]. NOTE: decoded on first use: a step span links
        to every request it served (hundreds), and most readers never look."""
        return _decode(self.links_json)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass
class Snapshot:
    step_id: int | None
    kind: str
    process: str
    time_ns: int
    data: Any = field(repr=False)


class Run:
    """A run store opened for reading."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise TraceStoreError(f"{path}: no such run store file")
        self.path = path
        self.bad_rows: list[BadRow] = []
        self._span_details: bool | None = None      # (does the file have the span_details table?)
        try:
            self._conn: sqlite3.Connection | None = connect_readonly(path)     # None once closed
        except sqlite3.DatabaseError as e:   # "file is not a database", "unable to open"
            raise TraceStoreError(f"{path}: not a vllm_anatomy run store ({e})") from e
        self.meta = self._read_meta()

    def _read_meta(self) -> dict[str, Any]:
        try:
            rows = self._connection().execute("SELECT key, value FROM meta").fetchall()
        except sqlite3.DatabaseError as e:  # "file is not a database", "no such table: meta"
            self.close()
            raise TraceStoreError(f"{self.path}: not a vllm_anatomy run store ({e})") from e
        meta = {k: _maybe_json(v) for k, v in rows}
        version = meta.get("schema_version")
        if type(version) is not int or not OLDEST_READABLE_VERSION <= version <= SCHEMA_VERSION:
            self.close()
            raise TraceStoreError(f"{self.path}: run store schema_version {version!r}; this reader "
                                  f"understands versions {OLDEST_READABLE_VERSION} (upgraded as it is read) "
                                  f"to version {SCHEMA_VERSION}")
        return meta

    @property
    def schema_version(self) -> int:
        return self.meta["schema_version"]

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise TraceStoreError(f"{self.path}: the run is closed")
        return self._conn

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self._connection().execute(sql, args).fetchall()
        except sqlite3.DatabaseError as e:
            raise TraceStoreError(f"{self.path}: corrupt run store ({e})") from e

    # -- steps and snapshots ------------------------------------------------------
    def steps(self) -> list[int]:
        """Step ids whose "step" snapshot is committed, in order (level "full")."""
        rows = self._query("SELECT DISTINCT step_id FROM snapshots WHERE kind = 'step' ORDER BY step_id")
        return [r[0] for r in rows]

    def snapshot(self, step_id: int, kind: str = "step") -> Any | None:
        rows = self._query("SELECT id, data FROM snapshots WHERE step_id = ? AND kind = ? ORDER BY id LIMIT 1",
                           (step_id, kind))
        if not rows:
            return None
        try:
            return _decode(rows[0][1])
        except (ValueError, TypeError) as e:
            bad = _snapshot_bad_row(rows[0][0], step_id, kind, e)
            raise MalformedRowError(f"{self.path}: {bad}") from e

    def snapshots(self, kind: str | None = None) -> Iterator[Snapshot]:
        sql = "SELECT id, step_id, kind, process, time_ns, data FROM snapshots"
        rows = self._query(sql + (" WHERE kind = ?" if kind else "") + " ORDER BY id", (kind,) if kind else ())
        for row_id, step_id, k, process, t, data in rows:
            try:
                yield Snapshot(step_id, k, process, t, _decode(data))
            except (ValueError, TypeError) as e:
                self.bad_rows.append(_snapshot_bad_row(row_id, step_id, k, e))

    def num_steps(self) -> int:
        """How many steps are committed so far (cheap: for a live run's progress)."""
        return self._query("SELECT count(*) FROM snapshots WHERE kind = 'step'")[0][0]

    # -- typed snapshots (tracing/snapshots.py) ---------------------------------------------
    def step_snapshot(self, step_id: int) -> StepSnapshot | None:
        """The step's "step" snapshot as a StepSnapshot (None: not committed)."""
        return self._typed(step_id, "step")

    def model_runner_snapshot(self, step_id: int) -> ModelRunnerSnapshot | None:
        """The step's "model_runner" snapshot (the first rank's) as a ModelRunnerSnapshot, or None."""
        return self._typed(step_id, "model_runner")

    def spec_decode_snapshot(self, step_id: int) -> SpecDecodeSnapshot | None:
        """Async scheduling: the step's verifications, recorded after its "step" snapshot (kind
        "spec_decode"), or None (no drafts scheduled, a synchronous run, or not recorded yet)."""
        return self._typed(step_id, "spec_decode")

    def verified_drafts(self, step_id: int) -> list[SpecDecodeRecord]:
        """The drafts the step verified, wherever they were recorded (see `verified_drafts`)."""
        step = self.step_snapshot(step_id)
        return verified_drafts(step, self.spec_decode_snapshot(step_id)) if step is not None else []

    def _typed(self, step_id: int, kind: str) -> Any:
        rows = self._query("SELECT id, data FROM snapshots WHERE step_id = ? AND kind = ? ORDER BY id LIMIT 1",
                           (step_id, kind))
        if not rows:
            return None
        try:
            return decode_snapshot(kind, rows[0][1], self.schema_version)
        except (ValueError, TypeError) as e:     # msgspec.DecodeError / ValidationError are ValueErrors
            bad = _snapshot_bad_row(rows[0][0], step_id, kind, e, rows[0][1])
            raise MalformedRowError(f"{self.path}: {bad}") from e

    def index(self, kind: str, view: type[T]) -> list[tuple[int, int, T]]:
        """(step id, time_ns, `view` of its snapshot) for every step's first `kind` snapshot, in
        step order: a partial view (snapshots.StepIndex, ModelRunnerIndex, ...) decodes only the
        fields it names. A row that does not decode is skipped and listed in `bad_rows`.

        NOTE: one pass, one parse per snapshot, in msgspec. SQLite's json_extract (3.40 here)
        parses the whole document once per call: five fields of each of a 1,000-step run's
        step snapshots cost ten times this."""
        decoder = _typed_decoders.get(view) or _typed_decoders.setdefault(view, msgspec.json.Decoder(view))
        out, seen = [], set()
        try:
            with paused_gc():
                # NOTE: no cyclic GC meanwhile: a pass over a big run builds millions of small
                # dicts and lists, none of them garbage, that each collection would walk again
                # (two thirds of a 1,000-step pass's time). Rows are streamed in rowid order (no
                # sort, no 100s of MB fetched at once); the first of a step's rows wins (tensor
                # parallelism: one per rank, the same content).
                for row_id, step_id, time_ns, data in self._connection().execute(
                        "SELECT id, step_id, time_ns, data FROM snapshots WHERE kind = ? ORDER BY id", (kind,)):
                    if step_id in seen:
                        continue
                    seen.add(step_id)
                    try:
                        out.append((step_id, time_ns, decoder.decode(data)))
                    except (ValueError, TypeError) as e:
                        self.bad_rows.append(_snapshot_bad_row(row_id, step_id, kind, e, data))
        except sqlite3.DatabaseError as e:
            raise TraceStoreError(f"{self.path}: corrupt run store ({e})") from e
        out.sort(key=lambda r: r[0])
        return out

    # -- spans ----------------------------------------------------------------------
    def spans(self, name: str | None = None, where: str = "", args: tuple = ()) -> list[SpanRow]:
        """Finished spans in start order (all, those named `name`, or those matching the
        SQL condition `where` over the spans table's columns, with `args`)."""
        conds = (["name = ?"] if name else []) + ([f"({where})"] if where else [])
        # NOTE: links are checked in SQLite (json_valid: no Python objects) and decoded
        # only when read (SpanRow.links). span_details (newer runs) is joined on the span's key.
        details = self._has_span_details()
        sql = (f"SELECT {', '.join(SPAN_COLUMNS)}, "
               + ("scope_name, scope_version, status_message, " if details else "")
               + "json_valid(links) AND json_type(links) = 'array' FROM spans"
               + (" LEFT JOIN span_details USING (trace_id, span_id)" if details else "")
               + (" WHERE " + " AND ".join(conds) if conds else "") + " ORDER BY start_ns")
        out = []
        with paused_gc():           # (tens of thousands of rows: see index())
            for r in self._query(sql, ((name,) if name else ()) + tuple(args)):
                try:
                    if not r[-1]:
                        raise ValueError("links is not a JSON array")
                    row = _span_row(r[:len(SPAN_COLUMNS)])
                    if details and r[len(SPAN_COLUMNS)] is not None:
                        row.scope_name, row.scope_version, row.status_message = r[len(SPAN_COLUMNS):-1]
                    out.append(row)
                except (ValueError, TypeError) as e:
                    self.bad_rows.append(BadRow("spans", f"span {r[3]!r} {r[1]} of trace {r[0]}",
                                                f"malformed JSON ({e})"))
        return out

    def _has_span_details(self) -> bool:
        if self._span_details is None:
            self._span_details = bool(self._query(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'span_details'"))
        return self._span_details

    def processes(self) -> dict[str, set[int]]:
        """process kind -> the pids that wrote spans."""
        out: dict[str, set[int]] = {}
        for kind, pid in self._query("SELECT DISTINCT process_kind, pid FROM spans"):
            out.setdefault(kind or "?", set()).add(pid)
        return out

    def span_ends(self, names: list[str]) -> dict[str, int]:
        """name -> when its last span ended (ns since the epoch), for the names that have one."""
        marks = ", ".join("?" * len(names))
        return dict(self._query(f"SELECT name, max(end_ns) FROM spans WHERE name IN ({marks}) GROUP BY name",
                                tuple(names)))

    def first_step_time_ns(self) -> int | None:
        """When the first committed step's "step" snapshot was recorded, or None."""
        rows = self._query("SELECT time_ns FROM snapshots WHERE kind = 'step' ORDER BY step_id LIMIT 1")
        return rows[0][0] if rows else None

    def requests(self) -> list[SpanRow]:
        """Request-level spans (one per request, from add to finish)."""
        return self.spans(where="CASE WHEN json_valid(attributes) THEN "
                                "json_extract(attributes, '$.\"vllm_anatomy.span_type\"') END = 'request'")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verified_drafts(step: StepSnapshot, late: SpecDecodeSnapshot | None) -> list[SpecDecodeRecord]:
    """One step's verifications (SpecDecodeRecords: drafts, how many accepted, output tokens, the
    rejected drafts' slots), from its "step" snapshot and its late "spec_decode" one (or None).

    NOTE: a synchronous run records them in the step's `step_record.spec_decode`. With async
    scheduling the "step" snapshot is taken at launch, before the step is verified: its record has
    none, and they are in the late snapshot written once its output was processed. Every reader
    (the lessons, the dashboard's step inspector) asks here, so an async run reads like a
    synchronous one."""
    if late is not None:
        return late.spec_decode
    record = step.scheduler.step_record
    return record.spec_decode if record is not None else []


def _maybe_json(value: str) -> Any:
    try:
        return json.loads(value)
    except (ValueError, TypeError):
        return value   # written by something else: shown as is, the version check decides


def _snapshot_bad_row(row_id: int, step_id: int | None, kind: str, e: Exception,
                      data: str | bytes | None = None) -> BadRow:
    """NOTE: the typed decoder checks types as it parses, so truncated JSON can fail first on a
    type (a ValidationError); `data`, when given, is re-read untyped to name the real fault."""
    malformed = isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError)
    if not malformed and data is not None:
        try:
            _decode(data)
        except msgspec.DecodeError as untyped:
            malformed, e = True, untyped
    what = "malformed JSON" if malformed else "does not match the snapshot contract (tracing/snapshots.py)"
    return BadRow("snapshots", f"step {step_id}, {kind!r} snapshot (row id {row_id})", f"{what} ({e})")


def decode_snapshot(kind: str, data: str | bytes, schema_version: int = SCHEMA_VERSION) -> Any:
    """A stored snapshot's JSON as its record (snapshots.SNAPSHOT_TYPES[kind]), strictly:
    msgspec.ValidationError for a field outside the contract or of the wrong type."""
    if kind not in SNAPSHOT_TYPES:
        raise msgspec.ValidationError(f"unknown snapshot kind {kind!r} (known: {', '.join(SNAPSHOT_TYPES)})")
    kind_type = SNAPSHOT_TYPES[kind]
    if schema_version == SCHEMA_VERSION:
        decoder = _typed_decoders.get(kind_type) or _typed_decoders.setdefault(kind_type,
                                                                                msgspec.json.Decoder(kind_type))
        return decoder.decode(data)
    return msgspec.convert(_upgrade_v1(kind, _decode(data)), kind_type)


def _upgrade_v1(kind: str, data: Any) -> Any:
    """A schema_version 1 snapshot in today's layout. Version 1 runs were recorded before the
    typed contract: they may lack fields added since (read with their defaults: deferred_reasons,
    reason_code, sampled_token_ids, the block-pool events' request_id / call / ref_cnts /
    queue_ends, grammar_ready_req_ids); their CachedRequestData has resumed_req_token_ids, turned
    into all_token_ids here; and the oldest carry SchedulerOutput.trace_headers (the trace context
    now rides beside the call, not in the message): dropped here."""
    if kind == "step" and isinstance(data, dict) and isinstance(data.get("scheduler_output"), dict):
        so = data["scheduler_output"]
        so.pop("trace_headers", None)
        cached = so.get("scheduled_cached_reqs")
        if isinstance(cached, dict) and "resumed_req_token_ids" in cached:
            # v1 sent token lists for resumed requests only, as a parallel list; v0.27.1's
            # CachedRequestData (today's) has new_token_ids and all_token_ids by request id.
            token_lists = cached.pop("resumed_req_token_ids")
            cached["new_token_ids"] = []
            cached["all_token_ids"] = {req_id: ids for req_id, ids in zip(cached.get("req_ids", []), token_lists)
                                       if ids is not None}
    return data


def _span_row(r: tuple) -> SpanRow:
    d = dict(zip(SPAN_COLUMNS, r))
    for key, kind in (("attributes", dict), ("events", list)):
        d[key] = _decode(d[key])
        if type(d[key]) is not kind:
            raise TypeError(f"{key} is a {type(d[key]).__name__}, not a {kind.__name__}")
    d["links_json"] = d.pop("links")
    return SpanRow(**d)


def open_run(path: str) -> Run:
    return Run(path)


def list_runs(trace_dir: str) -> list[dict[str, Any]]:
    """Metadata of every run store under trace_dir, newest first; unreadable files are
    listed with an "error" instead of metadata."""
    runs = []
    for path in glob.glob(os.path.join(trace_dir, "*.sqlite")):
        try:
            with open_run(path) as run:
                runs.append({"path": path, **run.meta})
        except TraceStoreError as e:
            runs.append({"path": path, "error": str(e)})
    return sorted(runs, key=lambda r: r.get("start_time_ns", 0), reverse=True)
