"""RunnerTracer: everything GPUModelRunner reports about a step, behind one object.

The model runner calls this object and nothing else of tracing (the engine's
side has its own seam, tracing/step_tracer.py). It offers
    span(name, **attrs)                a host span (GPUModelRunner.*), nothing more
    execute_model(scheduler_output), apply_grammar_bitmask(grammar_output)
                                       those two host spans, with their attributes
    phase(name, device_phase, **attrs) a host span and, on a GPU, a device mark
                                       with the same attributes: one call
    model_forward(decision)            phase("_model_forward") with the CUDA-graph decision
    compute_slot_mapping(num_reqs, num_tokens)  that kernel's launch, timed at level full
    sync_point(name, step_id, events)  the span around a step's one CPU-waits-for-device
                                       point; wait(event) inside it is the wait itself,
                                       after which the step's device-lane spans resolve
    device_mark(phase), take_device_events()   the D2H copy's marks (tracing/device_timer.py)
    propose_draft_token_ids(step_id, nothing_waits, **attrs)
                                       the draft model's proposal: the host span and, on a
                                       GPU, its device phase after the step's sampling (the
                                       step's tail: DeviceTimer.begin_tail / end_tail)
    flush()                            at shutdown: the device spans still waiting for the device
    kernel_timer                       always present: the DeviceTimer at level full on
                                       a GPU, else NULL_KERNEL_TIMER, whose `with` does nothing
    snapshots                          the snapshot observer: StepSnapshots at level full,
                                       else NULL_STEP_SNAPSHOTS, whose calls do nothing

NOTE: the trace level is read here, once, when the tracer is built: it picks
the null or the real kernel timer and snapshot observer. The runner computes
the same things at every level; the observer only reads what was computed
(the slot mapping included: copied from the device buffer the kernels read,
see StepSnapshots.prepare_inputs).
"""
from __future__ import annotations

import contextlib
import enum
import time
from typing import TYPE_CHECKING, Any, Callable, Final, Iterator, Literal

import numpy as np
import torch

from vllm_anatomy.tracing.device_timer import DeviceTimer
from vllm_anatomy.tracing.recorder import Recorder, paused_gc

if TYPE_CHECKING:
    from vllm_anatomy.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm_anatomy.worker.cudagraph import CudagraphDecision
    from vllm_anatomy.worker.gpu_model_runner import GPUModelRunner
    from vllm_anatomy.tracing.device_timer import StepEvents


class NullKernelTimer:
    """The kernel timer when kernel launches are not timed: each `with` does nothing.

    The same interface as tracing/device_timer.DeviceTimer's kernel() and
    interval(); `describe` (a callable returning the span's attributes) is
    never called, so an untimed launch computes no attributes either."""

    _NULL = contextlib.nullcontext()

    def kernel(self, name: str, describe: Callable[[], dict] | None = None) -> contextlib.nullcontext:
        return self._NULL

    def interval(self, span_name: str, **attrs: Any) -> contextlib.nullcontext:
        return self._NULL


NULL_KERNEL_TIMER = NullKernelTimer()

class _Sentinel(enum.Enum):
    TAKE_AT_WAIT = "take at wait"


# sync_point's default: the step's device events are those marked until the wait.
TAKE_AT_WAIT: Final = _Sentinel.TAKE_AT_WAIT


