"""Segments are named after their run's socket directory, and the directory's owner
can unlink those of a child that was SIGKILLed (unlink_shm_segments), and only those.

Checked in /dev/shm itself (Linux).
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile


import pytest

from vllm_anatomy.executor.shm_broadcast import MessageQueue, shm_name_prefix, unlink_shm_segments

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory listed in /dev/shm")


def _create_and_wait(ipc_dir: str, conn) -> None:
    """Child: create a queue (its segment and socket) in ipc_dir, report, then hang until killed."""
    mq = MessageQueue(1, 4096, 2, ipc_dir=ipc_dir)
    assert mq.buffer is not None                  # (a queue with a local reader has a segment)
    conn.send(mq.buffer.name)
    signal.pause()


@pytest.fixture
def short_dir():
    """A run-like directory in the temp dir (pytest's tmp_path is too long for a Unix socket path)."""
    path = tempfile.mkdtemp(prefix="vllm_anatomy_")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_segment_and_socket_are_named_after_the_directory(short_dir):
    tmp_path = short_dir
    mq = MessageQueue(1, 4096, 2, ipc_dir=str(tmp_path))
    try:
        assert mq.buffer.name.startswith(shm_name_prefix(str(tmp_path)))
        assert os.path.exists(f"/dev/shm/{mq.buffer.name}")
        # NOTE: the socket file stays short (a Unix socket path must fit 108 bytes).
        [sock] = os.listdir(tmp_path)
        assert sock.endswith(".sock") and len(os.path.join(tmp_path, sock)) < 108
    finally:
        mq.close()
    assert not os.path.exists(f"/dev/shm/{mq.buffer.name}") and os.listdir(tmp_path) == []


def test_owner_unlinks_the_segments_of_a_killed_child_and_no_other(short_dir):
    run_dir, other_dir = os.path.join(short_dir, "run"), os.path.join(short_dir, "run2")
    os.mkdir(run_dir)
    os.mkdir(other_dir)
    other = MessageQueue(1, 4096, 2, ipc_dir=other_dir)     # another run's queue, alive
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_create_and_wait, args=(run_dir, writer))
    child.start()
    try:
        assert reader.poll(60), "the child did not create its queue"
        name = reader.recv()
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        assert os.path.exists(f"/dev/shm/{name}")               # a killed creator leaves it behind
        assert unlink_shm_segments(run_dir) == [name]
        assert not os.path.exists(f"/dev/shm/{name}")
        assert os.path.exists(f"/dev/shm/{other.buffer.name}")   # not this run's: untouched
        assert unlink_shm_segments(run_dir) == []           # idempotent
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        other.close()
    assert not os.path.exists(f"/dev/shm/{other.buffer.name}")
