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
        trace.updated(outputs)                  update observers; the outputs carry the step's
                                                trace context (EngineCoreOutputs.trace_headers)
    trace.end()

What each recorder gets:
    NullRecorder (off)   NullStepTracer: every call is a no-op on one shared object.
    level spans          the spans above; the step links to every request it
                         serves (nesting would lie: a step serves many
                         requests), and each grammar compiled since the last
                         step becomes a span in its request's own trace; when a
                         request finishes, a `Request` span in its own trace (its
                         life in the engine, from EngineCore.add_request) links to
                         every step that scheduled it. While a step is current
                         (`with trace:`) the recorder's step_scope names it: the
                         device lane hangs its GPU.step span under it.
    level full           also the KV manager's calls inside Scheduler.schedule
                         (traced.py) and, by an observer, the step's snapshot
                         (kind "step", with the block pool's events); with async
                         scheduling, a step that verified drafts also gets a
                         late one when updated (kind "spec_decode").

NOTE: the trace level decides what is recorded, never what the engine
computes: EngineCore makes the same calls in the same order at every level,
and everything here only reads the scheduler (the block pool's events and
the quiet-call count are drained, and exist only for this tracer).
"""
from __future__ import annotations

import operator
import time
from typing import TYPE_CHECKING, Any, Callable

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


class _RequestLife:
    """A request inside EngineCore, for its `Request` span: its trace, when it came, and
    the step lists it was part of.

    NOTE: `epochs` holds lists shared by every request of one batch composition: a step
    appends its headers to the current composition's list once (not once per request),
    and a request reads all of its lists once, when it finishes."""
    __slots__ = ("headers", "start_ns", "epochs")

    def __init__(self, headers: dict | None, start_ns: int) -> None:
        self.headers, self.start_ns = headers, start_ns
        self.epochs: list[list[dict]] = []


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


class SpecDecodeSnapshotter:
    """Observer (async scheduling): a step's verifications, once its output is processed
    (kind "spec_decode", only for a step that scheduled drafts).

    NOTE: with async scheduling the "step" snapshot is taken at launch, before the
    step is verified: its drafts are -1 placeholders (a draft model keeps them on the
    device) and its step record has no verifications yet. By update time
    EngineCore has put the verified drafts over the placeholders
    (Scheduler.update_draft_token_ids_in_output) and update_from_output has
    judged them (scheduler.last_spec_decode_records): this late row, under the
    same step id, holds both.
    """

    def __init__(self, recorder: Recorder, scheduler: Scheduler) -> None:
        self.recorder = recorder
        self.scheduler = scheduler

    def __call__(self, scheduler_output: SchedulerOutput) -> None:
        if not scheduler_output.scheduled_spec_decode_tokens:
            return
        step_id = scheduler_output.step_id
        self.recorder.snapshot("spec_decode", {
            "step_id": step_id,
            "time": time.time(),
            "scheduled_spec_decode_tokens": msgspec.to_builtins(scheduler_output.scheduled_spec_decode_tokens),
            "spec_decode": msgspec.to_builtins(self.scheduler.last_spec_decode_records),
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
        # Requests in the engine (for their Request span), and the step headers of the
        # current batch composition (see _RequestLife).
        self.lives: dict[str, _RequestLife] = {}
        self._epoch: list[dict] = []

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
        if self.snapshot_at_launch:
            self.on_update.append(SpecDecodeSnapshotter(self.recorder, scheduler))

    def add_request(self, request: Any) -> _AddRequestSpan:
        """`with tracer.add_request(request):` the EngineCore.add_request span.

        NOTE: in the request's own trace (its W3C context rides on the request), not
        the caller's: a child of its llm_request span when that is current (the
        frontend adds it in this process, and waits), else a follower of it
        (another process: the frontend may finish the request first, e.g. when its
        client goes away). A request refused inside leaves its span unended (unrecorded)."""
        return _AddRequestSpan(self, request)

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
            # A new batch composition: a new list of step headers for its requests' Request spans.
            self._epoch = []
            lives = self.lives
            for req_id in req_ids:
                life = lives.get(req_id)
                if life is not None:
                    life.epochs.append(self._epoch)
        return self._linked_headers

    def end_requests(self, req_ids: Any) -> None:
        """Requests that finished in the engine (EngineCore also calls it for those it
        aborts): each one's Request span, in its own trace (a follower of its
        llm_request: the frontend may have finished it first), from
        EngineCore.add_request to now, linked to every step that scheduled it."""
        lives = self.lives
        # NOTE: requests that ran together share their epochs' lists (a whole batch
        # finishing at once shares all of them): their step headers are gathered once,
        # into one tuple, from which the recorder makes the links once (OTelSpan.add_links).
        # Keyed by the lists' ids, kept alive by the value for the call.
        gathered: dict[tuple[int, ...], tuple[list, tuple[dict, ...]]] = {}
        for req_id in [r for r in req_ids if r in lives]:
            life = lives.pop(req_id)
            key = tuple(map(id, life.epochs))
            hit = gathered.get(key)
            if hit is None:
                hit = gathered[key] = (life.epochs, tuple([h for epoch in life.epochs for h in epoch]))
            steps = hit[1]
            attrs: dict[str, Any] = {REQUEST_ID: req_id, "vllm_anatomy.num_steps": len(steps)}
            span = self.recorder.start_span("Request", follows_from=life.headers, start_ns=life.start_ns, **attrs)
            span.add_links(steps)
            span.end()

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
            # (a follower of its llm_request: the frontend, maybe in another process, waits for nothing)
            compile_attrs: dict[str, Any] = {
                REQUEST_ID: req_id, "vllm_anatomy.structured_output_type": so.structured_output_key[0].name,
                "vllm_anatomy.error": str(so.grammar) if failed else ""}
            span = self.recorder.start_span(
                "StructuredOutputManager._create_grammar", follows_from=request.trace_headers,
                start_ns=self._engine_ns(so.compile_start), **compile_attrs)
            span.end(self._engine_ns(so.compile_end))
            attrs: dict[str, Any] = {REQUEST_ID: req_id}
            step_span.add_event(f"WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR -> {'FINISHED_ERROR' if failed else 'WAITING'}",
                                **attrs)

    def _engine_ns(self, monotonic_s: float) -> int:
        """time.monotonic() seconds on the recorder's clock."""
        return self.recorder.now_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


