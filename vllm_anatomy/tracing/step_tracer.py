"""StepTracer: the one object EngineCore tells about its steps.

EngineCore (engine/core.py) never writes a span, a link or a snapshot itself.
It gets a StepTracer from its Recorder (`recorder.step_tracer(...)`) and,
each step, one StepTrace that it tells where the step is:

    trace = step_tracer.start_step()            EngineCore.step opens (ended by trace.end())
    with trace:                                 what runs inside nests under the step
        with trace.schedule():                  Scheduler.schedule
            scheduler_output = scheduler.schedule()
        trace.scheduled(scheduler_output)       the step's attributes, links, grammar compiles;
                                                launch observers
        with trace.grammar_bitmask() as span:   Scheduler.get_grammar_bitmask
            ...; span.built(grammar_output)
        with trace.update_from_output():        Scheduler.update_from_output
            ...
        trace.updated()                         update observers
    trace.end()

What each recorder gets:
    NullRecorder (off)   NullStepTracer: every call is a no-op on one shared object.
    level spans          the spans above; the step links to every request it
                         serves (nesting would lie: a step serves many
                         requests), and each grammar compiled since the last
                         step becomes a span in its request's own trace.
    level full           also the KV manager's calls inside Scheduler.schedule
                         (traced.py) and, by an observer, the step's snapshot
                         (kind "step", with the block pool's events).

NOTE: the trace level decides what is recorded, never what the engine
computes: EngineCore makes the same calls in the same order at every level,
and everything here only reads the scheduler (the block pool's events and
the quiet-call count are drained, and exist only for this tracer).
"""
from __future__ import annotations

import contextlib
import operator
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import msgspec

from vllm_anatomy.tracing.kv_snapshotter import KVCacheSnapshotter
from vllm_anatomy.tracing.recorder import _NULL_SPAN, Recorder, SpanHandle, paused_gc
from vllm_anatomy.tracing.traced import QUIET_CALLS_ATTR, TracedCalls, trace_methods

if TYPE_CHECKING:
    from vllm_anatomy.core.sched.scheduler import Scheduler
    from vllm_anatomy.core.sched.output import GrammarOutput, SchedulerOutput

STEP_ID = "vllm_anatomy.step_id"
REQUEST_ID = "vllm_anatomy.request_id"
# The KV manager's methods that get spans at level full (traced.py).
TRACED_KV_CACHE_MANAGER_METHODS = ["get_computed_blocks", "allocate_slots"]

StepObserver = Callable[["SchedulerOutput"], None]
_TRACE_HEADERS = operator.attrgetter("trace_headers")


class StepSnapshotter:
    """Observer: the engine's half of a step's snapshot (kind "step").

    The KV cache part comes from a KVCacheSnapshotter (kv_snapshotter.py):
    what KVCacheManager.snapshot() returns, rebuilt only where it changed.
    NOTE: the worker records its own half ("model_runner") where it runs: in
    another process it could not be fetched without an extra round trip.
    """

    def __init__(self, recorder: Recorder, scheduler: Scheduler) -> None:
        self.recorder = recorder
        self.scheduler = scheduler
        self.kv_cache_snapshotter = KVCacheSnapshotter(scheduler.kv_cache_manager)

    def __call__(self, scheduler_output: SchedulerOutput) -> None:
        step_id = scheduler_output.step_id
        with paused_gc():
            self.recorder.snapshot("step", {
                "step_id": step_id,
                "time": time.time(),
                "scheduler_output": msgspec.to_builtins(scheduler_output),
                "scheduler": self.scheduler.snapshot(kv_cache=self.kv_cache_snapshotter.snapshot()),
                "block_pool_events": msgspec.to_builtins(self.scheduler.kv_cache_manager.take_block_pool_events()),
            }, step_id=step_id)


