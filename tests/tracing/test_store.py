"""Run store and reader without a model: round trip, concurrent writers from two
processes, corrupt and wrong-version files give a clear TraceStoreError."""
import sqlite3
import subprocess
import sys

import pytest

from vllm_anatomy.tracing.reader import TraceStoreError, list_runs, open_run
from vllm_anatomy.tracing.store import SCHEMA_VERSION, SPAN_COLUMNS, RunStore, TraceStoreWriteError


def _span_row(i: int) -> tuple:
    return (f"{1:032x}", f"{i:016x}", None, f"span{i}", "internal", 100 + i, 200 + i,
            '{"vllm_anatomy.step_id": %d}' % i, "[]", "[]", "UNSET", "svc", "engine_core", 1, i, None)


def test_round_trip_and_listing(tmp_path):
    store = RunStore.create(str(tmp_path), {"model": "m", "device": "cpu", "config": {"a": 1}})
    assert len(_span_row(0)) == len(SPAN_COLUMNS)
    store.write_spans([_span_row(1), _span_row(2)])
    for step in (1, 2):
        store.write_snapshot(step, "model_runner", "w0", {"step": step})
        store.write_snapshot(step, "step", "core", {"step_id": step, "x": [1, 2]})
    store.write_snapshot(3, "model_runner", "w0", {"step": 3})   # a step whose "step" never came
    store.flush()                                              # queued for the writer thread until now
    with open_run(store.path) as run:                          # readable while still open for writing
        assert run.meta["schema_version"] == SCHEMA_VERSION and run.meta["config"] == {"a": 1}
        assert run.steps() == [1, 2]
        assert run.snapshot(2) == {"step_id": 2, "x": [1, 2]}
        assert run.snapshot(3, "model_runner") == {"step": 3}
        assert [s.name for s in run.spans()] == ["span1", "span2"]
        assert run.spans("span2")[0].step_id == 2
    store.close()
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    runs = list_runs(str(tmp_path))
    good = [r for r in runs if "error" not in r]
    assert [r["path"] for r in good] == [store.path] and good[0]["model"] == "m"
    assert any("not a vllm_anatomy run store" in r.get("error", "") for r in runs)


def test_corrupt_file_clear_error(tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"\x00garbage" * 1000)
    with pytest.raises(TraceStoreError, match="not a vllm_anatomy run store"):
        open_run(str(bad))
    other = tmp_path / "other.sqlite"                    # a valid SQLite file, not ours
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(TraceStoreError, match="not a vllm_anatomy run store"):
        open_run(str(other))
    with pytest.raises(TraceStoreError, match="no such run store"):
        open_run(str(tmp_path / "missing.sqlite"))


def test_wrong_version_clear_error(tmp_path):
    store = RunStore.create(str(tmp_path), {"model": "m"})
    store.set_meta("schema_version", SCHEMA_VERSION + 1)
    store.close()
    with pytest.raises(TraceStoreError, match=f"schema_version {SCHEMA_VERSION + 1}.*version {SCHEMA_VERSION}"):
        open_run(store.path)


_WRITER = """
import sys
from vllm_anatomy.tracing.store import RunStore
s = RunStore.attach(sys.argv[1])
for i in range(40):
    s.write_snapshot(i, "model_runner", sys.argv[2], {"i": i})
"""


def test_concurrent_writers_from_processes(tmp_path):
    store = RunStore.create(str(tmp_path), {"model": "m"})
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, store.path, f"w{k}"]) for k in range(2)]
    for i in range(40):
        store.write_snapshot(i, "step", "core", {"step_id": i})
    store.flush()
    assert all(p.wait(timeout=60) == 0 for p in procs)       # (they never close: committed at exit)
    with open_run(store.path) as run:
        snaps = list(run.snapshots())
        assert len(snaps) == 120
        assert sorted(s.process for s in snaps if s.kind == "model_runner") == ["w0"] * 40 + ["w1"] * 40
        assert run.steps() == list(range(40))


def test_writes_never_wait_for_sqlite(tmp_path):
    """The caller only queues: while another connection holds SQLite's write lock,
    write_snapshot returns at once (a synchronous write would wait busy_timeout,
    then fail); the snapshot is committed once the lock is released."""
    store = RunStore.create(str(tmp_path), {"model": "m"})
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")                       # the write lock, held
    data = {"step_id": 1, "rows": [1, 2, 3]}
    store.write_snapshot(1, "step", "core", data)
    data["rows"].append(4)                                 # encoded when written: later changes do not leak in
    assert other.execute("SELECT count(*) FROM snapshots").fetchone()[0] == 0
    other.execute("COMMIT")
    other.close()
    store.flush()
    with open_run(store.path) as run:
        assert run.snapshot(1) == {"step_id": 1, "rows": [1, 2, 3]}
    store.close()
    store.close()                                          # idempotent


def test_a_failed_write_is_raised_to_the_writer(tmp_path):
    store = RunStore.create(str(tmp_path), {"model": "m"})
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("DROP TABLE snapshots")
    other.close()
    store.write_snapshot(1, "step", "core", {"step_id": 1})
    with pytest.raises(TraceStoreWriteError, match="a write failed"):
        store.flush()
    with pytest.raises(TraceStoreWriteError, match="an earlier write failed"):
        store.write_snapshot(2, "step", "core", {"step_id": 2})
    with pytest.raises(TraceStoreWriteError):
        store.close()
