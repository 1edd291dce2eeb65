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

With tracing off the frontend holds a NullRequestTracer instead: the same
calls, each a no-op.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from vllm_anatomy.engine.protocol import EngineCoreEventType, EngineCoreOutput, EngineCoreRequest
from vllm_anatomy.tracing.recorder import _NULL_SPAN, Recorder, SpanHandle

# Engine events turned into span events (QUEUED is recorded by the frontend itself).
_ENGINE_EVENTS = {EngineCoreEventType.SCHEDULED: "SCHEDULED", EngineCoreEventType.PREEMPTED: "PREEMPTED"}


class _Traced:
    __slots__ = ("span", "num_output_tokens")

    def __init__(self, span: SpanHandle) -> None:
        self.span = span
        self.num_output_tokens = 0


class RequestTracer:

    def __init__(self, recorder: Recorder, model_name: str) -> None:
        self.recorder = recorder
        self.model_name = model_name
        self.requests: dict[str, _Traced] = {}

    def on_add(self, request: EngineCoreRequest) -> SpanHandle:
        """Open the request's span (child of request.trace_headers' span if any) and
        replace request.trace_headers with its context."""
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
        span = self.recorder.start_span("llm_request", trace_headers=request.trace_headers,
                                        kind="server", **attrs)
        span.add_event("QUEUED")
        request.trace_headers = span.trace_headers()
        self.requests[request.request_id] = _Traced(span)
        return span

    def adding(self, request: EngineCoreRequest) -> contextlib.AbstractContextManager:
        """`with tracer.adding(request):` on_add, then its span is current inside
        (an in-process EngineCore.add_request nests under it)."""
        return self.recorder.use_span(self.on_add(request))

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        # NOTE: runs for every request of every step: the common case (a new
        # token, no engine event, not finished) is one look-up and one add.
        requests = self.requests
        for eco in outputs:
            t = requests.get(eco.request_id)
            if t is None:
                continue
            if eco.events:
                self._engine_events(t, eco.events)
            new_token_ids = eco.new_token_ids
            if new_token_ids:
                if not t.num_output_tokens:
                    t.span.add_event("FIRST_TOKEN")
                t.num_output_tokens += len(new_token_ids)
            if eco.finish_reason is not None:
                self.finish(eco.request_id, str(eco.finish_reason))

    def _engine_events(self, t: _Traced, events) -> None:
        for ev in events:
            name = _ENGINE_EVENTS.get(ev.type)
            if name is not None:
                t.span.add_event(name, time_ns=self._from_monotonic(ev.timestamp))

    def finish(self, request_id: str, reason: str) -> None:
        t = self.requests.pop(request_id, None)
        if t is None:
            return
        t.span.set_attribute("gen_ai.usage.output_tokens", t.num_output_tokens)
        t.span.set_attribute("gen_ai.response.finish_reasons", [reason])
        attrs: dict[str, Any] = {"vllm_anatomy.finish_reason": reason}
        t.span.add_event("FINISHED", **attrs)
        t.span.end()

    def abort_all(self, request_ids: list[str], reason: str = "abort") -> None:
        for rid in request_ids:
            self.finish(rid, reason)

    def _from_monotonic(self, ts: float) -> int:
        # NOTE: engine event times are time.monotonic() of the engine's host (the
        # same host here); shifted onto the recorder's clock.
        return self.recorder.now_ns() - time.monotonic_ns() + int(ts * 1e9)


class NullRequestTracer:
    """Tracing off: RequestTracer's calls, each a no-op."""

    def on_add(self, request: EngineCoreRequest) -> SpanHandle:
        return _NULL_SPAN

    def adding(self, request: EngineCoreRequest) -> contextlib.AbstractContextManager:
        return _NULL_SPAN

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        pass

    def finish(self, request_id: str, reason: str) -> None:
        pass

    def abort_all(self, request_ids: list[str], reason: str = "abort") -> None:
        pass


def make_request_tracer(recorder: Recorder, model_path: str) -> RequestTracer | NullRequestTracer:
    """The frontend's request tracer: a NullRequestTracer when tracing is off."""
    if not recorder.enabled:
        return NullRequestTracer()
    return RequestTracer(recorder, os.path.basename(model_path.rstrip("/")))
