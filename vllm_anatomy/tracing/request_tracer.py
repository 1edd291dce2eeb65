"""RequestTracer: one span per request on the frontend, from add to finish.

The span is named `llm_request` (vLLM's name: OutputProcessor.do_tracing in
vllm/v1/engine/output_processor.py; keys in vllm/tracing/utils.py), kind SERVER,
and carries OpenTelemetry GenAI attributes for request-level facts:
    gen_ai.operation.name, gen_ai.provider.name, gen_ai.request.model,
    gen_ai.request.max_tokens / temperature / top_p,
    gen_ai.usage.input_tokens / output_tokens, gen_ai.response.finish_reasons
and span events for the request's journey:
    QUEUED        added on the frontend
    SCHEDULED     (engine event, engine timestamp) admitted into the running batch
    PREEMPTED     (engine event) its KV blocks were taken back
    FIRST_TOKEN   its first output token reached the frontend
    FINISHED      with vllm_anatomy.finish_reason
The span's W3C context goes into EngineCoreRequest.trace_headers, so the
engine side (in this process or another) can parent and link to it.

Parallel sampling (n > 1; engine/parallel_sampling.py): the caller asked for one
request, the engine runs n child requests. One trace all the same: the
admission span is then named `ParentRequest` (the frontend's object for the
fan-out; kind SERVER, `gen_ai.request.choice.count` = n, the caller's request
id) and each child gets its own `llm_request` span as its child (as vLLM
records one `llm_request` per engine request), from its add to its finish,
with the events above: each child's engine side, the steps that served it
(links) and its output path join the parent's trace through it. The parent
ends when its last child does, with every child's finish reason (by index) and
their output tokens summed; FIRST_TOKEN is its first child's first token. If
adding the children fails halfway, the frontend aborts those it added and calls
discard_admission: no more come, and the parent ends with them.

The span is the request's trace (or, behind the HTTP server, its HTTP span's
child): it opens when the frontend starts admitting the request
(`with tracer.admitting(request_id, trace_headers):`, before tokenizing), so
AsyncLLM.add_request and InputProcessor.process_inputs are its children, and
its parent is the span named by `trace_headers` (the HTTP span, or an offline
caller's own span) or none: never a span of ours that ends before it.

Who calls what: the frontend (LLMEngine, AsyncLLM) opens the span (admitting,
then on_add once the EngineCoreRequest exists);
the OutputProcessor, in its one loop over a step's outputs, reports what
changed — engine events, the first token, the finish (with the output token
count it keeps anyway), an abort — as vLLM's OutputProcessor does its
tracing (do_tracing, at a request's finish). NOTE: so a step costs the
tracer nothing for a request whose state did not change (at batch 256
nearly all of them), instead of a look-up per request per step.

With tracing off the frontend holds a NullRequestTracer instead: the same
calls, each a no-op.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import time
from typing import TYPE_CHECKING, Any

from vllm_anatomy.engine.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest
from vllm_anatomy.tracing.recorder import _NULL_SPAN, Recorder, SpanHandle
from vllm_anatomy.tracing.span_names import PARENT_REQUEST_SPAN, REQUEST_SPAN

if TYPE_CHECKING:
    from vllm_anatomy.engine.parallel_sampling import ParentRequest
    from vllm_anatomy.sampling_params import SamplingParams

# Engine events turned into span events (QUEUED is recorded by the frontend itself).
_ENGINE_EVENTS = {EngineCoreEventType.SCHEDULED: "SCHEDULED", EngineCoreEventType.PREEMPTED: "PREEMPTED"}


class _ParentSpan:
    """The span of an n > 1 request and what its children reported so far."""
    __slots__ = ("request_id", "span", "n", "num_added", "num_open", "finish_reasons", "output_tokens",
                 "failed", "first_token", "adding_failed")

    def __init__(self, request_id: str, span: SpanHandle, n: int) -> None:
        self.request_id, self.span, self.n = request_id, span, n
        self.num_added = self.num_open = self.output_tokens = 0
        self.finish_reasons: list[str | None] = [None] * n     # by child index
        self.failed = self.first_token = self.adding_failed = False

    def done(self) -> bool:
        # NOTE: every child was added and has finished; or adding the others failed
        # (discard_admission: the caller aborted those already added) and none is
        # left open. Not merely "no child open": under AsyncLLM a child may finish
        # (even with an error) while its siblings are still being added.
        return self.num_open == 0 and (self.num_added == self.n or self.adding_failed)


class RequestTracer:

    def __init__(self, recorder: Recorder, model_name: str) -> None:
        self.recorder = recorder
        self.model_name = model_name
        # The open span of each request (until it finishes).
        self.requests: dict[str, SpanHandle] = {}
        # n > 1: the parent's span by the parent's request id, and each open child's parent.
        self.parents: dict[str, _ParentSpan] = {}
        self.child_parents: dict[str, tuple[_ParentSpan, int]] = {}
        # Spans opened by admitting() whose EngineCoreRequest is not added yet, by request id.
        self.admitted: dict[str, SpanHandle] = {}
        # The span admitting() opened in this task / thread (AsyncLLM renames the request inside).
        self._admitting: contextvars.ContextVar[_Admission | None] = contextvars.ContextVar(
            "vllm_anatomy_admitting", default=None)

    def admitting(self, request_id: str, trace_headers: dict | None, n: int = 1) -> "_Admission":
        """`with tracer.admitting(request_id, trace_headers, n):` open the request's span now
        (`llm_request`, or `ParentRequest` when n > 1; a child of the span `trace_headers`
        name, else a new trace) and make it current: what is done inside (tokenizing,
        sending) nests under it. on_add later completes it; if the block raises before
        that, it ends there with the error."""
        return _Admission(self, request_id, trace_headers, n)

    def on_add(self, request: EngineCoreRequest, parent: "ParentRequest | None" = None,
               index: int = 0) -> SpanHandle:
        """Complete the request's span (the one admitting() opened, else a new one: a child
        of request.trace_headers' span if any) and replace request.trace_headers with its
        context. A child of an n > 1 request (`parent`, its `index`) gets an `llm_request`
        span of its own under its parent's span."""
        attrs = self._attributes(request.request_id, len(request.prompt_token_ids), request.sampling_params)
        admitted = None if parent is not None else self._admitted_span(request.request_id)
        if parent is not None:
            record = self.parents.get(parent.request_id) or self._open_parent(request, parent)
            attrs["vllm_anatomy.parent_request_id"] = parent.request_id
            attrs["vllm_anatomy.child_index"] = index
            span = self.recorder.start_span(REQUEST_SPAN, kind="server", parent=record.span, **attrs)
            span.add_event("QUEUED")
            record.num_added += 1
            record.num_open += 1
            self.child_parents[request.request_id] = (record, index)
        elif admitted is not None:
            span = admitted
            span.set_attributes(attrs)
        else:
            span = self.recorder.start_span(REQUEST_SPAN, trace_headers=request.trace_headers,
                                            kind="server", **attrs)
            span.add_event("QUEUED")
        request.trace_headers = span.trace_headers()
        self.requests[request.request_id] = span
        return span

    def _open_parent(self, request: EngineCoreRequest, parent: "ParentRequest") -> _ParentSpan:
        """The ParentRequest span of `parent` (admitting()'s, else a new one), at its first child."""
        span = self._admitted_span(parent.request_id)
        if span is None:
            span = self.recorder.start_span(PARENT_REQUEST_SPAN, trace_headers=request.trace_headers,
                                            kind="server")
            span.add_event("QUEUED")
        attrs = self._attributes(parent.request_id, len(request.prompt_token_ids), parent.sampling_params)
        attrs["gen_ai.request.choice.count"] = parent.n
        attrs["vllm_anatomy.span_type"] = "parent_request"
        span.set_attributes(attrs)
        record = self.parents[parent.request_id] = _ParentSpan(parent.request_id, span, parent.n)
        return record

    def _admitted_span(self, request_id: str) -> SpanHandle | None:
        """The span admitting() opened for this request, taken over (None: there was none)."""
        span = self.admitted.pop(request_id, None)
        admitting = self._admitting.get()
        if span is None and admitting is not None and admitting.active:   # (AsyncLLM gave the request its final id)
            span = self.admitted.pop(admitting.request_id, None)
        return span

    def _end(self, span: SpanHandle) -> None:
        """End a request's span; but the one this task is still admitting ends when its admission
        block does (AsyncLLM.add_request, its child, is still open when adding fails inside it)."""
        admitting = self._admitting.get()
        if admitting is not None and admitting.active and admitting.span is span:
            admitting.end_on_exit = True
        else:
            span.end()

    def discard_admission(self, request_id: str) -> None:
        """Adding request `request_id` (tokenized, maybe partly added) failed, and the
        frontend aborted what it had added: end its admission span if on_add never took
        it over; for n > 1, no more children come, so its ParentRequest span ends once
        the children added are (at once if none is open). A no-op for a request that
        was added in full: safe to call for any id."""
        record = self.parents.get(request_id)
        if record is not None:
            if record.num_added == record.n:     # (added in full: its children end it)
                return
            record.adding_failed = record.failed = True
            if record.done():
                self._end_parent(record, "error")
            return
        span = self._admitted_span(request_id)
        if span is not None:
            error: dict[str, Any] = {"vllm_anatomy.finish_reason": "error"}
            span.add_event("FINISHED", **error)
            self._end(span)

    def _attributes(self, request_id: str, num_prompt_tokens: int, sp: "SamplingParams") -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.provider.name": "vllm_anatomy",
            "gen_ai.request.model": self.model_name,
            "gen_ai.request.max_tokens": sp.max_tokens,
            "gen_ai.request.temperature": float(sp.temperature),
            "gen_ai.request.top_p": float(sp.top_p),
            "gen_ai.usage.input_tokens": num_prompt_tokens,
            "vllm_anatomy.request_id": request_id,
            "vllm_anatomy.span_type": "request",
        }
        if sp.seed is not None:
            attrs["gen_ai.request.seed"] = sp.seed
        return attrs

    def adding(self, request: EngineCoreRequest, parent: "ParentRequest | None" = None,
               index: int = 0) -> contextlib.AbstractContextManager:
        """`with tracer.adding(request, parent, index):` on_add, then its span is current
        inside (an in-process EngineCore.add_request nests under it)."""
        return self.recorder.use_span(self.on_add(request, parent, index))

    def caller_headers(self, trace_headers: dict | None) -> dict | None:
        """The parent a request's span should have: `trace_headers` if given (an HTTP
        request's), else the caller's current span (an offline caller's own span), else None."""
        return trace_headers or self.recorder.inject_trace_headers() or None

    def on_engine_events(self, request_id: str, events: list[EngineCoreEvent]) -> None:
        """The engine's events of one request (SCHEDULED, PREEMPTED), at the engine's times."""
        span = self.requests.get(request_id)
        if span is None:
            return
        for ev in events:
            name = _ENGINE_EVENTS.get(ev.type)
            if name is not None:
                span.add_event(name, time_ns=self._from_monotonic(ev.timestamp))

    def on_first_token(self, request_id: str) -> None:
        """Its first output token reached the frontend."""
        span = self.requests.get(request_id)
        if span is not None:
            span.add_event("FIRST_TOKEN")
            record, _ = self.child_parents.get(request_id, (None, 0))
            if record is not None and not record.first_token:
                record.first_token = True
                which: dict[str, Any] = {"vllm_anatomy.request_id": request_id}   # (the child's)
                record.span.add_event("FIRST_TOKEN", **which)

    def finish(self, request_id: str, reason: str, num_output_tokens: int) -> None:
        """End the request's span: `reason` (length, stop, abort, error, ...), the output tokens it got."""
        span = self.requests.pop(request_id, None)
        if span is None:
            return
        span.set_attribute("gen_ai.usage.output_tokens", num_output_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        attrs: dict[str, Any] = {"vllm_anatomy.finish_reason": reason}
        span.add_event("FINISHED", **attrs)
        self._end(span)
        child = self.child_parents.pop(request_id, None)
        if child is not None:
            self._child_finished(*child, reason, num_output_tokens)

    def _child_finished(self, record: _ParentSpan, index: int, reason: str, num_output_tokens: int) -> None:
        """Child `index` of an n > 1 request ended; the parent's span ends with the last one."""
        record.num_open -= 1
        record.output_tokens += num_output_tokens
        record.failed |= reason == "error"
        record.finish_reasons[index] = reason
        if record.done():
            self._end_parent(record, reason)

    def _end_parent(self, record: _ParentSpan, reason: str) -> None:
        self.parents.pop(record.request_id, None)
        span = record.span
        span.set_attribute("gen_ai.usage.output_tokens", record.output_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [r for r in record.finish_reasons if r is not None])
        # (the reason of the child that ended it, "error" if any failed; every child's is in finish_reasons)
        attrs: dict[str, Any] = {"vllm_anatomy.finish_reason": "error" if record.failed else reason}
        span.add_event("FINISHED", **attrs)
        self._end(span)

    def _from_monotonic(self, ts: float) -> int:
        # NOTE: engine event times are time.monotonic() of the engine's host (the
        # same host here); shifted onto the recorder's clock.
        return self.recorder.now_ns() - time.monotonic_ns() + int(ts * 1e9)


class _Admission:
    """RequestTracer.admitting (a class: entered once per request)."""
    __slots__ = ("tracer", "request_id", "trace_headers", "n", "span", "scope", "token", "active", "end_on_exit")

    def __init__(self, tracer: RequestTracer, request_id: str, trace_headers: dict | None, n: int) -> None:
        self.tracer, self.request_id, self.trace_headers, self.n = tracer, request_id, trace_headers, n
        # NOTE: a task started inside the block (AsyncLLM's output handler) keeps this object in
        # its context copy for good: `active` tells it the block is over.
        self.active = self.end_on_exit = False

    def __enter__(self) -> SpanHandle:
        tracer = self.tracer
        attrs: dict[str, Any] = {"vllm_anatomy.request_id": self.request_id}
        name = PARENT_REQUEST_SPAN if isinstance(self.n, int) and self.n > 1 else REQUEST_SPAN
        self.span = span = tracer.recorder.start_span(name, trace_headers=self.trace_headers,
                                                      kind="server", root=not self.trace_headers, **attrs)
        span.add_event("QUEUED")
        tracer.admitted[self.request_id] = span
        self.active = True
        self.token = tracer._admitting.set(self)
        self.scope = tracer.recorder.use_span(span)
        self.scope.__enter__()
        return span

    def __exit__(self, *exc: Any) -> None:
        tracer = self.tracer
        try:
            self.scope.__exit__(*exc)
        finally:
            tracer._admitting.reset(self.token)
            self.active = False
            # (refused before on_add took it: it ends here, the error recorded by the scope;
            # or refused after, and its end waited for this block's own spans to end)
            if self.end_on_exit or (exc[1] is not None and tracer.admitted.pop(self.request_id, None) is not None):
                self.span.end()


class NullRequestTracer:
    """Tracing off: RequestTracer's calls, each a no-op."""

    def admitting(self, request_id: str, trace_headers: dict | None, n: int = 1) -> contextlib.AbstractContextManager:
        return _NULL_SPAN

    def caller_headers(self, trace_headers: dict | None) -> dict | None:
        return trace_headers

    def on_add(self, request: EngineCoreRequest, parent: "ParentRequest | None" = None,
               index: int = 0) -> SpanHandle:
        return _NULL_SPAN

    def adding(self, request: EngineCoreRequest, parent: "ParentRequest | None" = None,
               index: int = 0) -> contextlib.AbstractContextManager:
        return _NULL_SPAN

    def discard_admission(self, request_id: str) -> None:
        pass

    def on_engine_events(self, request_id: str, events: list[EngineCoreEvent]) -> None:
        pass

    def on_first_token(self, request_id: str) -> None:
        pass

    def finish(self, request_id: str, reason: str, num_output_tokens: int) -> None:
        pass


NULL_REQUEST_TRACER = NullRequestTracer()


def make_request_tracer(recorder: Recorder, model_path: str) -> RequestTracer | NullRequestTracer:
    """The frontend's request tracer: a NullRequestTracer when tracing is off."""
    if not recorder.enabled:
        return NullRequestTracer()
    return RequestTracer(recorder, os.path.basename(model_path.rstrip("/")))
