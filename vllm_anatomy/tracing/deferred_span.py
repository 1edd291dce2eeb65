"""DeferredSpan: at level spans the engine's thread writes a span down; the exporter's thread builds it.

Where the SDK's default sampler would record a span (a root, or a child of a
sampled parent: SpanSink below), the recorder makes a DeferredSpan: a
recording trace.Span that keeps its name, kind, ids, parent and times, and
each change the engine makes to it (set_attribute[s], add_event, its links)
as one entry of a list, in order; nothing more. It builds no SpanContext
until one is asked for, no attribute map, event or link container, takes no
lock and makes no copy of itself at its end. Ended, it goes as it is to the
recorder's DeferredSpanProcessor (one per exporter: the SDK's
BatchSpanProcessor's job, below), whose thread, when it exports a batch,
builds each DeferredSpan into the LocalSpan it stands for (local_span.py) by
replaying its changes on a fresh one in the order they were made (build());
the run store's exporter reads the same values without building it
(plain(), span_export.plain_span_to_row). Exporters receive what they
received before: LocalSpans with the same name, ids, parent, kind,
attributes, events, links, status and times; the run store the same rows.

Why the trace is the same:
    - The replay runs LocalSpan's own code (set_attributes, add_event,
      extend_links) on the same inputs in the same order, so the span limits
      drop and count, and a key set twice moves last, as before; plain()
      reads what the replay would make, and gives up (build() then) wherever
      a limit would drop something.
    - Every input is fixed when the call is made, not when it is replayed:
      timestamps are read then (an event given no time gets time_ns() at the
      call, as the SDK's Event would); attribute values pass local_span._kept
      then (a str, bool, int or float, or a tuple of one of those: immutable),
      so a list the caller changes later changes nothing; links are copied.
    - Anything else builds the LocalSpan on the spot ("materialises" it), which
      takes every later change itself and is what ends: a value _kept would
      not keep as it is, a link with attributes, set_status, update_name,
      record_exception (rare: errors, foreign instrumentation). Under a
      value-length limit (OTEL_*ATTRIBUTE_VALUE_LENGTH_LIMIT) SpanSink makes
      LocalSpans from the start, as before.

NOTE: why building on another thread is safe:
    - Ordering: end() is a span's last write; it then reaches the processor's
      queue (a deque: appends and pops are atomic), and the processor's thread
      reads it only after taking it from there. A change after end() changes
      nothing (it warns, as the SDK's span does). Spans reach the exporters in
      the order they ended, in batches, as they did through BatchSpanProcessor.
    - Thread safety: one thread writes a span until it ends (the step's, the
      request's event loop; a Future's callback may end it), as for LocalSpan.
      After end the only fields either side may fill are caches: the
      SpanContext (its ids, made on first use) and the built LocalSpan; two
      threads filling one at once (two exporters) each make an equal one, and
      exporters only read what they get.
    - Flush and shutdown: OTelRecorder.flush / shutdown reach the processors
      through the provider (force_flush / shutdown): every span queued is
      built and exported, on the flushing thread or the processor's, before
      they return; shutdown then shuts the exporter down. Spans ending after
      that are dropped, as BatchSpanProcessor drops them.
    - Crash: a killed process loses the spans still queued, as it did when the
      queue held LocalSpans (the run store's queue delay is 200 ms). A span
      that fails to build (a bug) fails its batch's export, which the
      processor logs and goes on, as BatchSpanProcessor does an exporter's error.
Host cost: bench/tracing_host_cost.py (the step's added ms) and bench/tracing_seams.py
(the engine thread's time inside tracing calls) measure it; the commit that
brought this file says by how much it fell.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Mapping, NamedTuple, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace import Tracer as SDKTracer
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from vllm_anatomy.tracing.gil_yield import offering_gil
from vllm_anatomy.tracing.local_span import LocalSpan, _kept

logger = logging.getLogger(__name__)
_time_ns = time.time_ns

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SAMPLED_RANDOM = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
_SAMPLED_BIT = TraceFlags.SAMPLED
# The attribute of a follower's link to its cause (OpenTelemetry's name for OpenTracing's reference type).
_FOLLOWS_FROM = BoundedAttributes(attributes={"opentracing.ref_type": "follows_from"}, immutable=True)


class SpanSink:
    """What a recorder's own spans share: the provider's resource, ids and limits, the
    tracer's scope, and the span processors they are handed to when they end. Decides
    whether a span is ours or the SDK tracer's.

    A span is ours exactly where the SDK's would be recorded and sampled without
    its per-span machinery deciding anything (local_span.py):
        - the provider's sampler is the SDK's default (sampling.DEFAULT_ON: no
          OTEL_TRACES_SAMPLER, or "parentbased_always_on"), its tracer is the
          SDK's (OTEL_SDK_DISABLED would give a no-op one), and every span
          processor is a DeferredSpanProcessor (whose on_start does nothing, so
          not calling it loses nothing);
        - the parent span context is invalid (a root) or sampled (local or remote).
    Otherwise (another sampler, an unsampled parent) start() returns None and the
    caller asks the SDK's Tracer; so does a span given links at its start."""

    def __init__(self, provider: TracerProvider, limits: SpanLimits, tracer: trace.Tracer,
                 tracer_name: str) -> None:
        self.resource = provider.resource
        self.limits = limits
        # NOTE: what provider.get_tracer(tracer_name) gives its spans (version "" when none).
        self.scope = InstrumentationScope(tracer_name, "")
        ids = provider.id_generator
        self.new_span_id, self.new_trace_id = ids.generate_span_id, ids.generate_trace_id
        self.root_flags = _SAMPLED_RANDOM if ids.is_trace_id_random() else _SAMPLED
        self.processors: list[DeferredSpanProcessor] = []
        self.enabled = provider.sampler is sampling.DEFAULT_ON and isinstance(tracer, SDKTracer)
        # NOTE: under a value-length limit LocalSpan leaves every value to BoundedAttributes
        # (which truncates it): nothing to defer safely, so our spans are LocalSpans made at once.
        self.deferred = limits.max_span_attribute_length is None and limits.max_attribute_length is None

    def add_processor(self, processor: DeferredSpanProcessor) -> None:
        """Register a processor (the caller also adds it to the provider, for the SDK's spans)."""
        self.processors.append(processor)
        self.enabled = self.enabled and type(processor) is DeferredSpanProcessor
        # (one processor, the common case: its own emit, one call fewer per span)
        self.emit = processor.emit if len(self.processors) == 1 else self._emit_all    # type: ignore[method-assign]

    def emit(self, span: DeferredSpan | LocalSpan) -> None:
        """An ended span of ours, to every processor."""
        self._emit_all(span)

    def _emit_all(self, span: DeferredSpan | LocalSpan) -> None:
        for processor in self.processors:
            processor.emit(span)

    def start(self, name: str, parent: SpanContext, kind: SpanKind, start_time: int | None = None
              ) -> trace.Span | None:
        """Our span under `parent` (invalid: a root), or None where the SDK's tracer must decide.
        (Its attributes are its first change: set_attributes.)"""
        if not self.enabled:
            return None
        if not parent.is_valid:
            return self._make(name, None, None, self.new_trace_id(), kind, start_time)
        if not parent.trace_flags & _SAMPLED_BIT:        # (TraceFlags.sampled)
            return None
        if self.deferred:
            return DeferredSpan(self, name, parent, parent, 0, kind, start_time)
        return self._make(name, parent, parent, 0, kind, start_time)

    def child(self, name: str, current: trace.Span) -> DeferredSpan | None:
        """start(name, current.get_span_context(), INTERNAL) where `current` is a DeferredSpan of
        this sink's (valid and sampled: nothing to check); None for any other span."""
        if type(current) is not DeferredSpan or current._sink is not self or not self.enabled:
            return None
        parent = current.get_span_context()
        return DeferredSpan(self, name, parent, parent, 0, SpanKind.INTERNAL, None)

    def start_follower(self, name: str, cause: SpanContext, kind: SpanKind, start_time: int | None = None
                       ) -> trace.Span | None:
        """Our span in `cause`'s trace with no parent, its first link naming the cause
        (recorder.py: "Followers"); None where the SDK's tracer must decide.

        NOTE: the SDK's tracer cannot make one (a span without a parent starts a new
        trace there); the OTLP data model can, and Jaeger reads the link as a
        FOLLOWS_FROM reference (opentracing.ref_type, OpenTelemetry's attribute for it)."""
        if not self.enabled or not cause.is_valid or not cause.trace_flags.sampled:
            return None
        return self._make(name, None, cause, 0, kind, start_time)

    def _make(self, name: str, parent: SpanContext | None, origin: SpanContext | None, trace_id: int,
              kind: SpanKind, start_time: int | None) -> trace.Span:
        if self.deferred:
            return DeferredSpan(self, name, parent, origin, trace_id, kind, start_time)
        span = LocalSpan(self, name, self.context(origin, trace_id, self.new_span_id()), parent, kind, None,
                         start_time)
        if origin is not None and parent is None:
            _follow(span, origin)
        return span

    def context(self, origin: SpanContext | None, trace_id: int, span_id: int) -> SpanContext:
        """The SpanContext the SDK gives a span in `origin`'s trace (its parent's or cause's;
        None: a root of trace `trace_id`): sampled, random-trace-id as the origin has it
        (a root: as the id generator says), and the origin's trace state."""
        if origin is None:
            return SpanContext(trace_id, span_id, is_remote=False, trace_flags=self.root_flags)
        return SpanContext(origin.trace_id, span_id, is_remote=False,
                           trace_flags=_SAMPLED_RANDOM if origin.trace_flags.random_trace_id else _SAMPLED,
                           trace_state=origin.trace_state)