class StepTracer:
    """One per EngineCore: a StepTrace per step, observers of each step.

    `on_launch` observers see a step's SchedulerOutput as its forward is
    launched, `on_update` observers once update_from_output has run.
    """

    def __init__(self, recorder: Recorder, snapshot_at_launch: bool) -> None:
        self.recorder = recorder
        self.snapshot_at_launch = snapshot_at_launch
        self.links_requests = recorder.enabled
        # NOTE: EngineCore's scheduler, built after this tracer: set by watch(), before any step.
        self.scheduler: Scheduler
        self.traced_kv_calls: TracedCalls | None = None
        self.on_launch: list[StepObserver] = []
        self.on_update: list[StepObserver] = []
        # The requests the last step linked to, and their trace headers (request_headers).
        self._linked_req_ids: list[str] = []
        self._linked_headers: tuple[dict | None, ...] = ()

    @property
    def drains_kv_cache_events(self) -> bool:
        """Whether the block pool should keep its events: only if a snapshot
        takes them every step (else they would pile up)."""
        return self.recorder.wants_snapshots

    def watch(self, scheduler: Scheduler) -> None:
        """Start observing `scheduler` (EngineCore's, built after this tracer)."""
        self.scheduler = scheduler
        if not self.recorder.wants_snapshots:
            return
        self.traced_kv_calls = trace_methods(scheduler.kv_cache_manager, self.recorder, "KVCacheManager",
                                             TRACED_KV_CACHE_MANAGER_METHODS)
        # NOTE: with async scheduling the snapshot is taken as the step is
        # launched: by the time its output is processed the scheduler has
        # already planned the next step. Otherwise after update_from_output.
        observers = self.on_launch if self.snapshot_at_launch else self.on_update
        observers.append(StepSnapshotter(self.recorder, scheduler))

    @contextlib.contextmanager
    def add_request(self, request: Any) -> Iterator[None]:
        """`with tracer.add_request(request):` the EngineCore.add_request span.

        NOTE: parented on the request's own trace (its W3C context rides on
        the request), so this span joins the request's tree, not the caller's.
        A request refused inside leaves its span unended (unrecorded)."""
        span = self.recorder.start_span("EngineCore.add_request", trace_headers=request.trace_headers,
                                        **{REQUEST_ID: request.request_id})
        with self.recorder.use_span(span):
            yield
        span.end()

    def start_step(self) -> StepTrace:
        """Open the next step's EngineCore.step span (not current until `with trace:`)."""
        return StepTrace(self)

    def request_headers(self, scheduler_output: SchedulerOutput) -> tuple[dict | None, ...]:
        """The trace headers of the requests a step serves, in its order: what its span links to.

        NOTE: steady decoding serves the same requests in the same order step
        after step; then this is last step's own tuple, no request is looked
        up (at batch 256, 256 cache-cold look-ups per step), and the recorder
        reuses the links it made from it (OTelSpan.add_links). A step that
        schedules a new request looks them all up: it may reuse the id of a
        finished one."""
        req_ids = list(scheduler_output.num_scheduled_tokens)
        if scheduler_output.scheduled_new_reqs or req_ids != self._linked_req_ids:
            requests = self.scheduler.requests
            self._linked_req_ids = req_ids
            # ([requests[req_id].trace_headers for req_id in req_ids], as C-level passes)
            self._linked_headers = tuple(map(_TRACE_HEADERS, map(requests.__getitem__, req_ids)))
        return self._linked_headers

    def record_grammar_compiles(self, step_span: SpanHandle) -> None:
        """For each request whose grammar the last schedule() found compiled (or failed):
        its compile as a span in the request's own trace, and its state
        transition as an event on the step span that promoted it."""
        scheduler = self.scheduler
        requests = scheduler.requests
        for req_id in [*scheduler.last_grammar_ready_req_ids, *scheduler.grammar_compile_error_reqs]:
            request = requests[req_id]
            so = request.structured_output_request
            # NOTE: these requests' grammars were compiled (or failed): both times are set.
            assert so is not None and so.compile_start is not None and so.compile_end is not None
            failed = isinstance(so.grammar, Exception)
            span = self.recorder.start_span(
                "StructuredOutputManager._create_grammar", trace_headers=request.trace_headers,
                start_ns=self._engine_ns(so.compile_start), **{
                    REQUEST_ID: req_id,
                    "vllm_anatomy.structured_output_type": so.structured_output_key[0].name,
                    "vllm_anatomy.error": str(so.grammar) if failed else ""})
            span.end(self._engine_ns(so.compile_end))
            attrs: dict[str, Any] = {REQUEST_ID: req_id}
            step_span.add_event(f"WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR -> {'FINISHED_ERROR' if failed else 'WAITING'}",
                                **attrs)

    def _engine_ns(self, monotonic_s: float) -> int:
        """time.monotonic() seconds on the recorder's clock."""
        return self.recorder.now_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


