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
from typing import Any

from vllm_anatomy.engine.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest
from vllm_anatomy.tracing.recorder import _NULL_SPAN, Recorder, SpanHandle

# Engine events turned into span events (QUEUED is recorded by the frontend itself).
_ENGINE_EVENTS = {EngineCoreEventType.SCHEDULED: "SCHEDULED", EngineCoreEventType.PREEMPTED: "PREEMPTED"}


class RequestTracer:

    def __init__(self, recorder: Recorder, model_name: str) -> None:
        self.recorder = recorder
        self.model_name = model_name
        # The open span of each request (until it finishes).
        self.requests: dict[str, SpanHandle] = {}
        # Spans opened by admitting() whose EngineCoreRequest is not added yet, by request id.
        self.admitted: dict[str, SpanHandle] = {}
        # The span admitting() opened in this task / thread (AsyncLLM renames the request inside).
        self._admitting: contextvars.ContextVar[tuple[str, SpanHandle] | None] = contextvars.ContextVar(
            "vllm_anatomy_admitting", default=None)

    def admitting(self, request_id: str, trace_headers: dict | None) -> "_Admission":
        """`with tracer.admitting(request_id, trace_headers):` open the request's span now (a
        child of the span `trace_headers` name, else a new trace) and make it current: what is
        done inside (tokenizing, sending) nests under it. on_add later completes it; if the
        block raises before that, it ends there with the error."""
        return _Admission(self, request_id, trace_headers)

    def on_add(self, request: EngineCoreRequest) -> SpanHandle:
        """Complete the request's span (the one admitting() opened, else a new one: a child
        of request.trace_headers' span if any) and replace request.trace_headers with its
        context."""
        sp = request.sampling_params
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.provider.name": "vllm_anatomy",
            "gen_ai.request.model": self.model_name,
            "gen_ai.request.max_tokens": sp.max_tokens,
            "gen_ai.request.temperature": float(sp.temperature),
            "gen_ai.request.top_p": float(sp.top_p),
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "vllm_anatomy.request_id": request.request_id,
            "vllm_anatomy.span_type": "request",
        }
        if sp.seed is not None:
            attrs["gen_ai.request.seed"] = sp.seed
        span = self.admitted.pop(request.request_id, None)
        admitting = self._admitting.get()
        if span is None and admitting is not None:         # (AsyncLLM gave the request its final id)
            span = self.admitted.pop(admitting[0], None)
        if span is not None:
            span.set_attributes(attrs)
        else:
            span = self.recorder.start_span("llm_request", trace_headers=request.trace_headers,
                                            kind="server", **attrs)
            span.add_event("QUEUED")
        request.trace_headers = span.trace_headers()
        self.requests[request.request_id] = span
        return span

    def adding(self, request: EngineCoreRequest) -> contextlib.AbstractContextManager:
        """`with tracer.adding(request):` on_add, then its span is current inside
        (an in-process EngineCore.add_request nests under it)."""
        return self.recorder.use_span(self.on_add(request))

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

    def finish(self, request_id: str, reason: str, num_output_tokens: int) -> None:
        """End the request's span: `reason` (length, stop, abort, error, ...), the output tokens it got."""
        span = self.requests.pop(request_id, None)
        if span is None:
            return
        span.set_attribute("gen_ai.usage.output_tokens", num_output_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        attrs: dict[str, Any] = {"vllm_anatomy.finish_reason": reason}
        span.add_event("FINISHED", **attrs)
        span.end()

    def _from_monotonic(self, ts: float) -> int:
        # NOTE: engine event times are time.monotonic() of the engine's host (the
        # same host here); shifted onto the recorder's clock.
        return self.recorder.now_ns() - time.monotonic_ns() + int(ts * 1e9)


class _Admission:
    """RequestTracer.admitting (a class: entered once per request)."""
    __slots__ = ("tracer", "request_id", "trace_headers", "span", "scope", "token")

    def __init__(self, tracer: RequestTracer, request_id: str, trace_headers: dict | None) -> None:
        self.tracer, self.request_id, self.trace_headers = tracer, request_id, trace_headers

    def __enter__(self) -> SpanHandle:
        tracer = self.tracer
        attrs: dict[str, Any] = {"vllm_anatomy.request_id": self.request_id}
        self.span = span = tracer.recorder.start_span("llm_request", trace_headers=self.trace_headers,
                                                      kind="server", root=not self.trace_headers, **attrs)
        span.add_event("QUEUED")
        tracer.admitted[self.request_id] = span
        self.token = tracer._admitting.set((self.request_id, span))
        self.scope = tracer.recorder.use_span(span)
        self.scope.__enter__()
        return span

    def __exit__(self, *exc: Any) -> None:
        tracer = self.tracer
        try:
            self.scope.__exit__(*exc)
        finally:
            tracer._admitting.reset(self.token)
            # (refused before on_add took it: it ends here, the error recorded by the scope)
            if exc[1] is not None and tracer.admitted.pop(self.request_id, None) is not None:
                self.span.end()


class NullRequestTracer:
    """Tracing off: RequestTracer's calls, each a no-op."""

    def admitting(self, request_id: str, trace_headers: dict | None) -> contextlib.AbstractContextManager:
        return _NULL_SPAN

    def caller_headers(self, trace_headers: dict | None) -> dict | None:
        return trace_headers

    def on_add(self, request: EngineCoreRequest) -> SpanHandle:
        return _NULL_SPAN

    def adding(self, request: EngineCoreRequest) -> contextlib.AbstractContextManager:
        return _NULL_SPAN

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
