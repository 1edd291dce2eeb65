"""DeviceTimer: where a step's time went on the device, without an extra sync.

CUDA events are recorded between the step's device phases (H2D copies of the
prepared inputs, the forward, logits, sampling, the D2H copy of the sampled
ids). Reading an event's time needs the device to have reached it — so they are
read only after the step's one existing sync point (`_bookkeeping_sync`; with
async scheduling AsyncGPUModelRunnerOutput.get_output, one step later), when
all of them have: `take()` detaches a step's events at its end, `resolve()`
turns them into spans after its sync. The spans go to the recorder with explicit timestamps on the
"device" lane.

Finer grain, where the step runs eager (not a CUDA graph replay):
- each decoder layer gets a span `GPU.layer` (forward hooks on the layers);
- at trace level `full`, each kernel launch the engine makes itself
  (compute_slot_mapping, reshape_and_cache, unified_attention per layer) gets
  a span `GPU.kernel.<name>` with its grid, token count and bytes moved.
A full graph replay is one span (`GPU.model_forward` with cudagraph_mode FULL
and the padded size): events cannot be recorded between a graph's kernels. A
piecewise replay (PIECEWISE) has no layer spans either (the layers' hooks run
only at capture), but its eager attention kernels are timed at level full.

The spans nest as the work ran: one `GPU.step` span per step, from its first
event to its last, holds the phases; `GPU.model_forward` holds the layers; a
layer holds its kernels and collectives (a kernel outside every layer sits in
its phase). GPU.step is a child of the step's EngineCore.step span (the step the
recorder names when the step is launched: Recorder.current_step), which lasts
from scheduling to the update after the sync, so it covers the device's work:
on the article's step timeline the device lane runs beside the host's, inside
the step. A rank that does not reply makes its GPU.step a follower of the step
instead (nothing waits for it).

NOTE: device and host clocks differ; we anchor the device timeline at the sync:
the last event completed just before `synchronize()` returned, so a mark's host
time is `t_sync - elapsed(mark, last)`. (Anchoring at the first *enqueue* would
be wrong: the device may start the step long after the CPU enqueued it.) An
estimate is kept between when its event was recorded on the host (the device
cannot have reached it earlier) and the sync (it had by then): both bounds grow
in stream order, as the estimates do, so clamping keeps every nesting.
On a CPU there is no device lane: every op runs synchronously on the host, and
the host spans (GPUModelRunner._model_forward, ...) are that timeline.

A step's tail: device work the step enqueues after the event its sync point
waits for — the draft model's forwards (speculative decoding), which run after
the target's sampling: begin_tail / end_tail put them in a phase of their own
(GPU.propose_draft_token_ids), outside GPU.step, resolved once its last event
has completed (resolve_tails: event.query(), no wait). It is a child of the
step when the step waits for it (the drafts read on the host), else a
follower of the step (async scheduling: nothing in the step waits for it).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple

import torch

from vllm_anatomy.tracing.recorder import Recorder


class DeviceTimer:

    def __init__(self, device: torch.device, recorder: Recorder) -> None:
        self.recorder = recorder
        self.enabled = recorder.enabled and device.type == "cuda"
        # True while CUDA graphs are captured: an event recorded then would be
        # baked into the graph, so no marks, layer or kernel spans at all.
        self.capturing = False
        # (phase, event, attributes, host ns the event was recorded at)
        self.marks: list[tuple[str, torch.cuda.Event, dict, int]] = []
        # (name, start event, end event, attributes, host ns the start event was recorded at) of layers and kernels.
        self.intervals: list[tuple[str, torch.cuda.Event, torch.cuda.Event, dict, int]] = []
        self._layer_start: tuple[torch.cuda.Event, int] | None = None
        # The engine step the marks belong to (Recorder.current_step at launch; see begin_step).
        self.step: Any = None
        # (event, host ns it completed at): links device and host clocks.
        self._anchor: tuple[torch.cuda.Event, int] | None = None
        # Events of resolved steps, recorded again by later marks (see resolve).
        self._spare: list[torch.cuda.Event] = []
        # The open tail (begin_tail): where its marks and intervals start, and its step.
        self._tail_from: tuple[int, int] | None = None
        self._tail_step: Any = None
        # Closed tails whose spans wait for their last event to complete (resolve_tails).
        self._tails: list[Tail] = []

    @property
    def active(self) -> bool:
        return self.enabled and not self.capturing

    def _event(self) -> torch.cuda.Event:
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin_step(self) -> None:
        """A step is being launched: the engine step its device work belongs to."""
        if self.enabled:
            self.step = self.recorder.current_step()
            if self._tails:
                self.resolve_tails()          # (the last step's, complete by now as a rule)

    def mark(self, phase: str, **attrs: Any) -> None:
        """The device work enqueued from here on belongs to `phase` (until the next mark)."""
        if self.active:
            if not self.marks:          # a new step: drop layer spans of dummy/warm-up runs
                self.intervals.clear()
            self.marks.append((phase, self._event(), attrs, self.recorder.now_ns()))

    @contextlib.contextmanager
    def kernel(self, name: str, describe: Callable[[], dict] | None = None) -> Iterator[None]:
        """Time one kernel launch as `GPU.kernel.<name>`, with describe()'s attributes (eager steps only).

        NOTE: the runner hands this timer to the kernels only at level full
        (tracing/runner_tracer.py; below it they get a NullKernelTimer)."""
        if not self.active:
            yield
            return
        host_ns, start = self.recorder.now_ns(), self._event()
        yield
        self.intervals.append((f"GPU.kernel.{name}", start, self._event(), describe() if describe else {}, host_ns))

    @contextlib.contextmanager
    def interval(self, span_name: str, **attrs: Any) -> Iterator[None]:
        """Time the device work enqueued inside as `span_name` (eager steps only):
        a collective (tracing/collectives.py), when kernel() is not the word."""
        if not self.active:
            yield
            return
        host_ns, start = self.recorder.now_ns(), self._event()
        yield
        self.intervals.append((span_name, start, self._event(), attrs, host_ns))

    def watch_layers(self, layers: torch.nn.ModuleList) -> None:
        """Per-layer spans through forward hooks (cheap no-ops when tracing is off)."""
        if not self.enabled:
            return
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._layer_pre_hook)
            layer.register_forward_hook(lambda _m, _a, _o, i=i: self._layer_post_hook(i))

    def _layer_pre_hook(self, _module, _args) -> None:
        if self.active:
            self._layer_start = (self._event(), self.recorder.now_ns())

    def _layer_post_hook(self, index: int) -> None:
        if self.active and self._layer_start is not None:
            start, host_ns = self._layer_start
            self.intervals.append(("GPU.layer", start, self._event(), {"vllm_anatomy.layer": index}, host_ns))
            self._layer_start = None

    def calibrate(self) -> None:
        """A first anchor, taken at start-up while the device is idle: an event
        and the host time its synchronize returned (no step waits for this)."""
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            event.synchronize()
            self._anchor = (event, self.recorder.now_ns())

    def take(self) -> "StepEvents | None":
        """Hand over the finished step's events (call after its last mark);
        the next step's marks start afresh. None when there is nothing to time."""
        if not self.enabled or len(self.marks) < 2:
            self.marks.clear()
            self.intervals.clear()
            return None
        events = StepEvents(self.marks, self.intervals, self.step)
        self.marks, self.intervals = [], []
        return events

    def resolve(self, step_id: int, events: "StepEvents | None", waited_s: float) -> None:
        """After the step's sync point: turn its events into device-lane spans.

        NOTE: the anchor. When the host really waited at the sync (waited_s),
        the step's last event completed just before the wait ended: that
        instant links the two clocks. With async scheduling the wait is often
        zero (the step finished while the host was busy elsewhere), and then
        the newest good anchor — an event of an earlier step and its host
        time — places this step's events instead, by event-to-event time.
        """
        if events is None:
            return
        t_sync = self.recorder.now_ns()
        last = events.marks[-1][1]
        if waited_s >= self.ANCHOR_MIN_WAIT_S or self._anchor is None:
            if self._anchor is not None:
                self._spare.append(self._anchor[0])     # (read no more: a new anchor replaces it)
            self._anchor = (last, t_sync)
            at = lambda ev: t_sync - int(ev.elapsed_time(last) * 1e6)  # noqa: E731  (host ns of an event)
        else:
            at = self._from_anchor(last, t_sync)
        # (an event completed after it was recorded on the host, and before the sync returned)
        when = lambda ev, host_ns: min(max(at(ev), host_ns), t_sync)  # noqa: E731
        common = _device_attrs(step_id)
        # NOTE: a phase ends at the next one's mark: each mark's time is read once
        # (an elapsed_time call each), not once as an end and again as a start.
        times = [when(ev, host_ns) for _, ev, _, host_ns in events.marks]
        recorder = self.recorder
        gpu_step = recorder.start_span("GPU.step", start_ns=times[0], **_where(events.step), **common)
        # (start, end, handle) of the phases and layers, the parents of what ran inside them
        holders: list[tuple[int, int, Any]] = []
        for (phase, _, attrs, _), start, end in zip(events.marks, times, times[1:]):
            holders.append((start, end, recorder.record_span(f"GPU.{phase}", start, end, parent=gpu_step,
                                                             **common, **attrs)))
        self._record_intervals(events.intervals, when, holders, gpu_step, common)
        gpu_step.end(times[-1])
        self._recycle(events)
        if self._tails:
            self.resolve_tails()          # (tails enqueued before this step's last event: complete)

    def _record_intervals(self, intervals: list, when: Callable[[Any, int], int],
                          holders: list[tuple[int, int, Any]], default: Any, common: dict[str, Any]) -> None:
        """The spans of timed intervals, each in the innermost holder that holds it (`default`
        if none): the holding intervals first (HOLDER_SPANS, outer kinds first: one kind never
        holds its own), then the rest."""
        recorder = self.recorder
        resolved = [(name, when(start, host_ns), when(end, host_ns), attrs)
                    for name, start, end, attrs, host_ns in intervals]
        for kind in HOLDER_SPANS:
            holders += [(b, e, recorder.record_span(name, b, e, parent=_innermost(holders, b, e, default),
                                                    **common, **attrs))
                        for name, b, e, attrs in resolved if name == kind]
        for name, b, e, attrs in resolved:
            if name not in HOLDER_SPANS:
                recorder.record_span(name, b, e, parent=_innermost(holders, b, e, default), **common, **attrs)

    # -- a step's tail: work enqueued after the event its sync point waits for ----------------
    def begin_tail(self, phase: str, **attrs: Any) -> None:
        """The device work enqueued from here on is the current step's `phase`, after its sync
        point's event (the step's own events may have been taken already), until end_tail."""
        if self.active:
            num_marks = len(self.marks)
            self.mark(phase, **attrs)            # (clears stray intervals if the step's were taken)
            self._tail_from = (num_marks, len(self.intervals))
            self._tail_step = self.recorder.current_step()

    def end_tail(self, step_id: int, follows: bool, **attrs: Any) -> None:
        """Close the open tail: its spans come once its last event has completed (resolve_tails).
        follows: nothing in the step waits for this work, so its spans follow from the step
        instead of lying within it. attrs: added to every span of the tail."""
        if not self.active or self._tail_from is None:
            return
        self.mark("end")
        num_marks, num_intervals = self._tail_from
        events = StepEvents(self.marks[num_marks:], self.intervals[num_intervals:], self._tail_step)
        del self.marks[num_marks:], self.intervals[num_intervals:]
        self._tail_from = self._tail_step = None
        self._tails.append(Tail(step_id, events, follows, attrs))
        self.resolve_tails()

    def resolve_tails(self, wait: bool = False) -> None:
        """Turn closed tails into spans, oldest first, as far as their last event has completed.

        NOTE: event.query() asks the device without waiting: a tail still running
        stays for the next call (the next step's launch or sync point, after which
        it has completed). wait=True waits for them (at shutdown: nothing runs then)."""
        while self._tails:
            last = self._tails[0].events.marks[-1][1]
            if wait:
                last.synchronize()
            elif not last.query():
                return
            self._resolve_tail(self._tails.pop(0))

    def _resolve_tail(self, tail: "Tail") -> None:
        """A completed tail's spans: its phases, directly under the step (or following from it),
        and the intervals inside them. Placed by event-to-event time from the newest anchor
        (no wait dates its last event), and before now (it has completed)."""
        t_done = self.recorder.now_ns()
        events = tail.events
        last = events.marks[-1][1]
        if self._anchor is None:
            self._anchor = (last, t_done)
        at = self._from_anchor(last, t_done)
        when = lambda ev, host_ns: min(max(at(ev), host_ns), t_done)  # noqa: E731
        common = _device_attrs(tail.step_id) | tail.attrs
        times = [when(ev, host_ns) for _, ev, _, host_ns in events.marks]
        where = _where(events.step, tail.follows)
        holders: list[tuple[int, int, Any]] = []
        for (phase, _, attrs, _), start, end in zip(events.marks, times, times[1:]):
            span = self.recorder.start_span(f"GPU.{phase}", start_ns=start, **where, **common, **attrs)
            span.end(end)
            holders.append((start, end, span))
        self._record_intervals(events.intervals, when, holders, holders[0][2], common)
        self._recycle(events)

    def _from_anchor(self, last: Any, t_end: int) -> Callable[[Any], int]:
        """Host ns of events recorded after the anchor's, by event-to-event time from it.

        NOTE: whatever the anchor's error, `last` (the events' last) had completed
        by t_end: never place it later than that (the shift moves all of them)."""
        assert self._anchor is not None
        ref, ref_ns = self._anchor
        shift = min(0, t_end - (ref_ns + int(ref.elapsed_time(last) * 1e6)))
        return lambda ev: ref_ns + int(ref.elapsed_time(ev) * 1e6) + shift

    def _recycle(self, events: "StepEvents") -> None:
        """Keep a resolved step's events for later marks.

        NOTE: every one of them has completed (this runs after the step's sync
        point) and its time has been read, so recording it again is safe; the
        anchor's event is the exception, as later steps still time against it.
        A step's ~6 events are then one cudaEventRecord each, not a creation
        and, once collected, a destruction too."""
        anchor = self._anchor[0] if self._anchor is not None else None
        spare = self._spare
        for _, event, _, _ in events.marks:
            if event is not anchor:
                spare.append(event)
        for _, start, end, _, _ in events.intervals:
            spare.append(start)
            spare.append(end)
        del spare[self.MAX_SPARE_EVENTS:]

    # Spare events kept for reuse (an eager prefill step times ~90 layers and kernels at level full).
    MAX_SPARE_EVENTS = 512
    # A wait at least this long means the device was still busy when the host
    # arrived, so the wait's end dates the step's last event.
    ANCHOR_MIN_WAIT_S = 20e-6