class _AddRequestSpan:
    """StepTracer.add_request (a class, not a generator: entered once per request)."""
    __slots__ = ("tracer", "request", "headers", "start_ns", "span", "scope")

    def __init__(self, tracer: StepTracer, request: Any) -> None:
        self.tracer, self.request = tracer, request

    def __enter__(self) -> None:
        recorder = self.tracer.recorder
        self.start_ns = recorder.now_ns()
        self.headers = headers = self.request.trace_headers
        where: dict[str, Any] = ({"trace_headers": headers} if recorder.is_current(headers)
                                 else {"follows_from": headers})
        attrs: dict[str, Any] = {REQUEST_ID: self.request.request_id}
        self.span = recorder.start_span("EngineCore.add_request", **where, **attrs)
        self.scope = recorder.use_span(self.span)
        self.scope.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.scope.__exit__(*exc)
        if exc[1] is not None:
            return                          # (refused: its span stays unended, unrecorded)
        self.span.end()
        tracer = self.tracer
        if tracer.links_requests and self.headers:
            tracer.lives[self.request.request_id] = _RequestLife(self.headers, self.start_ns)


class StepTrace:
    """One step's EngineCore.step span, and the spans of its phases under it.

    NOTE: the span is opened by start_step and ended by end(), called by
    whoever processes the step's output: with async scheduling that is the
    next engine step, so consecutive step spans overlap, as the steps do.
    """
    __slots__ = ("tracer", "span", "scheduler_output", "_scope", "_step_scope", "_headers")

    def __init__(self, tracer: StepTracer) -> None:
        self.tracer = tracer
        # NOTE: a root: a step is its own trace, whatever span its caller has open.
        self.span = tracer.recorder.start_span("EngineCore.step", root=True)
        self.scheduler_output: SchedulerOutput | None = None
        self._scope: Any = None
        self._step_scope: Any = None
        self._headers: dict | None = None

    def __enter__(self) -> StepTrace:
        """Make the step span current (it stays open on exit), and the step being worked on.
        (Entered up to three times a step, one after the other: the step scope, which can be
        entered again, is made once.)"""
        recorder = self.tracer.recorder
        if self._step_scope is None:
            self._step_scope = recorder.step_scope(self.span)
        self._scope = recorder.use_span(self.span)
        self._scope.__enter__()
        self._step_scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        self._step_scope.__exit__(*exc)
        scope, self._scope = self._scope, None
        return scope.__exit__(*exc)

    def headers(self) -> dict:
        """The step span's W3C headers (made once)."""
        if self._headers is None:
            self._headers = self.span.trace_headers()
        return self._headers

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
            if scheduler_output.finished_req_ids:       # (aborted since the last update: not seen there)
                tracer.end_requests(scheduler_output.finished_req_ids)
            span.add_links(tracer.request_headers(scheduler_output))
            tracer._epoch.append(self.headers())
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

    def updated(self, outputs: dict | None = None) -> None:
        """update_from_output has run: the step's spec-decode verifications (attributes
        and one event per request), then the update observers; the requests it finished end
        their Request spans; `outputs` (EngineCoreOutputs by client) carry the step's trace
        context to whoever sends or processes them (their output spans follow from it)."""
        scheduler_output = self._scheduled_output()
        tracer = self.tracer
        if scheduler_output.scheduled_spec_decode_tokens:
            record_spec_decode(self.span, tracer.scheduler.last_spec_decode_records)
        if tracer.links_requests:
            tracer.end_requests(tracer.scheduler.finished_req_ids)
            if outputs:
                headers = self.headers()
                for engine_core_outputs in outputs.values():
                    engine_core_outputs.trace_headers = headers
        for observe in tracer.on_update:
            observe(scheduler_output)

    def end(self) -> None:
        self.span.end()


def record_spec_decode(span: SpanHandle, records: list) -> None:
    """Speculative decoding on the step span: totals as attributes, and per request an event
    `spec_decode` with its drafts, how many were accepted, what came out and the slots
    the rejected drafts' KV went to (core/sched/record.py SpecDecodeRecord)."""
    span.set_attributes({"vllm_anatomy.spec_decode.num_drafts": len(records),
                         "vllm_anatomy.spec_decode.num_draft_tokens": sum(len(r.draft_token_ids) for r in records),
                         "vllm_anatomy.spec_decode.num_accepted_tokens": sum(r.num_accepted for r in records)})
    for r in records:
        attrs: dict[str, Any] = {REQUEST_ID: r.request_id, "vllm_anatomy.draft_token_ids": r.draft_token_ids,
                                 "vllm_anatomy.num_accepted_tokens": r.num_accepted,
                                 "vllm_anatomy.num_rejected_tokens": len(r.draft_token_ids) - r.num_accepted,
                                 "vllm_anatomy.output_token_ids": r.output_token_ids,
                                 "vllm_anatomy.rejected_slots": r.rejected_slots}
        span.add_event("spec_decode", **attrs)


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

    def end_requests(self, req_ids: Any) -> None:
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

    def updated(self, outputs: dict | None = None) -> None:
        pass

    def end(self) -> None:
        pass


_NULL_STEP_TRACE = NullStepTrace()
