"""Reading run stores: `open_run(path)` and `list_runs(trace_dir)`.

Works while the run is still being written (WAL readers never block writers)
and after a crash: what was committed is there. A step counts as committed
once its "step" snapshot is: EngineCore records it last in the step.

Reading never changes a run's files (store.connect_readonly: no checkpoint, no
WAL recovery written back, no -shm created). A row whose JSON does not parse
(a damaged file) is reported, not raised as a bare ValueError: `snapshot()`
raises MalformedRowError (a TraceStoreError) naming the row; `spans()` and
`snapshots()` skip it and list it in `run.bad_rows`.
"""
from __future__ import annotations

import glob
import json
import os
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Iterator

from vllm_anatomy.tracing.store import SCHEMA_VERSION, SPAN_COLUMNS, connect_readonly


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
    links: list[dict[str, Any]]
    status: str | None
    service: str
    process_kind: str
    pid: int
    step_id: int | None = None
    request_id: str | None = None

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
        try:
            self._conn = connect_readonly(path)
        except sqlite3.DatabaseError as e:   # "file is not a database", "unable to open"
            raise TraceStoreError(f"{path}: not a vllm_anatomy run store ({e})") from e
        self.meta = self._read_meta()

    def _read_meta(self) -> dict[str, Any]:
        try:
            rows = self._conn.execute("SELECT key, value FROM meta").fetchall()
        except sqlite3.DatabaseError as e:  # "file is not a database", "no such table: meta"
            self.close()
            raise TraceStoreError(f"{self.path}: not a vllm_anatomy run store ({e})") from e
        meta = {k: _maybe_json(v) for k, v in rows}
        version = meta.get("schema_version")
        if version != SCHEMA_VERSION:
            self.close()
            raise TraceStoreError(f"{self.path}: run store schema_version {version!r}; this reader "
                                  f"understands version {SCHEMA_VERSION}")
        return meta

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self._conn.execute(sql, args).fetchall()
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
            return json.loads(rows[0][1])
        except (ValueError, TypeError) as e:
            bad = _snapshot_bad_row(rows[0][0], step_id, kind, e)
            raise MalformedRowError(f"{self.path}: {bad}") from e

    def snapshots(self, kind: str | None = None) -> Iterator[Snapshot]:
        sql = "SELECT id, step_id, kind, process, time_ns, data FROM snapshots"
        rows = self._query(sql + (" WHERE kind = ?" if kind else "") + " ORDER BY id", (kind,) if kind else ())
        for row_id, step_id, k, process, t, data in rows:
            try:
                yield Snapshot(step_id, k, process, t, json.loads(data))
            except (ValueError, TypeError) as e:
                self.bad_rows.append(_snapshot_bad_row(row_id, step_id, k, e))

    # -- spans ----------------------------------------------------------------------
    def spans(self, name: str | None = None) -> list[SpanRow]:
        sql = f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans"
        rows = self._query(sql + (" WHERE name = ?" if name else "") + " ORDER BY start_ns",
                           (name,) if name else ())
        out = []
        for r in rows:
            try:
                out.append(_span_row(r))
            except (ValueError, TypeError) as e:
                self.bad_rows.append(BadRow("spans", f"span {r[3]!r} {r[1]} of trace {r[0]}",
                                            f"malformed JSON ({e})"))
        return out

    def requests(self) -> list[SpanRow]:
        """Request-level spans (one per request, from add to finish)."""
        return [s for s in self.spans() if s.attributes.get("vllm_anatomy.span_type") == "request"]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _maybe_json(value: str) -> Any:
    try:
        return json.loads(value)
    except (ValueError, TypeError):
        return value   # written by something else: shown as is, the version check decides


def _snapshot_bad_row(row_id: int, step_id: int | None, kind: str, e: Exception) -> BadRow:
    return BadRow("snapshots", f"step {step_id}, {kind!r} snapshot (row id {row_id})", f"malformed JSON ({e})")


def _span_row(r: tuple) -> SpanRow:
    d = dict(zip(SPAN_COLUMNS, r))
    for key, kind in (("attributes", dict), ("events", list), ("links", list)):
        d[key] = json.loads(d[key])
        if type(d[key]) is not kind:
            raise TypeError(f"{key} is a {type(d[key]).__name__}, not a {kind.__name__}")
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
