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
