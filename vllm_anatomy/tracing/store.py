"""The run store: one SQLite file per run, written by every process of the run.

    <trace_dir>/run-<YYYYmmdd-HHMMSS>-<run_id>.sqlite

Tables (schema documented in docs/trace-format.md, version SCHEMA_VERSION):
    meta(key, value)        (values JSON) schema_version, run_id, model, device, config (JSON),
                            git_commit, start_time_ns, trace_level, end_time_ns
    spans(...)              one row per finished span (OpenTelemetry's model)
    span_details(...)       the instrumentation scope and status message of the spans that
                            have them (the scope not ours, a message set); absent in older runs
    snapshots(...)          one row per (step, kind, process) snapshot, JSON

NOTE: WAL mode lets readers (the live dashboard) read while writers write, and
keeps every committed transaction after a crash of the writer. Writers from
several processes serialise on SQLite's lock; busy_timeout makes them wait
instead of failing. synchronous=NORMAL skips the fsync per commit: a killed
process loses nothing committed (only a power cut could).

NOTE: each process writes from one thread of its own (`RunStore-writer`): the
engine's thread only encodes a snapshot (msgspec, a fraction of a ms) and
queues it; every 100 ms the writer commits whatever has queued up, in order,
as one transaction. The engine never waits for SQLite (another process's
transaction, the disk, the span exporter's batch), and a busy moment costs
one commit, not one per snapshot. Since the queue keeps order, a step's
"step" snapshot is never committed before what its process queued earlier.
A killed process loses what was still queued (`flush()` waits for it), as
the span exporter loses its unexported batch.
"""
from __future__ import annotations

import atexit
import collections
import datetime
import itertools
import logging
import operator
import os
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
import urllib.parse
import uuid
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

# 2: snapshots follow the typed contract of tracing/snapshots.py (the tables are version 1's);
# 1: recorded before it, read through reader._upgrade_v1.
SCHEMA_VERSION = 2
BUSY_TIMEOUT_MS = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS spans (
    trace_id TEXT NOT NULL, span_id TEXT NOT NULL, parent_id TEXT,
    name TEXT NOT NULL, kind TEXT NOT NULL,
    start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL,
    attributes TEXT NOT NULL, events TEXT NOT NULL, links TEXT NOT NULL,
    status TEXT, service TEXT NOT NULL, process_kind TEXT NOT NULL, pid INTEGER NOT NULL,
    step_id INTEGER, request_id TEXT,
    PRIMARY KEY (trace_id, span_id));
CREATE INDEX IF NOT EXISTS spans_step ON spans(step_id);
CREATE INDEX IF NOT EXISTS spans_request ON spans(request_id);
CREATE TABLE IF NOT EXISTS span_details (
    trace_id TEXT NOT NULL, span_id TEXT NOT NULL,
    scope_name TEXT NOT NULL, scope_version TEXT NOT NULL, status_message TEXT NOT NULL,
    PRIMARY KEY (trace_id, span_id));
