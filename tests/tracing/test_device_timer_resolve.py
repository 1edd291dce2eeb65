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
        marks: list[tuple[str, FakeEvent, dict, int]] = [
            (p, FakeEvent(t0 + i), {}, 0) for i, p in enumerate(["model_forward", "sample", "end"])]
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


# -- a step's tail (the draft model's forwards): begin_tail / end_tail / resolve_tails ---------------
class ClockEvent:
    """A CUDA event at a settable device time; `done` says whether the device has reached it."""
    now_ms = 0.0

    def __init__(self, **_) -> None:
        self.t_ms: float | None = None
        self.done = True

    def record(self, stream=None) -> None:
        self.t_ms = ClockEvent.now_ms

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: "ClockEvent") -> float:
        assert self.t_ms is not None and end.t_ms is not None, "an event never recorded (CUDA raises)"
        return end.t_ms - self.t_ms


def _timer(monkeypatch) -> tuple[InMemoryRecorder, DeviceTimer]:
    monkeypatch.setattr(torch.cuda, "Event", ClockEvent)
    rec = InMemoryRecorder("full")
    # The host's clock is the device's (a device that runs what is enqueued at once).
    monkeypatch.setattr(rec, "now_ns", lambda: int(ClockEvent.now_ms * 1e6))
    ClockEvent.now_ms = 0.0
    timer = DeviceTimer(torch.device("cpu"), rec)
    timer.enabled = True
    timer.calibrate()
    return rec, timer


def _step_with_tail(rec: InMemoryRecorder, timer: DeviceTimer, follows: bool, t0: float = 0.0):
    """A step's phases (taken and resolved at its sync), then its tail: a drafter phase with two
    forwards, each holding a kernel."""
    with rec.span("EngineCore.step") as step, rec.step_scope(step):
        timer.begin_step()
        for i, phase in enumerate(["model_forward", "sample", "end"]):
            ClockEvent.now_ms = t0 + i
            timer.mark(phase)
        timer.resolve(7, timer.take(), waited_s=1.0)
        ClockEvent.now_ms = t0 + 3
        timer.begin_tail("propose_draft_token_ids", k=1)
        for j in range(2):
            ClockEvent.now_ms = t0 + 3.5 + j
            with timer.interval("GPU.draft_model_forward", j=j):
                ClockEvent.now_ms += 0.25
                with timer.kernel("unified_attention", lambda: {"n": 5}):
                    ClockEvent.now_ms += 0.25
        ClockEvent.now_ms = t0 + 6
        timer.end_tail(7, follows, drafter=True)
    return step


def test_tail_is_a_phase_of_its_own_holding_its_forwards_and_their_kernels(monkeypatch):
    rec, timer = _timer(monkeypatch)
    step = _step_with_tail(rec, timer, follows=False)
    names = {s.name: s for s in rec.spans}
    (phase,) = [s for s in rec.spans if s.name == "GPU.propose_draft_token_ids"]
    forwards = [s for s in rec.spans if s.name == "GPU.draft_model_forward"]
    kernels = [s for s in rec.spans if s.name == "GPU.kernel.unified_attention"]
    # Outside GPU.step, directly under the step, after the target's phases; 3 ms long.
    assert phase.parent_id == step.span_id and phase.start_ns >= names["GPU.step"].end_ns
    assert phase.duration_ns == 3_000_000 and phase.attrs["k"] == 1 and phase.attrs["drafter"] is True
    assert [f.attrs["j"] for f in sorted(forwards, key=lambda s: s.start_ns)] == [0, 1]
    assert all(f.parent_id == phase.span_id and f.duration_ns == 500_000 for f in forwards)
    assert {k.parent_id for k in kernels} == {f.span_id for f in forwards}
    assert all(k.attrs == {**k.attrs, "n": 5, "drafter": True, "vllm_anatomy.step_id": 7} for k in kernels)
    assert not timer._tails and not timer.marks and not timer.intervals


def test_a_tail_still_running_waits_for_a_later_call_and_a_follower_does_not_nest(monkeypatch):
    """query() False: no spans yet, and no wait; a later call (the next step's launch) makes them
    once the device got there. follows: in the step's trace, linked to it, without a parent."""
    rec, timer = _timer(monkeypatch)
    reached = {"yes": False}
    monkeypatch.setattr(ClockEvent, "query", lambda self: reached["yes"])
    step = _step_with_tail(rec, timer, follows=True)
    assert not [s for s in rec.spans if "draft" in s.name] and len(timer._tails) == 1
    timer.begin_step()                                     # the next step's launch: still running
    assert len(timer._tails) == 1
    reached["yes"] = True
    timer.begin_step()
    (phase,) = [s for s in rec.spans if s.name == "GPU.propose_draft_token_ids"]
    assert phase.parent_id is None and phase.links == [(step.trace_id, step.span_id)]
    assert phase.trace_id == step.trace_id and not timer._tails
    assert len([s for s in rec.spans if s.name == "GPU.kernel.unified_attention"]) == 2


def test_flush_waits_for_a_last_tail(monkeypatch):
    rec, timer = _timer(monkeypatch)
    monkeypatch.setattr(ClockEvent, "query", lambda self: False)     # never seen complete without a wait
    _step_with_tail(rec, timer, follows=True)
    assert len(timer._tails) == 1
    timer.resolve_tails(wait=True)
    assert [s.name for s in rec.spans].count("GPU.propose_draft_token_ids") == 1 and not timer._tails