def _follow(local: LocalSpan, cause: SpanContext) -> None:
    """A follower's first link, to its cause."""
    local.extend_links([Link(cause, _FOLLOWS_FROM)])


# A DeferredSpan's changes: (one of these, *its arguments), replayed on the LocalSpan in order.
_SET_ATTRIBUTES = LocalSpan.set_attributes
_ADD_EVENT = LocalSpan.add_event
_EXTEND_LINKS = LocalSpan.extend_links


class PlainSpan(NamedTuple):
    """A DeferredSpan as its LocalSpan would read, in plain values (DeferredSpan.plain): status
    unset, our instrumentation scope, the sink's resource."""
    name: str
    context: SpanContext
    parent: SpanContext | None
    kind: SpanKind
    start_time: int
    end_time: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any], int]]   # (name, attributes, timestamp)
    links: list[Link]


class DeferredSpan(trace.Span):
    """A recording span whose LocalSpan is built later (build()), on the exporter's thread."""
    __slots__ = ("_sink", "_name", "_parent", "_origin", "_trace_id", "_span_id", "_kind", "_start_time",
                 "_end_time", "_changes", "_context", "_local")

    def __init__(self, sink: SpanSink, name: str, parent: SpanContext | None, origin: SpanContext | None,
                 trace_id: int, kind: SpanKind, start_time: int | None) -> None:
        self._sink, self._name, self._parent, self._origin, self._trace_id = sink, name, parent, origin, trace_id
        self._span_id = sink.new_span_id()
        self._kind = kind
        self._start_time = start_time if start_time is not None else _time_ns()
        self._end_time: int | None = None
        self._context: SpanContext | None = None
        self._local: LocalSpan | None = None
        # (function, *args), applied to the LocalSpan in order by build(); None once materialised
        self._changes: list[tuple] | None = [] if origin is parent else [(_follow, origin)]

    # -- trace.Span ---------------------------------------------------------------------
    def get_span_context(self) -> SpanContext:
        context = self._context
        if context is None:
            context = self._context = self._sink.context(self._origin, self._trace_id, self._span_id)
        return context

    # -- read as a ReadableSpan (tests, debugging: the span as it stands, built for the asking) --
    def _view(self) -> LocalSpan:
        if self._local is not None:
            return self._local
        return self.build() if self._end_time is not None else self._replayed()

    name = property(lambda self: self._view().name)
    kind = property(lambda self: self._kind)
    parent = property(lambda self: self._parent)
    start_time = property(lambda self: self._start_time)
    end_time = property(lambda self: self._end_time)
    status = property(lambda self: self._view().status)
    attributes = property(lambda self: self._view().attributes)
    events = property(lambda self: self._view().events)
    links = property(lambda self: self._view().links)
    resource = property(lambda self: self._sink.resource)
    instrumentation_scope = property(lambda self: self._sink.scope)

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._end_time is not None:
            logger.warning("Tried calling %s on an ended span.", "set_attributes")
            return
        changes = self._changes
        if changes is not None:
            kept = _kept(attributes)
            if kept is not None:
                changes.append((_SET_ATTRIBUTES, kept))
                return
        self._materialised().set_attributes(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end_time is not None:
            logger.warning("Tried calling %s on an ended span.", "set_attribute")
            return
        self.set_attributes({key: value})

    def set_kept_attributes(self, kept: dict[str, Any]) -> None:
        """set_attributes(kept) where local_span._kept(kept) is kept itself (a new dict of the
        caller's, plain values only: otel._kept_attrs made it), without checking again."""
        changes = self._changes
        if changes is not None and self._end_time is None:
            changes.append((_SET_ATTRIBUTES, kept))
        else:
            self.set_attributes(kept)       # (ended: warns; materialised: to the LocalSpan)

    def add_kept_event(self, name: str, kept: dict[str, Any] | None, timestamp: int | None = None) -> None:
        """add_event(name, kept, timestamp), `kept` as in set_kept_attributes (None: none)."""
        changes = self._changes
        if changes is not None and self._end_time is None:
            changes.append((_ADD_EVENT, name, kept, timestamp if timestamp is not None else _time_ns()))
        else:
            self.add_event(name, kept, timestamp)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                  timestamp: int | None = None) -> None:
        if self._end_time is not None:
            logger.warning("Tried calling %s on an ended span.", "add_event")
            return
        changes = self._changes
        if changes is not None:
            kept = _kept(attributes) if attributes else None
            if kept is not None or not attributes:
                changes.append((_ADD_EVENT, name, kept,
                                timestamp if timestamp is not None else _time_ns()))
                return
        self._materialised().add_event(name, attributes, timestamp)

    def extend_links(self, links: Sequence[Link]) -> None:
        """Add ready-made (valid, immutable) links at once (LocalSpan.extend_links)."""
        if self._end_time is not None:
            logger.warning("Tried calling %s on an ended span.", "add_link")
            return
        changes = self._changes
        if changes is not None:
            changes.append((_EXTEND_LINKS, tuple(links)))
        else:
            self._materialised().extend_links(links)

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        local = self._rare("add_link")
        if local is not None:
            local.add_link(context, attributes)

    def update_name(self, name: str) -> None:
        local = self._rare("update_name")
        if local is not None:
            local.update_name(name)

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        local = self._rare("set_status")
        if local is not None:
            local.set_status(status, description)

    def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        local = self._rare("add_event")
        if local is not None:
            local.record_exception(exception, attributes, timestamp, escaped)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            logger.warning("Calling end() on an ended span.")
            return
        local = self._local
        if local is not None:               # materialised: the LocalSpan ends (and goes to the processors)
            local.end(end_time)
            self._end_time = local.end_time
            return
        self._end_time = end_time if end_time is not None else _time_ns()
        self._sink.emit(self)

    # -- building -----------------------------------------------------------------------
    def plain(self) -> PlainSpan | None:
        """What build() would give, as plain values, without building it; None where the
        LocalSpan would not keep the changes as they were made (materialised: a status, a
        new name, ...; or a span limit would drop something): build() then.

        NOTE: as LocalSpan keeps them: attributes in one dict, a key set again moving
        last; an event's attributes as given ({} for none); links in order, a
        follower's link to its cause first. A limit is never passed here (counted
        at the end: a span's attributes only grow), so nothing is dropped."""
        changes = self._changes
        if changes is None or self._end_time is None:
            return None
        limits = self._sink.limits
        attributes: dict[str, Any] = {}
        owned = False                       # (attributes is a dict of our own, not a change's)
        events: list[tuple[str, dict[str, Any], int]] = []
        links: list[Link] = []
        max_event_attributes = limits.max_event_attributes
        for change in changes:
            what = change[0]
            if what is _SET_ATTRIBUTES:
                kept = change[1]
                if not attributes:
                    attributes, owned = kept, False
                    continue
                if not owned:
                    attributes, owned = dict(attributes), True
                for key in kept:
                    attributes.pop(key, None)
                attributes.update(kept)
            elif what is _ADD_EVENT:
                event_attributes = change[2] or {}
                if max_event_attributes is not None and len(event_attributes) > max_event_attributes:
                    return None
                events.append((change[1], event_attributes, change[3]))
            elif what is _EXTEND_LINKS:
                links.extend(change[1])
            else:                           # (_follow: a follower's first link)
                links.append(Link(change[1], _FOLLOWS_FROM))
        if ((limits.max_span_attributes is not None and len(attributes) > limits.max_span_attributes)
                or (limits.max_events is not None and len(events) > limits.max_events)
                or (limits.max_links is not None and len(links) > limits.max_links)):
            return None
        return PlainSpan(self._name, self.get_span_context(), self._parent, self._kind, self._start_time,
                         self._end_time, attributes, events, links)

    def build(self) -> LocalSpan:
        """The ended LocalSpan this span stands for (made once; see the module's NOTE)."""
        local = self._local
        if local is None:
            assert self._end_time is not None, "a span is built once it has ended"
            local = self._replayed()
            local._end_time = self._end_time
            self._local = local
        return local

    def _replayed(self) -> LocalSpan:
        local = LocalSpan(self._sink, self._name, self.get_span_context(), self._parent, self._kind, None,
                          self._start_time)
        for change in self._changes or ():
            change[0](local, *change[1:])
        return local

    def _materialised(self) -> LocalSpan:
        """Build the LocalSpan now (recording: it takes every later change itself)."""
        local = self._local
        if local is None:
            local = self._local = self._replayed()
            self._changes = None
        return local

    def _rare(self, what: str) -> LocalSpan | None:
        """Where a call that is not deferred goes: the LocalSpan, built now, while recording;
        None after end (the call warns and changes nothing, as on an ended LocalSpan)."""
        if self._end_time is None:
            return self._materialised()
        logger.warning("Tried calling %s on an ended span.", what)
        return None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        logger.warning("%s is not an integer: using %d", name, default)
        return default


