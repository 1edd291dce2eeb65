"""Reading run stores: `open_run(path)` and `list_runs(trace_dir)`.

Works while the run is still being written (WAL readers never block writers)
and after a crash: what was committed is there. A step counts as committed
once its "step" snapshot is: EngineCore records it last in the step.
"""
from __future__ import annotations

import glob
import json
import os
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Iterator

from vllm_anatomy.tracing.store import SCHEMA_VERSION, SPAN_COLUMNS, connect


class TraceStoreError(Exception):
    """The file is not a readable vllm_anatomy run store."""


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
        self._conn = connect(path)
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
        rows = self._query("SELECT data FROM snapshots WHERE step_id = ? AND kind = ? ORDER BY id LIMIT 1",
                           (step_id, kind))
        return json.loads(rows[0][0]) if rows else None

    def snapshots(self, kind: str | None = None) -> Iterator[Snapshot]:
        sql = "SELECT step_id, kind, process, time_ns, data FROM snapshots"
        rows = self._query(sql + (" WHERE kind = ?" if kind else "") + " ORDER BY id", (kind,) if kind else ())
        for step_id, k, process, t, data in rows:
            yield Snapshot(step_id, k, process, t, json.loads(data))

    # -- spans ----------------------------------------------------------------------
    def spans(self, name: str | None = None) -> list[SpanRow]:
        sql = f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans"
        rows = self._query(sql + (" WHERE name = ?" if name else "") + " ORDER BY start_ns",
                           (name,) if name else ())
        return [_span_row(r) for r in rows]

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


def _span_row(r: tuple) -> SpanRow:
    d = dict(zip(SPAN_COLUMNS, r))
    for key in ("attributes", "events", "links"):
        d[key] = json.loads(d[key])
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
