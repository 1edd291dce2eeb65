"""GrammarCompileExecutor: the thread pool grammars compile in, with time budgets and cancellation.

Ours; vLLM 0.27.1's StructuredOutputManager uses a plain ThreadPoolExecutor
((cpus + 1) // 2 threads, and xgrammar's own 8 threads per compile). What this adds,
and why (issue 29: one user's schema compiled for 48 s while everyone else's
stream dropped from 12 to 1 token/s):

  * Lower CPU priority. Each compile thread lowers its own scheduling priority
    (Linux: nice is per thread; xgrammar's helper threads inherit it), so when
    the forward pass and a compile want the same core, the forward pass gets it.
  * A budget per task (`timeout`): past `timeout` seconds of the compile
    thread's own CPU time, the Future fails with GrammarCompileTimeout. CPU time,
    not wall time: what is bounded is the cost of the grammar, whatever the
    load of the machine (a low-priority thread on a busy machine may wait long
    for its turn, and its client may give up: that cancels it).
  * Cancellation: `future.cancel()` works whether the task is queued or already
    running (the Future is never marked running), and `cancel_if` (polled every
    CANCEL_POLL_S while the task lives) cancels it when, say, its request was
    aborted. A queued task is simply dropped.

NOTE: a compile already inside xgrammar's C++ cannot be interrupted. A task that
times out or is cancelled while running is *abandoned*: its Future is finished at
once, its worker slot is freed for the next task, and its thread runs on, at the
low priority, until the C++ call returns; the result is dropped. At most
`max_abandoned` such threads exist at a time; beyond that, new tasks wait in the
queue (where their budget does not run). The limits in limits.py keep abandoned
compiles rare.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger(__name__)

# How often a task's cancel_if is asked (seconds).
CANCEL_POLL_S = 0.05
# The nice increment of compile threads: at 10 a thread gets ~10 % of a core that
# a normal-priority thread also wants (CFS weights 110 vs 1024).
COMPILE_NICE = 10


class GrammarCompileTimeout(RuntimeError):
    """A compile (or validation) used up its time budget without finishing.

    NOTE: not a TimeoutError: concurrent.futures' timeout *is* TimeoutError, and a
    poll that waits 100 us for a Future (StructuredOutputRequest) must not take
    this failure for "not done yet"."""


def compile_budget() -> tuple[int, int]:
    """(workers, threads per compile) for this machine: together at most half the
    CPUs this process may use, so the forward pass keeps the other half (vLLM: half
    the CPUs for the pool, and 8 xgrammar threads per compile on top)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    budget = max(1, cpus // 2)
    workers = min(4, budget)
    return workers, max(1, min(8, budget // workers))


def lower_thread_priority(increment: int) -> None:
    """Raise this thread's nice value by `increment` (Linux only: elsewhere
    setpriority would renice the whole process)."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError:
        pass


def _thread_cpu_clock() -> int | None:
    """The calling thread's CPU-time clock (None where there is none)."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


@dataclass(eq=False)
class _Task:
    future: Future
    fn: Callable[..., Any]
    args: tuple
    timeout: float | None            # seconds of CPU time (wall time where there is no CPU clock)
    cancel_if: Callable[[], bool] | None
    abandoned: bool = False
    running: bool = False
    started_at: float = 0.0          # time.monotonic() when its thread started
    cpu_clock: int | None = None     # its thread's CPU-time clock, once running
    on_failure: Callable[[BaseException], None] | None = None

    def fail(self, error: BaseException) -> None:
        """on_failure, then the Future (unless it has already ended)."""
        if self.future.done():
            return
        if self.on_failure is not None:
            try:
                self.on_failure(error)
            except Exception:  # noqa: BLE001 - the Future must still end
                logger.exception("on_failure of a grammar compile failed")
        try:
            self.future.set_exception(error)
        except InvalidStateError:
            pass

    def time_used(self, now: float) -> float:
        """Seconds counted against the timeout so far (0 while queued)."""
        if not self.running:
            return 0.0
        if self.cpu_clock is not None:
            try:
                return time.clock_gettime(self.cpu_clock)
            except OSError:          # the thread has just ended
                return 0.0
        return now - self.started_at


class GrammarCompileExecutor:
    """submit(fn, *args, timeout=, cancel_if=) -> Future; at most max_workers run at once."""

    def __init__(self, max_workers: int, *, max_abandoned: int | None = None, nice: int = COMPILE_NICE,
                 thread_name_prefix: str = "grammar_compile") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self.max_workers = max_workers
        self.max_abandoned = max_workers * 2 if max_abandoned is None else max_abandoned
        self.nice = nice
        self.thread_name_prefix = thread_name_prefix
        self._cond = threading.Condition()
        self._queue: collections.deque[_Task] = collections.deque()
        self._running: set[_Task] = set()
        self._num_abandoned = 0
        self._num_started = 0
        self._shutdown = False
        self._watchdog: threading.Thread | None = None

    # -- public ---------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
               cancel_if: Callable[[], bool] | None = None,
               on_failure: Callable[[BaseException], None] | None = None) -> Future:
        """on_failure(error) runs before the Future fails (fn raised, or its budget ran
        out), so whoever sees the Future done also sees what on_failure recorded."""
        future: Future = Future()
        task = _Task(future, fn, args, timeout if timeout is not None and timeout > 0 else None, cancel_if,
                     on_failure=on_failure)
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot submit after shutdown")
            self._queue.append(task)
            self._start_queued()
            self._ensure_watchdog()
            self._cond.notify_all()
        future.add_done_callback(lambda f: self._on_done(task))
        return future

    @property
    def num_abandoned(self) -> int:
        """Threads still running a compile whose Future already ended (timed out or cancelled)."""
        return self._num_abandoned

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def shutdown(self) -> None:
        """Cancel what is queued; running compiles end on their own (their threads are daemons)."""
        with self._cond:
            self._shutdown = True
            queued, self._queue = list(self._queue), collections.deque()
            self._cond.notify_all()
        for task in queued:
            task.future.cancel()

    # -- internals ------------------------------------------------------------
    def _start_queued(self) -> None:
        """Start queued tasks while a worker slot (and an abandoned-thread slot) is free. Holds _cond."""
        while (self._queue and len(self._running) < self.max_workers
               and self._num_abandoned + len(self._running) < self.max_workers + self.max_abandoned):
            task = self._queue.popleft()
            if task.future.done():
                continue
            task.running, task.started_at = True, time.monotonic()
            self._running.add(task)
            self._num_started += 1
            threading.Thread(target=self._run, args=(task,), daemon=True,
                             name=f"{self.thread_name_prefix}_{self._num_started}").start()

    def _run(self, task: _Task) -> None:
        task.cpu_clock = _thread_cpu_clock()
        lower_thread_priority(self.nice)
        result: Any = None
        error: BaseException | None = None
        try:
            result = task.fn(*task.args)
        except BaseException as e:  # noqa: BLE001 - handed to the Future's owner
            error = e
        with self._cond:
            if task.abandoned:
                self._num_abandoned -= 1
            else:
                self._running.discard(task)
            self._start_queued()
            self._cond.notify_all()
        if task.abandoned:
            logger.info("An abandoned grammar compile ended after its request had gone (%s).",
                        "failed" if error is not None else "result dropped")
            return
        if error is not None:
            task.fail(error)
            return
        try:
            task.future.set_result(result)
        except InvalidStateError:
            pass    # cancelled or timed out meanwhile

    def _on_done(self, task: _Task) -> None:
        """The Future ended: if it was cancelled or timed out, drop or abandon its task."""
        if not (task.future.cancelled() or isinstance(task.future.exception(), GrammarCompileTimeout)):
            return
        with self._cond:
            if task in self._running:
                self._running.discard(task)
                task.abandoned = True
                self._num_abandoned += 1
            elif not task.running:
                try:
                    self._queue.remove(task)
                except ValueError:
                    pass
            self._start_queued()
            self._cond.notify_all()

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"{self.thread_name_prefix}_watchdog")
            self._watchdog.start()

    def _watch(self) -> None:
        """Expire tasks past their budget and cancel those whose cancel_if says so."""
        while True:
            with self._cond:
                if self._shutdown:
                    return
                now = time.monotonic()
                live = [t for t in (*self._queue, *self._running) if not t.future.done()]
                expired, wake_at = [], []
                for task in live:
                    if task.timeout is None or not task.running:
                        continue
                    left = task.timeout - task.time_used(now)
                    if left <= 0:
                        expired.append(task)
                    else:       # (CPU time runs at most as fast as wall time)
                        wake_at.append(now + left)
                if any(t.cancel_if is not None for t in live):
                    wake_at.append(now + CANCEL_POLL_S)
                if not expired:
                    self._cond.wait(max(0.001, min(wake_at) - now) if wake_at else None)
            # NOTE: outside the lock: finishing a Future runs its callbacks (_on_done takes the lock).
            for task in expired:
                task.fail(GrammarCompileTimeout(f"it did not compile within {task.timeout:g} s of CPU time"))
            for task in self._tasks_to_cancel():
                task.future.cancel()

    def _tasks_to_cancel(self) -> list[_Task]:
        with self._cond:
            tasks = [t for t in (*self._queue, *self._running) if t.cancel_if is not None and not t.future.done()]
        out = []
        for task in tasks:
            try:
                if task.cancel_if is not None and task.cancel_if():
                    out.append(task)
            except Exception:  # noqa: BLE001 - a broken predicate must not stop the watchdog
                logger.exception("cancel_if of a grammar compile failed")
        return out

