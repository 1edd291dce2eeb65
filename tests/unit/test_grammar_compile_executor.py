"""GrammarCompileExecutor (issue 29): grammar compiles at low priority, within a CPU-time
budget, cancelled when nobody waits for them any more, and never starving the next task.

The tasks here are Python functions standing in for xgrammar's C++ compile (which
cannot be interrupted either): a busy loop burns CPU time, an Event holds a task
running.
"""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import CancelledError

import pytest

from vllm_anatomy.structured_output.compile_executor import (CANCEL_POLL_S, GrammarCompileExecutor,
                                                             GrammarCompileTimeout, compile_budget)


def burn(stop: threading.Event, seconds: float = 30.0) -> str:
    """Use CPU until `stop` is set (or `seconds` pass)."""
    end = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < end:
        sum(range(1000))
    return "burnt"


def wait_until(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def executor():
    ex = GrammarCompileExecutor(1, max_abandoned=1, thread_name_prefix="test_compile")
    yield ex
    ex.shutdown()


def test_result_and_exception_reach_the_future(executor):
    assert executor.submit(lambda a, b: a + b, 2, 3).result(timeout=20) == 5
    with pytest.raises(ZeroDivisionError):
        executor.submit(lambda: 1 / 0).result(timeout=20)


def test_cpu_budget_fails_the_future_and_frees_the_slot(executor):
    stop = threading.Event()
    slow = executor.submit(burn, stop, timeout=0.2)
    with pytest.raises(GrammarCompileTimeout, match="CPU time"):
        slow.result(timeout=60)
    # Abandoned: its thread still burns, but the next task runs at once.
    assert executor.num_abandoned == 1 and executor.num_running == 0
    assert executor.submit(lambda: "next").result(timeout=20) == "next"
    stop.set()
    wait_until(lambda: executor.num_abandoned == 0)


def test_a_queued_task_spends_no_budget(executor):
    gate = threading.Event()
    first = executor.submit(gate.wait, 30)
    queued = executor.submit(lambda: "ran", timeout=0.05)
    time.sleep(0.3)                     # much longer than its budget, waiting in the queue
    assert executor.num_queued == 1 and not queued.done()
    gate.set()
    assert first.result(timeout=20) is True and queued.result(timeout=20) == "ran"


def test_cancel_a_queued_task_drops_it(executor):
    gate, ran = threading.Event(), threading.Event()
    executor.submit(gate.wait, 30)
    queued = executor.submit(ran.set)
    assert queued.cancel()
    gate.set()
    time.sleep(0.2)
    assert not ran.is_set() and executor.num_queued == 0


def test_cancel_a_running_task_abandons_it(executor):
    gate = threading.Event()
    running = executor.submit(gate.wait, 30)
    wait_until(lambda: executor.num_running == 1)
    assert running.cancel()             # possible although it runs: never marked running
    with pytest.raises(CancelledError):
        running.result(timeout=1)
    assert executor.num_abandoned == 1
    assert executor.submit(lambda: "next").result(timeout=20) == "next"
    gate.set()
    wait_until(lambda: executor.num_abandoned == 0)


def test_cancel_if_cancels_within_the_poll_interval(executor):
    gate, aborted = threading.Event(), threading.Event()
    future = executor.submit(gate.wait, 30, cancel_if=aborted.is_set)
    wait_until(lambda: executor.num_running == 1)
    t0 = time.monotonic()
    aborted.set()
    wait_until(future.cancelled, timeout=10)
    assert time.monotonic() - t0 < 10 * CANCEL_POLL_S + 2.0     # (a loaded machine: generous)
    gate.set()


def test_abandoned_threads_are_capped(executor):
    gates = [threading.Event() for _ in range(3)]
    first = executor.submit(gates[0].wait, 30)
    wait_until(lambda: executor.num_running == 1)
    first.cancel()                      # abandoned 1 (= max_abandoned)
    second = executor.submit(gates[1].wait, 30)
    wait_until(lambda: executor.num_running == 1)
    second.cancel()                     # abandoned 2 > cap: the next task must wait
    third = executor.submit(lambda: "third")
    time.sleep(0.2)
    assert not third.done() and executor.num_queued == 1
    gates[0].set()                      # one abandoned thread ends: room again
    assert third.result(timeout=20) == "third"
    gates[1].set()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")
def test_compile_threads_run_at_a_lower_priority(executor):
    def my_nice() -> int:
        tid = threading.get_native_id()
        with open(f"/proc/self/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])
    main_nice = my_nice()
    assert executor.submit(my_nice).result(timeout=20) >= min(19, main_nice + 10)


def test_compile_budget_leaves_half_the_cpus(monkeypatch):
    import os
    for cpus, expected in [(1, (1, 1)), (2, (1, 1)), (16, (4, 2)), (128, (4, 8))]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert compile_budget() == expected