class RunnerTracer:

    def __init__(self, recorder: Recorder, device: torch.device) -> None:
        self.recorder = recorder
        self.device_timer = device_timer = DeviceTimer(device, recorder)
        self.device_type = device.type
        # Level full on a GPU: each kernel launch the engine makes gets a span.
        self.kernel_timer = device_timer if recorder.wants_snapshots and device_timer.enabled \
            else NULL_KERNEL_TIMER
        self.snapshots = StepSnapshots(recorder) if recorder.wants_snapshots else NULL_STEP_SNAPSHOTS
        # The sync point in progress: its step, its device events (TAKE_AT_WAIT: those marked until
        # the wait), and how long the host waited.
        self._sync_step_id = -1
        self._sync_events: StepEvents | None | Literal[_Sentinel.TAKE_AT_WAIT] = TAKE_AT_WAIT
        self.wait_s = 0.0

    def span(self, name: str, **attrs: Any) -> contextlib.AbstractContextManager:
        return self.recorder.span(name, **attrs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> contextlib.AbstractContextManager:
        attrs: dict[str, Any] = {"vllm_anatomy.step_id": scheduler_output.step_id,
                                 "vllm_anatomy.num_scheduled_tokens": scheduler_output.total_num_scheduled_tokens}
        self.device_timer.begin_step()        # (the engine step the device lane's spans join)
        return self.recorder.span("GPUModelRunner.execute_model", **attrs)

    def apply_grammar_bitmask(self, grammar_output: GrammarOutput) -> contextlib.AbstractContextManager:
        attrs: dict[str, Any] = {
            "vllm_anatomy.num_structured_output_reqs": len(grammar_output.structured_output_request_ids)}
        return self.recorder.span("GPUModelRunner.apply_grammar_bitmask", **attrs)

    def compute_slot_mapping(self, num_reqs: int, num_tokens: int) -> contextlib.AbstractContextManager:
        """The slot-mapping kernel's launch, timed at level full (one program per request + padding)."""
        return self.kernel_timer.kernel("compute_slot_mapping", lambda: {
            "vllm_anatomy.grid": [num_reqs + 1], "vllm_anatomy.num_tokens": num_tokens,
            "vllm_anatomy.bytes": num_tokens * 20 + num_reqs * 8})

    def phase(self, name: str, device_phase: str, **attrs: Any) -> contextlib.AbstractContextManager:
        """From here the device works on `device_phase` (a mark, GPU only); the host span `name`."""
        self.device_timer.mark(device_phase, **attrs)
        return self.recorder.span(name, **attrs)

    def model_forward(self, decision: CudagraphDecision) -> contextlib.AbstractContextManager:
        return self.phase("GPUModelRunner._model_forward", "model_forward", **{
            "vllm_anatomy.cudagraph_mode": decision.mode.name,
            "vllm_anatomy.num_padded_tokens": decision.num_padded_tokens,
            "vllm_anatomy.cudagraph_reason": decision.reason,
            "vllm_anatomy.cudagraph_reason_code": decision.reason_code.value})

    @contextlib.contextmanager
    def propose_draft_token_ids(self, step_id: int, nothing_waits: bool, **attrs: Any) -> Iterator[Any]:
        """The draft model's forwards (spec_decode/draft_model.py): the host span
        GPUModelRunner.propose_draft_token_ids and, on a GPU, the device phase
        GPU.propose_draft_token_ids, with one GPU.draft_model_forward per forward and, at level
        full, their kernels (the drafter's attention metadata carries kernel_timer). Every one
        of its device spans has `vllm_anatomy.drafter` true.

        NOTE: the drafter runs after the event the step's sync point waits for
        (after the wait itself without async scheduling, since it reads the
        verified tokens on the host): its device work is the step's tail, a phase
        outside GPU.step, made into spans once its last event has completed.
        nothing_waits (async scheduling): the drafts stay on the device and the
        step ends without waiting for them, so the phase follows from the step
        instead of lying within it."""
        timer = self.device_timer
        timer.begin_tail("propose_draft_token_ids", **attrs)
        try:
            with self.recorder.span("GPUModelRunner.propose_draft_token_ids", **attrs) as span:
                yield span
        finally:
            timer.end_tail(step_id, nothing_waits, **{"vllm_anatomy.drafter": True})

    def flush(self) -> None:
        """At shutdown: wait for the device work whose spans are still pending (a last step's tail)."""
        self.device_timer.resolve_tails(wait=True)

    def device_mark(self, phase: str) -> None:
        self.device_timer.mark(phase)

    def take_device_events(self) -> StepEvents | None:
        """The step's device events, kept for a sync point one step later (async scheduling)."""
        return self.device_timer.take()

    @contextlib.contextmanager
    def sync_point(self, name: str, step_id: int, events: StepEvents | None | Literal[_Sentinel.TAKE_AT_WAIT] = TAKE_AT_WAIT,
                   **attrs: Any) -> Iterator[None]:
        """The span of a step's sync point: how long the host waited (0 on a CPU) and on what device.

        events: the step's device events, taken when it was launched (async
        scheduling); by default those marked so far, taken at the wait."""
        self._sync_step_id, self._sync_events, self.wait_s = step_id, events, 0.0
        with self.recorder.span(name, **attrs) as span:
            yield
            span.set_attribute("vllm_anatomy.sync_wait_ms", self.wait_s * 1e3)
            span.set_attribute("vllm_anatomy.device", self.device_type)

    def wait(self, event: torch.cuda.Event) -> None:
        """event.synchronize(), timed; then the step's device marks become device-lane spans.

        NOTE: resolved right here: the instant the wait ends anchors the device clock."""
        t0 = time.perf_counter()
        event.synchronize()
        self.wait_s = time.perf_counter() - t0
        events = self.device_timer.take() if self._sync_events is TAKE_AT_WAIT else self._sync_events
        self.device_timer.resolve(self._sync_step_id, events, self.wait_s)


class StepSnapshots:
    """Level full: the worker's half of each step's snapshots ("model_runner").

    prepare_inputs() keeps what _prepare_inputs computed, as plain lists;
    take() reads GPUModelRunner.snapshot() (async scheduling: as the step is
    launched, before the next step changes the batch); record() adds what the
    step sampled and hands it to the recorder after the step's sync point."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def prepare_inputs(self, runner: GPUModelRunner, num_scheduled_tokens: np.ndarray, req_indices: np.ndarray,
                       cu_num_tokens: np.ndarray, arange: np.ndarray, token_indices: np.ndarray) -> dict:
        """What _prepare_inputs computed: its intermediate arrays, and what it left in the runner's buffers."""
        total, num_reqs = len(req_indices), len(num_scheduled_tokens)
        # (its "cudagraph" entry is added by _determine_batch_execution_and_padding, which runs next)
        return {
            "req_ids": list(runner.input_batch.req_ids), "num_scheduled_tokens": num_scheduled_tokens.tolist(),
            "req_indices": req_indices.tolist(), "cu_num_tokens": cu_num_tokens.tolist(),
            "arange": arange.tolist(), "positions": runner.positions.np[:total].tolist(),
            "token_indices": token_indices.tolist(), "input_ids": runner.input_ids.np[:total].tolist(),
            "query_start_loc": runner.query_start_loc.np[:num_reqs + 1].tolist(),
            "seq_lens": runner.seq_lens.np[:num_reqs].tolist(),
            "slot_mapping": _host_list(runner.input_batch.block_table.slot_mapping[:total]),
            "logits_indices": (cu_num_tokens - 1).tolist(),
            "discard_request_indices": runner.discard_request_indices.tolist(),
            "num_draft_tokens": []}     # spec decode: filled by record_spec_decode_inputs when the step has drafts

    def take(self, runner: GPUModelRunner) -> dict:
        with paused_gc():
            return runner.snapshot()

    def record(self, step_id: int, sampled_token_ids: list[list[int]], runner: GPUModelRunner | None = None,
               snapshot: dict | None = None) -> None:
        """Record the step's snapshot (`snapshot`: taken earlier by take(), else `runner`'s now)."""
        with paused_gc():
            if snapshot is None:
                assert runner is not None, "record() needs the snapshot or the runner"
                snapshot = runner.snapshot()
            snap = snapshot
            prepare_inputs = snap.get("prepare_inputs")
            if prepare_inputs is not None and isinstance(prepare_inputs["slot_mapping"], _DeviceCopy):
                prepare_inputs["slot_mapping"] = prepare_inputs["slot_mapping"].tolist()
            # What this step sampled, per batch row ([] for a partial prefill chunk).
            snap["sampled_token_ids"] = sampled_token_ids
            self.recorder.snapshot("model_runner", snap, step_id=step_id)


class _NullStepSnapshots:
    """Below level full: no snapshots, nothing kept."""

    def prepare_inputs(self, runner: GPUModelRunner, *computed: np.ndarray) -> None:
        return None

    def take(self, runner) -> None:
        return None

    def record(self, step_id: int, sampled_token_ids: list[list[int]], runner=None,
               snapshot: dict | None = None) -> None:
        pass


NULL_STEP_SNAPSHOTS = _NullStepSnapshots()


class _DeviceCopy:
    """A device tensor's values on their way to pinned host memory (read after the step's sync)."""
    __slots__ = ("host",)

    def __init__(self, device_tensor: torch.Tensor) -> None:
        self.host = torch.empty(device_tensor.shape, dtype=device_tensor.dtype, pin_memory=True)
        self.host.copy_(device_tensor, non_blocking=True)

    def tolist(self) -> list:
        return self.host.tolist()


def _host_list(tensor: torch.Tensor) -> list | _DeviceCopy:
    """The values a buffer holds now, as a list. NOTE: on a GPU, a non_blocking
    copy enqueued behind the kernel that writes them (reading them now would be
    a sync); record() reads it after the step's sync point, when it has run."""
    return _DeviceCopy(tensor) if tensor.is_cuda else tensor.tolist()
