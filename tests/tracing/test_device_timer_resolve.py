"""DeviceTimer.resolve without a GPU: fake CUDA events with known device times.

The device lane's phases are back to back (a phase ends where the next one's
mark is), each lasts its events' elapsed time, and each mark's time is read
from the device once (elapsed_time is a device call)."""
import torch

from vllm_anatomy.tracing.recorder import InMemoryRecorder
from vllm_anatomy.tracing.device_timer import DeviceTimer, StepEvents


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
    marks = [(p, FakeEvent(t), {"k": i} if p == "model_forward" else {}, 0)
             for i, (p, t) in enumerate(zip(phases, times))]
    layer = ("GPU.layer", FakeEvent(2.0), FakeEvent(3.0), {"vllm_anatomy.layer": 0}, 0)
    FakeEvent.calls = 0
    timer.resolve(7, StepEvents(marks, [layer]), waited_s=1.0)
    assert FakeEvent.calls == len(marks) + 2                 # one read per mark, two for the layer
    spans = rec.spans[:-1]
    (gpu_step,) = [s for s in rec.spans if s.name == "GPU.step"]
    assert rec.spans[-1] is gpu_step                          # (ended last, after what it holds)
    assert [s.name for s in spans] == [f"GPU.{p}" for p in phases[:-1]] + ["GPU.layer"]
    for s, nxt in zip(spans[:4], spans[1:5]):
        assert s.end_ns == nxt.start_ns                       # back to back
    durations = [s.duration_ns for s in spans[:5]]
    assert durations == [int(round((b - a) * 1e6)) for a, b in zip(times, times[1:])]
    assert spans[1].attrs["k"] == 1 and spans[0].attrs["vllm_anatomy.step_id"] == 7
    assert spans[5].duration_ns == 1_000_000 and spans[5].attrs["vllm_anatomy.lane"] == "device"
    # Nested as they ran: the phases in GPU.step, the layer in GPU.model_forward.
    assert all(s.parent_id == gpu_step.span_id for s in spans[:5]) and spans[5].parent_id == spans[1].span_id
    assert (gpu_step.start_ns, gpu_step.end_ns) == (spans[0].start_ns, spans[4].end_ns)


def test_estimates_stay_between_host_record_and_sync():
    """An event cannot complete before the host recorded it, nor after the sync returned:
    an anchor that places it outside is clamped, and the nesting holds."""
    rec = InMemoryRecorder("spans")
    timer = DeviceTimer(torch.device("cpu"), rec)
    now = rec.now_ns()
    # Device times put the first mark 5 ms before the sync; the host recorded it 1 ms before.
    marks = [("prepare_inputs", FakeEvent(0.0), {}, now - 1_000_000), ("model_forward", FakeEvent(1.0), {}, now - 900_000),
             ("end", FakeEvent(5.0), {}, now - 800_000)]
    timer.resolve(3, StepEvents(marks, [("GPU.layer", FakeEvent(0.5), FakeEvent(2.0), {}, now - 950_000)]), waited_s=1.0)
    by_name = {s.name: s for s in rec.spans}
    step, prep, fwd, layer = (by_name[n] for n in ("GPU.step", "GPU.prepare_inputs", "GPU.model_forward", "GPU.layer"))
    assert step.start_ns == prep.start_ns >= now - 1_000_000 and fwd.start_ns >= now - 900_000
    assert step.start_ns <= prep.start_ns <= prep.end_ns == fwd.start_ns <= fwd.end_ns == step.end_ns
    assert layer.start_ns >= now - 950_000 and layer.end_ns <= fwd.end_ns


def test_resolved_events_are_reused_but_never_the_anchor():
    """After resolve, a step's events are spare for later marks, except the one
    later steps still time against (the anchor); a replaced anchor is spare too."""
    rec = InMemoryRecorder("spans")
    timer = DeviceTimer(torch.device("cpu"), rec)

    def step(t0: float) -> StepEvents:
        marks = [(p, FakeEvent(t0 + i), {}, 0) for i, p in enumerate(["model_forward", "sample", "end"])]
        return StepEvents(marks, [("GPU.layer", FakeEvent(t0), FakeEvent(t0 + 0.5), {}, 0)])

    first = step(0.0)
    timer.resolve(1, first, waited_s=1.0)                     # waited: its last event is the anchor
    anchor = timer._anchor[0]
    assert anchor is first.marks[-1][1]
    assert anchor not in timer._spare and len(timer._spare) == 4
    second = step(10.0)
    timer.resolve(2, second, waited_s=0.0)                    # no wait: timed against the anchor, kept
    assert timer._anchor[0] is anchor and anchor not in timer._spare and len(timer._spare) == 9
    third = step(20.0)
    timer.resolve(3, third, waited_s=1.0)                     # a new anchor; the old one is spare now
    assert timer._anchor[0] is third.marks[-1][1] and anchor in timer._spare
    assert timer._anchor[0] not in timer._spare
    assert len({id(e) for e in timer._spare}) == len(timer._spare)   # none twice
