"""LocalSpan: the recording span the SDK would make, without its per-span machinery.

At level "spans" an engine step opens 20 to 35 spans on the host, and each
request a few more. Through the SDK's Tracer each costs a sampler call, three
context look-ups, a bounded attribute map, two bounded lists, three locks,
start/end hooks and a copy of the span at its end: ~30 µs on a slow core, three
times a LocalSpan. With the SDK's default sampler, ParentBased(ALWAYS_ON), all
of that decides nothing for a root or a child of a sampled span: it is
recorded and sampled.

`SpanSink.start` makes a LocalSpan in exactly those cases:
    - the provider's sampler is the SDK's default (sampling.DEFAULT_ON: no
      OTEL_TRACES_SAMPLER, or "parentbased_always_on"), its tracer is the
      SDK's (OTEL_SDK_DISABLED would give a no-op one), and every span
      processor is a BatchSpanProcessor (whose on_start does nothing, so not
      calling it loses nothing);
    - the parent span context is invalid (a root) or sampled (local or remote).
Otherwise (another sampler, an unsampled parent) it returns None and the
caller asks the SDK's Tracer; so does a span given links at its start.

NOTE: what a LocalSpan hands to the processors is what the SDK's span would:
a ReadableSpan (this class is one) with the parent's trace id and trace state
(a root: a new trace id from the provider's id generator, no trace state), a
new span id from that generator, the trace flags the SDK sets (sampled, plus
random-trace-id for a root when the generator's ids are random, or as the
parent has it), the provider's resource, the tracer's instrumentation scope,
and attributes, events and links in the SDK's bounded containers under the
provider's SpanLimits, so that limits drop and count what they would. A span
is written by one thread at a time (the step's, the request's event loop),
so it takes no locks; processors' on_end is thread-safe.
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Any, Mapping, Sequence, cast

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace import Tracer as SDKTracer
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

logger = logging.getLogger(__name__)

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SAMPLED_RANDOM = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)


_SCALARS = frozenset((str, bool, int, float))


def _kept(attributes: Mapping[str, Any]) -> dict | None:
    """`attributes` as BoundedAttributes (without a length limit) keeps them, or None
    where it would do more than copy them.

    NOTE: it keeps a scalar (str, bool, int, float) as it is and a list or
    tuple of scalars of one type as a tuple of the same items; a key that is
    not a non-empty str, a mixed sequence or any other value it may clean,
    convert or drop (and warn about): those are left to BoundedAttributes."""
    kept = {}
    for key, value in attributes.items():
        if type(key) is not str or not key:
            return None
        kind = type(value)
        if kind not in _SCALARS:
            if kind is not list and kind is not tuple:
                return None
            if value and (type(value[0]) not in _SCALARS or any(type(v) is not type(value[0]) for v in value)):
                return None
            value = tuple(value)
        kept[key] = value
    return kept


def _fits(plain: Mapping[str, Any], attributes: Mapping[str, Any], maxlen: int | None) -> bool:
    """Would `plain` updated with `attributes` stay within `maxlen` keys?"""
    if maxlen is None or not plain:
        return maxlen is None or len(attributes) <= maxlen
    return len(plain) + sum(1 for key in attributes if key not in plain) <= maxlen


class SpanSink:
    """What LocalSpans share: the provider's resource, ids and limits, the tracer's
    scope, and the span processors they are handed to when they end."""

    def __init__(self, provider: TracerProvider, limits: SpanLimits, tracer: trace.Tracer,
                 tracer_name: str) -> None:
        self.resource = provider.resource
        self.limits = limits
        # NOTE: what provider.get_tracer(tracer_name) gives its spans (version "" when none).
        self.scope = InstrumentationScope(tracer_name, "")
        ids = provider.id_generator
        self.new_span_id, self.new_trace_id = ids.generate_span_id, ids.generate_trace_id
        self.root_flags = _SAMPLED_RANDOM if ids.is_trace_id_random() else _SAMPLED
        self.processors: list[BatchSpanProcessor] = []
        self.enabled = provider.sampler is sampling.DEFAULT_ON and isinstance(tracer, SDKTracer)

    def add_processor(self, processor: BatchSpanProcessor) -> None:
        """Register a processor (the caller also adds it to the provider)."""
        self.processors.append(processor)
        self.enabled = self.enabled and type(processor) is BatchSpanProcessor

    def start(self, name: str, parent: SpanContext, kind: SpanKind, attributes: Mapping[str, Any] | None,
              start_time: int | None = None) -> LocalSpan | None:
        """A LocalSpan under `parent` (invalid: a root), or None where the SDK's tracer must decide."""
        if not self.enabled:
            return None
        if not parent.is_valid:
            context = SpanContext(self.new_trace_id(), self.new_span_id(), is_remote=False,
                                  trace_flags=self.root_flags)
            return LocalSpan(self, name, context, None, kind, attributes, start_time)
        flags = parent.trace_flags
        if not flags.sampled:
            return None
        context = SpanContext(parent.trace_id, self.new_span_id(), is_remote=False,
                              trace_flags=_SAMPLED_RANDOM if flags.random_trace_id else _SAMPLED,
                              trace_state=parent.trace_state)
        return LocalSpan(self, name, context, parent, kind, attributes, start_time)

    def start_follower(self, name: str, cause: SpanContext, kind: SpanKind, attributes: Mapping[str, Any] | None,
                       start_time: int | None = None) -> LocalSpan | None:
        """A LocalSpan in `cause`'s trace with no parent, its first link naming the cause
        (recorder.py: "Followers"); None where the SDK's tracer must decide.

        NOTE: the SDK's tracer cannot make one (a span without a parent starts a new
        trace there); the OTLP data model can, and Jaeger reads the link as a
        FOLLOWS_FROM reference (opentracing.ref_type, OpenTelemetry's attribute for it)."""
        if not self.enabled or not cause.is_valid or not cause.trace_flags.sampled:
            return None
        flags = cause.trace_flags
        context = SpanContext(cause.trace_id, self.new_span_id(), is_remote=False,
                              trace_flags=_SAMPLED_RANDOM if flags.random_trace_id else _SAMPLED,
                              trace_state=cause.trace_state)
        span = LocalSpan(self, name, context, None, kind, attributes, start_time)
        span.extend_links([Link(cause, _FOLLOWS_FROM)])
        return span