class DeferredSpanProcessor(SpanProcessor):
    """The SDK's BatchSpanProcessor's job for spans of ours: a bounded queue of ended
    spans, exported in batches by a thread of its own, every schedule delay or sooner
    when a batch is full; a DeferredSpan is built (DeferredSpan.build) just before its
    batch is exported. The SDK's own spans (another sampler, an unsampled parent) come
    through on_end, as to any processor, and are exported as they are.

    Configured as BatchSpanProcessor is, by its arguments or the OTEL_BSP_*
    variables (schedule delay 5000 ms, queue 2048, batch 512), and behaves as it
    does: a full queue drops its oldest span (and warns), force_flush exports all
    that is queued on the caller's thread, shutdown exports the rest and shuts the
    exporter down, a forked child starts with an empty queue and a new thread."""

    def __init__(self, exporter: SpanExporter, max_queue_size: int | None = None,
                 schedule_delay_millis: float | None = None, max_export_batch_size: int | None = None) -> None:
        self.exporter = exporter
        # An exporter that builds (or reads) DeferredSpans itself gets them as they are (the run store's).
        self.builds = not getattr(exporter, "takes_deferred_spans", False)
        self.max_queue_size = max_queue_size or _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.schedule_delay_s = (schedule_delay_millis or _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000)) / 1e3
        self.max_export_batch_size = max_export_batch_size or _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
        if min(self.max_queue_size, self.schedule_delay_s, self.max_export_batch_size) <= 0:
            raise ValueError("span processor: queue size, schedule delay and batch size must be positive")
        if self.max_export_batch_size > self.max_queue_size:
            raise ValueError("span processor: max_export_batch_size must be at most max_queue_size")
        self._start()
        weak_reinit = weakref.WeakMethod(self._start)
        os.register_at_fork(after_in_child=lambda: (reinit := weak_reinit()) and reinit())

    def _start(self) -> None:
        """A new queue and thread (at init, and in a forked child: the parent's thread is not there)."""
        self.queue: collections.deque[DeferredSpan | ReadableSpan] = collections.deque(maxlen=self.max_queue_size)
        self._shutdown = False
        self._dropping = False
        self._export_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = threading.Thread(name="DeferredSpanProcessor", target=self._worker, daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: otel_context.Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        """An ended span of the SDK's, or a LocalSpan (sampled ones only, as BatchSpanProcessor)."""
        if span.context and span.context.trace_flags.sampled:
            self.emit(span)

    def emit(self, span: DeferredSpan | ReadableSpan) -> None:
        if self._shutdown:
            logger.info("Span processor shut down: span dropped.")      # (as BatchSpanProcessor)
            return
        queue = self.queue
        if len(queue) == self.max_queue_size:
            if not self._dropping:      # (once per stretch of drops)
                logger.warning("Span queue full (%d, OTEL_BSP_MAX_QUEUE_SIZE): dropping the oldest spans",
                               self.max_queue_size)
            self._dropping = True
        queue.append(span)              # (a full deque drops its oldest)
        if len(queue) == self.max_export_batch_size:
            self._wake.set()

    def _worker(self) -> None:
        while not self._shutdown:
            self._wake.wait(self.schedule_delay_s)
            self._wake.clear()
            if self._shutdown:
                break
            self._export()
        self._export()

    def _export(self) -> None:
        """Export everything queued, in batches (on the worker's thread, or a flushing caller's)."""
        with self._export_lock:
            queue = self.queue
            while queue:
                count = min(self.max_export_batch_size, len(queue))
                batch = [queue.popleft() for _ in range(count)]
                self._dropping = False
                # (the exporter's own calls, an HTTP client's, are not traced: as BatchSpanProcessor)
                # NOTE: the key is private, and the SDK's own processors (sdk.trace.export,
                # sdk._shared_internal) attach this same object: instrumentations compare keys by
                # identity, so no public create_key("suppress_instrumentation") could stand in for it.
                # A test in tests/tracing/test_deferred_spans.py fails if an OTel release renames it.
                token = otel_context.attach(otel_context.set_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY, True))
                try:
                    # (built inside the try: a span that fails to build fails its batch, as the NOTE says)
                    # (the GIL offered every ~0.5 ms while building: gil_yield.py)
                    spans: list[Any] = ([s.build() if type(s) is DeferredSpan else s for s in offering_gil(batch)]
                                        if self.builds else batch)  # (an exporter with takes_deferred_spans: as they are)
                    self.exporter.export(spans)
                except Exception:       # noqa: BLE001 (as BatchSpanProcessor: log, lose the batch, go on)
                    logger.exception("Exception while exporting %d spans.", count)
                finally:
                    otel_context.detach(token)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if self._shutdown:
            return False
        self._export()
        return True

    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self._wake.set()
        self._thread.join(30.0)
        self.exporter.shutdown()
