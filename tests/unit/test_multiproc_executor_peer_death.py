"""MultiprocExecutor._get_response: a rank's error reply that is the echo of another rank's death
(its collective lost the peer) is raised as that death, not as the rank's error; an error with
every worker alive is the rank's own. The monitor thread is not started, so this is the race the
integration test (test_killed_worker_fails_the_next_step_fast) loses on a loaded machine when
the replying rank is faster than the monitor. No engine, no model: real processes, fake queues."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace
from typing import cast

import msgspec
import pytest

from vllm_anatomy.executor.multiproc_executor import BackgroundResources, MultiprocExecutor
from vllm_anatomy.executor.shm_broadcast import MessageQueue
from vllm_anatomy.executor.worker_proc import RPCResponse, WorkerProcHandle


def _sleep_forever() -> None:
    time.sleep(600)


class OneReply:
    """A reply queue that holds one error reply (what rank 0 sends when its all-reduce failed)."""

    def dequeue(self, timeout, cancel, decoder=None) -> RPCResponse:
        return RPCResponse("FAILURE", msgspec.Raw(b"\xc0"), "RuntimeError: gloo: Connection reset by peer")


def executor_over(procs: list) -> MultiprocExecutor:
    ex = object.__new__(MultiprocExecutor)          # its fields only: no workers started here
    ex.resources = BackgroundResources(None)
    ex.shutdown_event = ex.resources.shutdown_event
    # Stand-ins: _get_response reads only a worker's .proc and .rank, and a reply queue's dequeue.
    ex.workers = cast("list[WorkerProcHandle]", [SimpleNamespace(proc=p, rank=r) for r, p in enumerate(procs)])
    ex.response_mqs = cast("list[MessageQueue]", [OneReply() for _ in procs])
    ex.is_failed, ex.failure_message, ex.failure_callback = False, None, None
    return ex


@pytest.fixture
def procs():
    ctx = multiprocessing.get_context("spawn")
    ps = [ctx.Process(target=_sleep_forever, name=f"VllmWorker-{r}", daemon=True) for r in range(2)]
    for p in ps:
        p.start()
    yield ps
    for p in ps:
        if p.is_alive():
            p.kill()
        p.join(5)


def test_error_reply_after_a_peer_died_is_raised_as_the_death(procs):
    ex = executor_over(procs)
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(5)
    with pytest.raises(RuntimeError, match=r"VllmWorker-1 \(rank 1, pid \d+\) died unexpectedly with exit code -9"):
        ex._get_response("execute_model", [0], None, True)
    assert ex.is_failed and ex.shutdown_event.is_set()


def test_error_reply_with_every_worker_alive_is_the_ranks_own(procs):
    ex = executor_over(procs)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)Worker \(rank 0\) failed in execute_model\..*Connection reset"):
        ex._get_response("execute_model", [0], None, True)
    assert not ex.is_failed
    assert time.monotonic() - t0 < 5                 # a short wait for a death, not a hang
