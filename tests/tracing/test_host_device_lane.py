"""The CPU stand-in for the device lane (tests/host_device_lane.py) keeps the host's clock.

A step resolved one step after its last mark (async scheduling) must end where that mark
was recorded, even when the sync point seems to have waited: on a CPU, nothing is waited
for, and a wait's length is noise. (CI once saw a drafter's phase placed 3.7 s before its
step's GPU.step ended, because a noisy synchronize() re-anchored the device clock at the
sync point.)"""
import time

import pytest
import torch

from tests.host_device_lane import HostDeviceTimer, emulate_device_lane
from vllm_anatomy.tracing.recorder import InMemoryRecorder


def test_a_late_sync_that_seems_to_wait_does_not_move_the_step():
    rec = InMemoryRecorder("spans")
    with pytest.MonkeyPatch.context() as mp:
        emulate_device_lane(mp)
        timer = HostDeviceTimer(torch.device("cpu"), rec)
        timer.calibrate()
        recorded = []
        for phase in ("prepare_inputs", "model_forward", "sample", "end"):
            timer.mark(phase)
            recorded.append(rec.now_ns())
            time.sleep(0.002)
        events = timer.take()
        time.sleep(0.05)                                    # the next step runs; its sync point resolves this one
        timer.resolve(1, events, waited_s=0.01)             # (a synchronize() that took 10 ms of noise)
    by_name = {s.name: s for s in rec.spans}
    step = by_name["GPU.step"]
    assert step.end_ns <= recorded[-1] + 1_000_000           # where the last mark was recorded, not 50 ms later
    assert recorded[0] - 1_000_000 <= step.start_ns <= recorded[0] + 1_000_000
    assert by_name["GPU.model_forward"].duration_ns >= 2_000_000


def test_calibration_keeps_no_noise_between_the_event_and_the_host_clock(monkeypatch):
    """CI once saw a drafter's phase (resolved right after its last event) start 46 us before its
    step's GPU.step ended: calibrate() read the host clock after a synchronize() that, on a busy
    CPU, took that long to return, and every span placed from the anchor moved late by it. Here
    the synchronize takes 5 ms; an event recorded later must still be placed where it was."""
    rec = InMemoryRecorder("spans")
    emulate_device_lane(monkeypatch)
    from tests.host_device_lane import HostClockEvent

    def slow_synchronize(self) -> None:
        time.sleep(0.005)
    monkeypatch.setattr(HostClockEvent, "synchronize", slow_synchronize)
    timer = HostDeviceTimer(torch.device("cpu"), rec)
    timer.calibrate()
    event = HostClockEvent(enable_timing=True)
    event.record()
    recorded = rec.now_ns()
    placed = timer._from_anchor(event, recorded + 10**9)(event)
    assert abs(placed - recorded) < 1_000_000, (placed - recorded) / 1e6      # within 1 ms, not 5