# The attribute of a follower's link to its cause (OpenTelemetry's name for OpenTracing's reference type).
_FOLLOWS_FROM = BoundedAttributes(attributes={"opentracing.ref_type": "follows_from"}, immutable=True)


class LocalSpan(trace.Span, ReadableSpan):
    """A recording span: the API's Span to write it, a ReadableSpan to export it."""

    def __init__(self, sink: SpanSink, name: str, context: SpanContext, parent: SpanContext | None,
                 kind: SpanKind, attributes: Mapping[str, Any] | None, start_time: int | None) -> None:
        ReadableSpan.__init__(self, name, context, parent, sink.resource, None, kind=kind,
                              instrumentation_scope=sink.scope,
                              start_time=start_time if start_time is not None else time.time_ns())
        self._sink = sink
        # NOTE: `_attributes` stays None, `_events` / `_links` the empty tuple
        # ReadableSpan starts with, until the first one comes (many spans have
        # none): ReadableSpan reads None as no attributes.
        if attributes:
            self._set(attributes)

    def _set(self, attributes: Mapping[str, Any]) -> None:
        """Add attributes as the SDK's span would (BoundedAttributes under the span limits).

        NOTE: most spans carry a few scalars (or lists of them); for those
        BoundedAttributes keeps what _kept says, so a plain dict holds them (a
        fraction of the cost, and the exporter copies it in C). The first value
        or count it would clean, truncate or drop turns the dict into a
        BoundedAttributes (same items, same order) for good."""
        limits = self._sink.limits
        current = self._attributes
        if type(current) is not BoundedAttributes:
            # NOTE: below BoundedAttributes the attributes are this span's own plain dict.
            plain = cast("dict[str, Any]", current) if current is not None else {}
            kept = _kept(attributes) if limits.max_span_attribute_length is None else None
            if kept is not None and _fits(plain, kept, limits.max_span_attributes):
                if not plain:
                    self._attributes = kept         # (a new dict, _kept's: the span's own from here)
                    return
                for key, value in kept.items():
                    plain.pop(key, None)            # a key set again moves last, as in BoundedAttributes
                    plain[key] = value
                self._attributes = plain
                return
            self._attributes = current = BoundedAttributes(limits.max_span_attributes, plain, immutable=False,
                                                           max_value_len=limits.max_span_attribute_length)
        for key, value in attributes.items():
            current[key] = value

    # -- trace.Span ---------------------------------------------------------------------
    def get_span_context(self) -> SpanContext:
        context = self._context
        assert context is not None          # (given to __init__)
        return context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if not self._ended("set_attributes"):
            self._set(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        if not self._ended("set_attribute"):
            self._set({key: value})

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                  timestamp: int | None = None) -> None:
        if self._ended("add_event"):
            return
        limits = self._sink.limits
        # NOTE: an event's attributes as in _set: a plain dict where BoundedAttributes would only copy
        # (none: an empty dict, what an empty BoundedAttributes reads as).
        attrs: Mapping[str, Any] | None = (
            (_kept(attributes) if limits.max_attribute_length is None else None) if attributes else {})
        if attrs is None or not _fits({}, attrs, limits.max_event_attributes):
            attrs = BoundedAttributes(limits.max_event_attributes, attributes, immutable=True,
                                      max_value_len=limits.max_attribute_length)
        events = self._events
        if type(events) is not BoundedList:         # (the empty tuple ReadableSpan starts with)
            self._events = events = BoundedList(limits.max_events)
        events.append(Event(name, attrs, timestamp))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._ended("add_link"):
            return
        if not (context and (context.is_valid or attributes or context.trace_state)):
            return                                      # (the SDK keeps no link to nothing)
        limits = self._sink.limits
        attrs = BoundedAttributes(limits.max_link_attributes, attributes, immutable=True,
                                  max_value_len=limits.max_attribute_length)
        self.extend_links([Link(context, attrs)])

    def extend_links(self, links: Sequence[Link]) -> None:
        """Add ready-made (valid, immutable) links at once."""
        if self._ended("add_link"):
            return
        span_links = self._links
        if type(span_links) is not BoundedList:     # (the empty tuple ReadableSpan starts with)
            self._links = span_links = BoundedList(self._sink.limits.max_links)
        span_links.extend(links)

    def update_name(self, name: str) -> None:
        if not self._ended("update_name"):
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # NOTE: the API's rules: OK is final, UNSET never overrides, and a
        # description only comes with a bare StatusCode.
        if self._ended("set_status") or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        """An "exception" event with the semantic-convention attributes."""
        cls = type(exception)
        module = cls.__module__
        qualified = cls.__qualname__ if module in (None, "builtins") else f"{module}.{cls.__qualname__}"
        attrs = {"exception.type": qualified,
                 "exception.message": str(exception),
                 "exception.stacktrace": "".join(traceback.format_exception(exception)),
                 "exception.escaped": str(escaped),
                 **(attributes or {})}
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            logger.warning("Calling end() on an ended span.")
            return
        self._end_time = end_time if end_time is not None else time.time_ns()
        for processor in self._sink.processors:
            processor.on_end(self)

    def _ended(self, what: str) -> bool:
        if self._end_time is None:
            return False
        logger.warning("Tried calling %s on an ended span.", what)
        return True