class StepTrace:
    """One step's EngineCore.step span, and the spans of its phases under it.

    NOTE: the span is opened by start_step and ended by end(), called by
    whoever processes the step's output: with async scheduling that is the
    next engine step, so consecutive step spans overlap, as the steps do.
    """
    __slots__ = ("tracer", "span", "scheduler_output", "_scope")

    def __init__(self, tracer: StepTracer) -> None:
        self.tracer = tracer
        self.span = tracer.recorder.start_span("EngineCore.step")
        self.scheduler_output: SchedulerOutput | None = None
        self._scope: Any = None

    def __enter__(self) -> StepTrace:
        """Make the step span current (it stays open on exit)."""
        self._scope = self.tracer.recorder.use_span(self.span)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        scope, self._scope = self._scope, None
        return scope.__exit__(*exc)

    def schedule(self) -> _ScheduleSpan:
        return _ScheduleSpan(self.tracer)

    def scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """The step is planned: its attributes and links; then the launch observers."""
        self.scheduler_output = scheduler_output
        span, tracer = self.span, self.tracer
        span.set_attributes({STEP_ID: scheduler_output.step_id,
                             "vllm_anatomy.num_scheduled_tokens": scheduler_output.total_num_scheduled_tokens,
                             "vllm_anatomy.num_reqs": len(scheduler_output.num_scheduled_tokens)})
        if tracer.links_requests:
            span.add_links(tracer.request_headers(scheduler_output))
            tracer.record_grammar_compiles(span)
        for observe in tracer.on_launch:
            observe(scheduler_output)

    def _scheduled_output(self) -> SchedulerOutput:
        assert self.scheduler_output is not None, "the step is scheduled first"
        return self.scheduler_output

    def grammar_bitmask(self) -> _GrammarBitmaskSpan:
        return _GrammarBitmaskSpan(self.tracer.recorder, self._scheduled_output().step_id)

    def update_from_output(self) -> Any:
        attrs: dict[str, Any] = {STEP_ID: self._scheduled_output().step_id}
        return self.tracer.recorder.span("Scheduler.update_from_output", **attrs)

    def updated(self) -> None:
        """update_from_output has run: the update observers."""
        scheduler_output = self._scheduled_output()
        for observe in self.tracer.on_update:
            observe(scheduler_output)

    def end(self) -> None:
        self.span.end()


class _ScheduleSpan:
    """The Scheduler.schedule span; at level full it counts the KV manager's
    calls that got no span of their own (traced.py)."""
    __slots__ = ("scope", "span", "traced_kv_calls")

    def __init__(self, tracer: StepTracer) -> None:
        self.scope = tracer.recorder.span("Scheduler.schedule")
        self.traced_kv_calls = tracer.traced_kv_calls

    def __enter__(self) -> SpanHandle:
        self.span = self.scope.__enter__()
        return self.span

    def __exit__(self, *exc: Any) -> Any:
        if self.traced_kv_calls is not None and exc[0] is None:
            self.span.set_attribute(QUIET_CALLS_ATTR, self.traced_kv_calls.take_quiet())
        return self.scope.__exit__(*exc)


class _GrammarBitmaskSpan:
    """The Scheduler.get_grammar_bitmask span: the grammar window of the step timeline."""
    __slots__ = ("scope", "span")

    def __init__(self, recorder: Recorder, step_id: int) -> None:
        attrs: dict[str, Any] = {STEP_ID: step_id}
        self.scope = recorder.span("Scheduler.get_grammar_bitmask", **attrs)

    def __enter__(self) -> _GrammarBitmaskSpan:
        self.span = self.scope.__enter__()
        return self

    def built(self, grammar_output: GrammarOutput | None) -> None:
        self.span.set_attribute("vllm_anatomy.num_structured_output_reqs",
                                len(grammar_output.structured_output_request_ids) if grammar_output else 0)

    def __exit__(self, *exc: Any) -> Any:
        return self.scope.__exit__(*exc)


class NullStepTracer:
    """Tracing off: one shared step object whose every call does nothing."""
    drains_kv_cache_events = False

    def watch(self, scheduler: Scheduler) -> None:
        pass

    def add_request(self, request: Any) -> Any:
        return _NULL_SPAN

    def start_step(self) -> NullStepTrace:
        return _NULL_STEP_TRACE


class NullStepTrace:
    """StepTrace's calls, doing nothing; each phase is this same object."""
    __slots__ = ()

    def __enter__(self) -> NullStepTrace:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def schedule(self) -> NullStepTrace:
        return self

    def scheduled(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def grammar_bitmask(self) -> NullStepTrace:
        return self

    def built(self, grammar_output: GrammarOutput | None) -> None:
        pass

    def update_from_output(self) -> NullStepTrace:
        return self

    def updated(self) -> None:
        pass

    def end(self) -> None:
        pass


_NULL_STEP_TRACE = NullStepTrace()
