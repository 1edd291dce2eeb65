"""DeviceTimer.resolve without a GPU: fake CUDA events with known device times.

The device lane's phases are back to back (a phase ends where the next one's
mark is), each lasts its events' elapsed time, and each mark's time is read
from the device once (elapsed_time is a device call)."""
import torch

from vllm_anatomy.tracing.recorder import InMemoryRecorder
from vllm_anatomy.worker.device_timer import DeviceTimer, StepEvents


class FakeEvent:
    calls = 0

    def __init__(self, t_ms: float) -> None:
        self.t_ms = t_ms

    def elapsed_time(self, end: "FakeEvent") -> float:
        FakeEvent.calls += 1
        return end.t_ms - self.t_ms


def test_phases_back_to_back_one_read_per_mark():
    rec = InMemoryRecorder("spans")
    timer = DeviceTimer(torch.device("cpu"), rec)
    times = [0.0, 1.5, 4.0, 4.25, 6.0, 6.5]
    phases = ["prepare_inputs", "model_forward", "compute_logits", "sample", "d2h", "end"]
    marks = [(p, FakeEvent(t), {"k": i} if p == "model_forward" else {}) for i, (p, t) in enumerate(zip(phases, times))]
    layer = ("GPU.layer", FakeEvent(2.0), FakeEvent(3.0), {"vllm_anatomy.layer": 0})
    FakeEvent.calls = 0
    timer.resolve(7, StepEvents(marks, [layer]), waited_s=1.0)
    assert FakeEvent.calls == len(marks) + 2                 # one read per mark, two for the layer
    spans = rec.spans
    assert [s.name for s in spans] == [f"GPU.{p}" for p in phases[:-1]] + ["GPU.layer"]
    for s, nxt in zip(spans[:4], spans[1:5]):
        assert s.end_ns == nxt.start_ns                       # back to back
    durations = [s.duration_ns for s in spans[:5]]
    assert durations == [int(round((b - a) * 1e6)) for a, b in zip(times, times[1:])]
    assert spans[1].attrs["k"] == 1 and spans[0].attrs["vllm_anatomy.step_id"] == 7
    assert spans[5].duration_ns == 1_000_000 and spans[5].attrs["vllm_anatomy.lane"] == "device"