# Intervals that hold others, outer kinds first: a draft model forward its kernels (and its layers,
# were they timed), a decoder layer its kernels.
HOLDER_SPANS = ("GPU.draft_model_forward", "GPU.layer")


def _device_attrs(step_id: int) -> dict[str, Any]:
    """The attributes every device-lane span of a step has."""
    return {"vllm_anatomy.lane": "device", "vllm_anatomy.step_id": step_id, "vllm_anatomy.timing": "cuda_event"}


def _where(step: Any, follows: bool = False) -> dict[str, Any]:
    """Where a step's device spans go: under its EngineCore.step, or following from it when
    nothing waits for them (a rank that does not reply, a tail nothing in the step waits for)."""
    if step is None:
        return {}
    return {"follows_from": step.headers} if step.follows or follows else {"trace_headers": step.headers}


def _innermost(holders: list[tuple[int, int, Any]], start: int, end: int, default: Any) -> Any:
    """The shortest of `holders` ((start, end, handle)) that holds [start, end], else `default`."""
    best, best_len = default, None
    for b, e, handle in holders:
        if b <= start and end <= e and (best_len is None or e - b < best_len):
            best, best_len = handle, e - b
    return best


class StepEvents(NamedTuple):
    """One step's CUDA events, kept until its sync point (one step later with async scheduling),
    and the engine step they belong to (Recorder.current_step when it was launched)."""
    marks: list
    intervals: list
    step: Any = None


class Tail(NamedTuple):
    """A step's tail (DeviceTimer.begin_tail / end_tail), closed, until its spans are made."""
    step_id: int
    events: StepEvents
    follows: bool               # nothing in the step waits for it: follow from the step, do not nest
    attrs: dict                 # added to each of its spans