CREATE TABLE IF NOT EXISTS snapshots (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    step_id INTEGER, kind TEXT NOT NULL, process TEXT NOT NULL,
    time_ns INTEGER NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS snapshots_step ON snapshots(step_id, kind);
"""

SPAN_COLUMNS = ("trace_id", "span_id", "parent_id", "name", "kind", "start_ns", "end_ns",
                "attributes", "events", "links", "status", "service", "process_kind", "pid",
                "step_id", "request_id")


def _enc_hook(obj: Any) -> Any:
    # numpy scalars/arrays and tensors that slipped into a snapshot.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)


def to_json(obj: Any) -> str:
    return _encoder.encode(obj).decode()


def git_commit(path: str | None = None) -> str | None:
    """The commit of the checkout this package runs from, if it is one."""
    here = path or os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def connect(path: str) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN/COMMIT ourselves (short, explicit transactions).
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                           check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return conn


def connect_readonly(path: str) -> sqlite3.Connection:
    """A connection that reads a run store and never changes its files (the dashboard's,
    the reader's). Missing files raise sqlite3.OperationalError ("unable to open").

    NOTE: SQLite's `mode=ro` alone still writes the -shm file: a reader rebuilds
    a crashed writer's WAL index there and marks its reads in it. With
    `readonly_shm=1` the reader keeps what it needs in its own memory and reads
    every committed transaction, the WAL's included. A run store without a -wal
    is finished (the last writer checkpointed the WAL into the file and removed
    it on close: no writer has it open): it is opened `immutable=1` (no locks;
    no -wal or -shm looked for or created). A -wal without its -shm (a copy
    made without it) cannot be read in place without creating one: the reader
    gets a private copy of the two files, removed when the connection closes.
    """
    uri = "file:" + urllib.parse.quote(os.path.abspath(path))
    if not os.path.exists(path + "-wal"):
        try:
            return _ro_connect(uri + "?immutable=1")
        except sqlite3.OperationalError:
            if not os.path.exists(path + "-wal"):
                raise
            # a writer opened it in between: read it as a live run
    try:
        return _ro_connect(uri + "?mode=ro&readonly_shm=1")
    except sqlite3.OperationalError:
        if not os.path.exists(path):
            raise
        if not os.path.exists(path + "-wal"):            # the writer closed in between: finished now
            return _ro_connect(uri + "?immutable=1")
        if os.path.exists(path + "-shm"):
            raise
    return _private_copy(path)


def _ro_connect(uri: str, factory: type = sqlite3.Connection) -> sqlite3.Connection:
    conn: sqlite3.Connection = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                           check_same_thread=False, factory=factory)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()   # opening is lazy: fail here
    except sqlite3.Error:
        conn.close()
        raise
    return conn


class _CopyConnection(sqlite3.Connection):
    """A connection to a private copy of a run store; closing it removes the copy."""
    tmpdir: str | None = None

    def close(self) -> None:
        super().close()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def __del__(self) -> None:
        self.close()


def _private_copy(path: str) -> sqlite3.Connection:
    tmpdir = tempfile.mkdtemp(prefix="vllm_anatomy_ro_")
    copy = os.path.join(tmpdir, "run.sqlite")
    try:
        shutil.copyfile(path, copy)                        # (no writer: a writer would have the -shm)
        shutil.copyfile(path + "-wal", copy + "-wal")
        conn = _ro_connect("file:" + urllib.parse.quote(copy), _CopyConnection)
        assert isinstance(conn, _CopyConnection)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    conn.tmpdir = tmpdir
    return conn


class RunStore:
    """Writer side. `create` starts a run; `attach` joins one from another process.

    write_spans / write_snapshot / set_meta queue their rows for the writer
    thread; flush() returns once everything queued so far is committed."""

    # The writer commits this often (a live reader sees a step within it) ...
    COMMIT_INTERVAL_S = 0.1
    # ... or as soon as this many writes are queued.
    MAX_QUEUED = 256

    def __init__(self, path: str, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = conn     # None once closed
        self._queue: collections.deque[tuple[str, list[tuple]]] = collections.deque()
        self._cond = threading.Condition()
        self._queued = self._committed = 0      # items ever queued / ever committed
        self._closing = False
        self._flushing = 0                      # callers waiting in flush()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._writer_loop, name="RunStore-writer", daemon=True)
        self._thread.start()
        # NOTE: a process that never closes its store (a script, a test's
        # child) still commits what it queued, at interpreter exit.
        atexit.register(self.close)

    @classmethod
    def create(cls, trace_dir: str, meta: dict[str, Any]) -> "RunStore":
        os.makedirs(trace_dir, exist_ok=True)
        run_id = meta.get("run_id") or uuid.uuid4().hex[:12]
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = os.path.join(trace_dir, f"run-{stamp}-{run_id}.sqlite")
        conn = connect(path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        full = {"schema_version": SCHEMA_VERSION, "run_id": run_id, "start_time_ns": time.time_ns(),
                "git_commit": git_commit(), **meta}
        conn.execute("BEGIN IMMEDIATE")
        # NOTE: statement by statement: executescript() would COMMIT on its own.
        for stmt in filter(str.strip, _SCHEMA.split(";")):
            conn.execute(stmt)
        conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                         [(k, to_json(v)) for k, v in full.items()])
        conn.execute("COMMIT")
        return cls(path, conn)

    @classmethod
    def attach(cls, path: str) -> "RunStore":
        if not os.path.exists(path):
            raise FileNotFoundError(f"run store {path} does not exist (the creating process makes it)")
        conn = connect(path)
        conn.execute("PRAGMA synchronous=NORMAL")
        return cls(path, conn)

    def _write(self, sql: str, rows: list[tuple]) -> None:
        with self._cond:
            if self._error is not None:
                raise TraceStoreWriteError(f"run store {self.path}: an earlier write failed") from self._error
            if self._closing:
                return
            self._queue.append((sql, rows))
            self._queued += 1
            if len(self._queue) >= self.MAX_QUEUED:
                self._cond.notify_all()         # a burst: commit now rather than hold it all

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                # NOTE: woken by flush/close/a burst, else every COMMIT_INTERVAL_S:
                # one commit (and one hand-over of the GIL) per interval, not
                # one per snapshot (two per engine step at level full).
                self._cond.wait_for(lambda: self._closing or self._flushing or len(self._queue) >= self.MAX_QUEUED,
                                    timeout=self.COMMIT_INTERVAL_S)
                if not self._queue:
                    if self._closing:
                        return                      # closing, and nothing left
                    continue
                batch = list(self._queue)
                self._queue.clear()
            try:
                self._commit(batch)
            except BaseException as exc:            # noqa: BLE001  (kept, raised to the next caller)
                logger.exception("run store %s: write failed", self.path)
                with self._cond:
                    self._error = exc
                    self._committed += len(batch)
                    self._cond.notify_all()
                return
            with self._cond:
                self._committed += len(batch)
                self._cond.notify_all()

    def _commit(self, batch: list[tuple[str, list[tuple]]]) -> None:
        """One transaction for the whole batch; consecutive rows of one statement in one executemany."""
        conn = self._conn
        assert conn is not None, "the writer thread commits before close() drops the connection"
        conn.execute("BEGIN IMMEDIATE")
        try:
            for sql, group in itertools.groupby(batch, key=operator.itemgetter(0)):
                conn.executemany(sql, [row for _, rows in group for row in rows])
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def flush(self) -> None:
        """Wait until everything queued so far is committed (raise if a write failed)."""
        with self._cond:
            target = self._queued
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._committed < target and self._thread.is_alive():
                    self._cond.wait(0.5)
            finally:
                self._flushing -= 1
            if self._error is not None:
                raise TraceStoreWriteError(f"run store {self.path}: a write failed") from self._error

    def write_spans(self, rows: list[tuple]) -> None:
        marks = ", ".join("?" * len(SPAN_COLUMNS))
        self._write(f"INSERT OR REPLACE INTO spans ({', '.join(SPAN_COLUMNS)}) VALUES ({marks})", rows)

    def write_span_details(self, rows: list[tuple]) -> None:
        """(trace_id, span_id, scope_name, scope_version, status_message) rows."""
        self._write("INSERT OR REPLACE INTO span_details VALUES (?, ?, ?, ?, ?)", rows)

    def write_snapshot(self, step_id: int | None, kind: str, process: str, data: Any) -> None:
        """Encode `data` now (the state of this instant) and queue it."""
        row = (step_id, kind, process, time.time_ns(), to_json(data))
        self._write("INSERT INTO snapshots (step_id, kind, process, time_ns, data) VALUES (?, ?, ?, ?, ?)",
                    [row])

    def set_meta(self, key: str, value: Any) -> None:
        self._write("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                    [(key, to_json(value))])

    def close(self) -> None:
        """Commit what is queued, stop the writer, close the file (idempotent)."""
        with self._cond:
            if self._conn is None:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        atexit.unregister(self.close)
        if self._error is not None:
            raise TraceStoreWriteError(f"run store {self.path}: a write failed") from self._error


class TraceStoreWriteError(RuntimeError):
    """Writing the run store failed (the disk is full, the file was removed, ...)."""
