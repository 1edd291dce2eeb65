"""The device lane on a CPU, for tests: CUDA events stood in for by the host's clock.

The device lane (tracing/device_timer.py) needs CUDA events, so a CPU run records none.
`emulate_device_lane(monkeypatch)` gives the tracing code events whose time is the host's
at record(): on a CPU every op has run by the time the host records the event after it,
so these times are when the work before them finished, as a CUDA event's are. The
engine itself is not touched: only the timer's events (torch.cuda.Event), the one
stream the output copy of async scheduling takes (torch.cuda.stream / current_stream),
and the DeviceTimer's `enabled` (CUDA only) are replaced; `attach(llm)` then gives the
runner the transfer event (sync) or copy stream (async) a GPU runner has, so that the
step's sync point waits on an event and resolves the step's device spans.

Used by tests/kernel_tests/test_drafter_device_lane.py, with the Triton backend in
Triton's interpreter, whose kernel launches get spans as on a GPU.
"""
from __future__ import annotations

import contextlib
import time
from typing import cast

import pytest
import torch

from vllm_anatomy.tracing import device_timer, runner_tracer


class HostClockEvent:
    """torch.cuda.Event's surface, timed by the host's clock at record()."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.t_ns: int | None = None

    def record(self, stream=None) -> None:
        self.t_ns = time.perf_counter_ns()

    def query(self) -> bool:
        return self.t_ns is not None

    def synchronize(self) -> None:
        assert self.t_ns is not None, "synchronize() on an event never recorded"

    def elapsed_time(self, end: "HostClockEvent") -> float:
        assert self.t_ns is not None and end.t_ns is not None, "elapsed_time() of an event never recorded"
        return (end.t_ns - self.t_ns) / 1e6


class HostStream:
    """torch.cuda.Stream's surface for the output copy: on a CPU nothing is ever behind."""

    def wait_stream(self, other: "HostStream") -> None:
        pass


class HostDeviceTimer(device_timer.DeviceTimer):
    """The DeviceTimer, enabled on a CPU (its events: HostClockEvent).

    NOTE: no wait dates an event here. On a GPU, a host that waited on the sync
    point's event (>= ANCHOR_MIN_WAIT_S) arrived before the device got there, so
    the wait's end is when the step's last event completed. A HostClockEvent
    completed when it was recorded, and its synchronize() waits on nothing: any
    time it seems to take is the host's own noise (a collection, the other thread
    of a 2-core machine running first). Taken as a wait, that noise dated a step's
    last event at the sync point, which with async scheduling is a whole step
    later (seconds, in Triton's interpreter). Every step is placed from the anchor
    calibrate() takes at start-up instead: on the host's clock, as the events are.
    """

    ANCHOR_MIN_WAIT_S = float("inf")
    CALIBRATION_READS = 5

    def __init__(self, device: torch.device, recorder) -> None:
        super().__init__(device, recorder)
        self.enabled = recorder.enabled

    def calibrate(self) -> None:
        """The anchor, exact: an event's host-clock time and the recorder's clock read beside it.

        NOTE: DeviceTimer.calibrate reads the recorder's clock after the event's synchronize():
        on a GPU the time a sync takes to return. Here that gap is noise, and it stays in every
        span placed from the anchor: a 46 us gap on a busy 2-core CI machine put a drafter's
        phase, resolved right after its last event, before its own step's GPU.step ended. The
        event's time is read between two reads of the recorder's clock instead, and the closest
        pair of a few tries is kept."""
        if not self.enabled:
            return
        event = HostClockEvent(enable_timing=True)                   # (what torch.cuda.Event is here)
        best: tuple[int, int, int] | None = None                     # (gap, event ns, host ns)
        for _ in range(self.CALIBRATION_READS):
            before = self.recorder.now_ns()
            t_ns = time.perf_counter_ns()
            after = self.recorder.now_ns()
            if best is None or after - before < best[0]:
                best = (after - before, t_ns, (before + after) // 2)
        assert best is not None
        event.t_ns = best[1]
        self._anchor = (cast(torch.cuda.Event, event), best[2])     # (the stand-in is its event type here)


def emulate_device_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, runners built on a CPU have a device lane (undone with the monkeypatch)."""
    monkeypatch.setattr(torch.cuda, "Event", HostClockEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: HostStream())
    monkeypatch.setattr(runner_tracer, "DeviceTimer", HostDeviceTimer)


def attach(llm) -> None:
    """Give an in-process CPU engine's runner what its sync point waits on, as on a GPU."""
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    assert runner.device.type == "cpu" and isinstance(runner.tracer.device_timer, HostDeviceTimer)
    runner.transfer_event = HostClockEvent()
    if runner.use_async_scheduling:
        runner.async_output_copy_stream = HostStream()
