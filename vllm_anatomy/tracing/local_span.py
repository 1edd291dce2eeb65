"""LocalSpan: the recording span the SDK would make, without its per-span machinery.

At level "spans" an engine step opens 20 to 35 spans on the host, and each
request a few more. Through the SDK's Tracer each costs a sampler call, three
context look-ups, a bounded attribute map, two bounded lists, three locks,
start/end hooks and a copy of the span at its end: ~30 µs on a slow core, three
times a LocalSpan. With the SDK's default sampler, ParentBased(ALWAYS_ON), all
of that decides nothing for a root or a child of a sampled span: it is
recorded and sampled.

`SpanSink.start` (deferred_span.py) takes our path in exactly those cases
(the sampler is the SDK's default, the parent invalid or sampled; else the
caller asks the SDK's Tracer). There the engine's thread writes a
DeferredSpan, and the exporter's thread builds this LocalSpan from it
(deferred_span.py says how and why that is the same span); under a
value-length limit the LocalSpan is made on the spot.

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
from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from vllm_anatomy.tracing.deferred_span import SpanSink

logger = logging.getLogger(__name__)

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
        self._sink.emit(self)

    def _ended(self, what: str) -> bool:
        if self._end_time is None:
            return False
        logger.warning("Tried calling %s on an ended span.", what)
        return True
