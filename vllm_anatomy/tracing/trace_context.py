"""W3C trace context: the one codec between traceparent/tracestate headers and
OpenTelemetry span contexts (OpenTelemetry's TraceContextTextMapPropagator), and
the Links built from them.

Headers travel in HTTP requests and in EngineCoreRequest.trace_headers; a step
span links to every request it serves, so the parse and the attribute-less Link
are made once per request (memoised) and shared.
"""
from __future__ import annotations

import functools
import re
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.trace import Link
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from vllm_anatomy.tracing.store import to_json

_PROPAGATOR = TraceContextTextMapPropagator()
_OWN_TRACEPARENT = re.compile("00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def inject_trace_headers(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """traceparent/tracestate of the current (or given) context, as a header dict."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def extract_trace_context(headers: dict[str, str] | None) -> otel_context.Context | None:
    """The remote parent named by W3C headers; None when there is none."""
    span_context = remote_span_context(headers)
    # (what TraceContextTextMapPropagator.extract builds from the same headers)
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context)) if span_context else None


def new_link(headers: dict | None, attrs: dict | None = None) -> Link | None:
    """A new Link to the span named by `headers` (carrying `attrs`)."""
    span_context = remote_span_context(headers)
    return Link(span_context, attrs or None) if span_context else None


def _w3c_fields(headers: dict[str, str]) -> tuple[str | None, str | None]:
    """(traceparent, tracestate) of a header dict, whatever the keys' case."""
    traceparent, tracestate = headers.get("traceparent"), headers.get("tracestate")
    if traceparent is None or (tracestate is None and len(headers) > 1):
        # NOTE: HTTP header names are case-insensitive; our own dicts are lowercase
        # (one key, or both), so only foreign ones pay for lowering every key.
        lowered = {k.lower(): v for k, v in headers.items()}
        traceparent, tracestate = lowered.get("traceparent"), lowered.get("tracestate")
    return traceparent, tracestate


def remote_span_context(headers: dict[str, str] | None) -> trace.SpanContext | None:
    if not headers:
        return None
    return _parse_w3c(*_w3c_fields(headers))


@functools.lru_cache(maxsize=16384)
def _parse_w3c(traceparent: str | None, tracestate: str | None) -> trace.SpanContext | None:
    """The remote SpanContext W3C headers name (OpenTelemetry's propagator), parsed once per request.

    NOTE: a request's headers never change, and every step links to it (256
    parses per step at batch 256 if each were parsed): memoised."""
    if not traceparent:
        return None
    if tracestate is None:
        # NOTE: the form headers_of writes (version 00, nothing after the flags): what the
        # propagator makes of it, without its carrier, getter and context (a step's own
        # headers are new every step, so this runs once per step and per rank).
        own = _OWN_TRACEPARENT.fullmatch(traceparent)
        if own is not None:
            trace_id, span_id = int(own[1], 16), int(own[2], 16)
            if not trace_id or not span_id:
                return None
            return trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(int(own[3], 16)))
    carrier = {"traceparent": traceparent, **({"tracestate": tracestate} if tracestate else {})}
    span_context = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return span_context if span_context.is_valid else None


def shared_link(headers: dict[str, str] | None) -> SharedLink | None:
    """The shared Link to the span named by `headers` (None if they name none)."""
    if not headers:
        return None
    traceparent = headers.get("traceparent")
    if traceparent is None or len(headers) > 1:
        traceparent, tracestate = _w3c_fields(headers)
        if tracestate is not None:
            return link_for(traceparent, tracestate)
    # NOTE: one argument: the cache keys on the string itself (no key tuple),
    # and the common case (our own headers: a traceparent alone) costs one look-up.
    return link_for(traceparent)


class SharedLink(Link):
    """A Link without attributes, shared by every span that links to its span
    (see link_for); `json` is its run-store text (see _links_json)."""

    def __init__(self, context: trace.SpanContext) -> None:
        super().__init__(context, BoundedAttributes(immutable=True))
        self.json = to_json(link_dict(self))


@functools.lru_cache(maxsize=16384)
def link_for(traceparent: str | None, tracestate: str | None = None) -> SharedLink | None:
    """The one attribute-less Link to the span named by these W3C headers.

    NOTE: built once per request and shared by every step span that links
    to it. The SDK's add_link builds a Link, an attribute map and a lock per
    call: 256 of each per step at batch 256, then the largest host cost of
    level spans, and garbage that made the collector run several times as
    often. Sharing is safe: a Link is immutable (its attributes are an
    immutable, here empty, map) and exporters only read it."""
    span_context = _parse_w3c(traceparent, tracestate)
    return SharedLink(span_context) if span_context is not None else None


def headers_of(span_context: trace.SpanContext) -> dict[str, str]:
    """W3C headers naming `span_context` (what OpenTelemetry's propagator writes).

    NOTE: without a trace state (our own spans' case) the traceparent is
    formatted here: the propagator's inject costs several times more, and
    a step asks for its span's headers for every call it makes to a worker."""
    if not span_context.trace_state and span_context.is_valid:
        return {"traceparent": f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
                               f"{span_context.trace_flags:02x}"}
    if span_context is trace.INVALID_SPAN_CONTEXT:
        # (no current span: an offline caller without one asks for every request it adds)
        return {}
    return inject_trace_headers(trace.set_span_in_context(trace.NonRecordingSpan(span_context)))


def plain_attributes(attributes: Any) -> dict:
    """A span's (or event's, link's) attributes as a plain dict.

    NOTE: the SDK hands them out as a MappingProxyType over BoundedAttributes;
    dict() of that calls back into Python for every key, the proxy's copy()
    is BoundedAttributes.copy(): one C-level dict copy (the export thread
    holds the GIL meanwhile, so the engine's thread waits for it)."""
    if not attributes:
        return {}
    copy = getattr(attributes, "copy", None)
    plain = copy() if copy is not None else None
    return plain if type(plain) is dict else dict(attributes)


def link_dict(link: Link) -> dict:
    """A link as the run store's JSON (docs/trace-format.md)."""
    return {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}",
            "attributes": plain_attributes(link.attributes)}

