"""OTelRecorder: the Recorder backed by the OpenTelemetry SDK.

With local_span.py, trace_context.py (the W3C codec), span_export.py (where
finished spans go) and the exporters, the only modules that import
OpenTelemetry. Each process of a run builds one recorder, hence one
TracerProvider, whose resource names the service and the process (kind,
name, pid). Spans the SDK's default sampler would record are built by
local_span.py (the SDK tracer's per-span work is most of level spans' host
cost), the others by the provider's tracer. A BatchSpanProcessor feeds
    - the run store (tracing/store.py) when trace_dir is set, and
    - live OTLP (gRPC or HTTP/protobuf) when `otlp_traces_endpoint` is given
      (as vLLM's --otlp-traces-endpoint) or the standard OTEL_EXPORTER_OTLP_*
      environment variables name an endpoint.
Snapshots (level "full") are encoded on the caller's thread and queued for the
run store's writer thread (store.py), as the exported spans are.

NOTE: the TracerProvider is not installed globally (set_tracer_provider can be
called once per process, and tests build several engines); but the *context*
is OpenTelemetry's global one, so an offline caller's active span becomes the
parent of the request spans, as in vLLM.
"""
from __future__ import annotations

import atexit
import contextlib
import operator
import os
import time
from typing import Any, Iterable, Sequence, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from vllm_anatomy.tracing.local_span import LocalSpan, SpanSink
from vllm_anatomy.tracing.recorder import LEVELS, Recorder, SpanHandle
from vllm_anatomy.tracing.span_export import StoreSpanExporter, make_otlp_exporter
from vllm_anatomy.tracing.store import RunStore, to_json
from vllm_anatomy.tracing.trace_context import (headers_of, inject_trace_headers, link_for, new_link,
                                                remote_span_context, shared_link)

_TRACEPARENT = operator.itemgetter("traceparent")
# Links per span (a step links to every request of its batch: max_num_seqs of them).
MAX_LINKS_PER_SPAN = 8192
TRACER_NAME = "vllm_anatomy"
_KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT,
          "producer": SpanKind.PRODUCER, "consumer": SpanKind.CONSUMER}
_SCALARS = (str, bool, int, float)
# (headers tuple, its links): the last batch of links OTelSpan.add_links made from a tuple.
_links_memo: tuple[tuple | None, list[Link]] = (None, [])


def _extend_links(span: trace.Span, links: list[Link]) -> None:
    """span.add_link(...) for each of `links`, in one batch.

    NOTE: the SDK span keeps its links in a BoundedList (`_links`), whose
    extend counts what the limit drops as add_link would. An ended span, or
    an SDK whose span keeps its links otherwise, takes the public path.
    test_links_take_the_batch_path_on_sdk_spans pins that the installed SDK takes the fast one."""
    if type(span) is LocalSpan:
        span.extend_links(links)
        return
    bounded = getattr(span, "_links", None)
    if type(bounded) is BoundedList and span.is_recording():
        bounded.extend(links)
    else:
        for link in links:
            span.add_link(link.context, link.attributes)


def _attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """OpenTelemetry accepts scalars and homogeneous sequences of them; the rest as text."""
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if v is None:
            continue
        if isinstance(v, _SCALARS):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, _SCALARS) for x in v):
            out[k] = list(v)
        elif hasattr(v, "item"):           # numpy / torch scalar
            out[k] = v.item()
        else:
            out[k] = to_json(v)
    return out


class OTelSpan(SpanHandle):
    """SpanHandle over an OpenTelemetry span (a LocalSpan or the SDK's): what
    span() yields and start_span() returns.

    NOTE: links added without attributes wait in `_pending` and join the
    span in one batch when the handle ends it (before the span is exported,
    so the exported links, and their order, are what add_link was given).
    After end `_pending` is None and add_link takes the SDK's path, which
    ignores (and warns about) a link added to an ended span."""
    __slots__ = ("span", "_pending")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self._pending: list[Link] | None = []

    def set_attribute(self, key: str, value: Any) -> None:
        if type(value) in _SCALARS:         # NOTE: exact types: a bool subclass or numpy scalar is converted
            self.span.set_attribute(key, value)
        else:
            self.span.set_attributes(_attrs({key: value}))

    def add_event(self, name: str, time_ns: int | None = None, **attrs: Any) -> None:
        self.span.add_event(name, _attrs(attrs), timestamp=time_ns)

    def add_link(self, trace_headers: dict | None, **attrs: Any) -> None:
        pending = self._pending
        if attrs or pending is None:        # a link of its own (its attributes are this call's), or ended
            self.flush_links()
            link = new_link(trace_headers, _attrs(attrs))
            if link is not None:
                self.span.add_link(link.context, link.attributes)
            return
        # NOTE: called for every request of every step; our own headers (a
        # traceparent alone) take the first branch, one cache look-up.
        if trace_headers is not None and len(trace_headers) == 1 and "traceparent" in trace_headers:
            link = link_for(trace_headers["traceparent"])
        else:
            link = shared_link(trace_headers)
        if link is not None:
            pending.append(link)

    def add_links(self, headers: Iterable[dict | None]) -> None:
        global _links_memo
        pending = self._pending
        if pending is not None:
            # NOTE: the same tuple as the last call's (a step serving the same
            # requests as the step before: StepTracer.request_headers): the same
            # links, made once. A tuple cannot change, and the memo holds it,
            # so its identity is not reused by another.
            memo = _links_memo
            if headers is memo[0]:
                pending.extend(memo[1])
                return
        headers = headers if isinstance(headers, (list, tuple)) else list(headers)
        if pending is not None:
            try:
                # NOTE: our own headers (a traceparent alone each): the batch goes
                # through C-level passes (len, item, cache look-up), none in Python.
                if set(map(len, headers)) <= {1}:
                    found = list(map(link_for, map(_TRACEPARENT, headers)))
                    links: list[Link] = (cast("list[Link]", found) if None not in found
                                         else [lk for lk in found if lk is not None])
                    pending.extend(links)
                    if type(headers) is tuple:
                        _links_memo = (headers, links)
                    return
            except (KeyError, TypeError):     # another spelling or shape: one by one
                pass
        for trace_headers in headers:
            self.add_link(trace_headers)

    def flush_links(self) -> None:
        """Hand the pending links to the span."""
        if self._pending:
            _extend_links(self.span, self._pending)
            self._pending = []

    def trace_headers(self) -> dict[str, str]:
        return headers_of(self.span.get_span_context())

    def end(self, end_ns: int | None = None) -> None:
        self.flush_links()
        self._pending = None
        self.span.end(end_time=end_ns)


class _Scope:
    """span(): start a span, make it current, end it on exit (faster than a generator)."""
    __slots__ = ("recorder", "name", "attrs", "links", "handle", "token")

    def __init__(self, recorder: OTelRecorder, name: str, attrs: dict, links: list | None) -> None:
        self.recorder, self.name, self.attrs, self.links = recorder, name, attrs, links

    def __enter__(self) -> OTelSpan:
        if self.links:
            links = [lk for lk in map(new_link, self.links) if lk is not None]
            span = self.recorder.tracer.start_span(self.name, attributes=_attrs(self.attrs), links=links)
        else:
            span = self.recorder._new_span(self.name, None, _attrs(self.attrs))
        self.token = otel_context.attach(trace.set_span_in_context(span))
        self.handle = OTelSpan(span)
        return self.handle

    def __exit__(self, exc_type, exc, tb) -> None:
        span = self.handle.span
        if exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))
        otel_context.detach(self.token)
        self.handle.end()


class OTelRecorder(Recorder):

    def __init__(self, level: str, service_name: str | None = None, process_kind: str = "frontend",
                 process_name: str | None = None, store: RunStore | None = None,
                 otlp_traces_endpoint: str | None = None,
                 exporters: Sequence[SpanExporter] = ()) -> None:
        if level not in LEVELS or level == "off":
            raise ValueError(f"OTelRecorder needs level 'spans' or 'full', got {level!r}")
        self.level = level
        self.store = store
        self.run_path = store.path if store else None
        self.process_name = process_name or f"{process_kind}-{os.getpid()}"
        service_name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "vllm_anatomy"
        resource = Resource.create({"service.name": service_name, "process.pid": os.getpid(),
                                    "vllm_anatomy.process.kind": process_kind,
                                    "vllm_anatomy.process.name": self.process_name})
        # NOTE: OpenTelemetry keeps at most 128 links per span by default and
        # silently drops the rest; a step links to each request it serves, and
        # a batch can be much larger than 128 (OTEL_SPAN_LINK_COUNT_LIMIT wins).
        max_links = int(os.environ.get("OTEL_SPAN_LINK_COUNT_LIMIT", MAX_LINKS_PER_SPAN))
        limits = SpanLimits(max_links=max_links)
        self.provider = TracerProvider(resource=resource, span_limits=limits)
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        # NOTE: child spans of sampled parents skip the SDK's tracer (local_span.py);
        # they reach the same processors through the sink.
        self.sink = SpanSink(self.provider, limits, self.tracer, TRACER_NAME)
        if store is not None:
            # NOTE: a short delay so the live dashboard (and a crash) lose little.
            self._add_processor(BatchSpanProcessor(StoreSpanExporter(store), schedule_delay_millis=200))
        live = make_otlp_exporter(otlp_traces_endpoint)
        for exporter in ([live] if live else []) + list(exporters):
            self._add_processor(BatchSpanProcessor(exporter))
        self._closed = False
        atexit.register(self.shutdown)

    def _add_processor(self, processor: BatchSpanProcessor) -> None:
        self.provider.add_span_processor(processor)
        self.sink.add_processor(processor)

    def _new_span(self, name: str, remote_parent: trace.SpanContext | None, attrs: dict,
                  start_ns: int | None = None, kind: SpanKind = SpanKind.INTERNAL) -> trace.Span:
        """A span, not made current, under `remote_parent` if given, else under the current span."""
        parent = remote_parent if remote_parent is not None else trace.get_current_span().get_span_context()
        span: trace.Span | None = self.sink.start(name, parent, kind, attrs, start_ns)
        if span is None:                    # another sampler, an unsampled parent: the SDK decides
            context = (trace.set_span_in_context(trace.NonRecordingSpan(remote_parent))
                       if remote_parent is not None else None)
            span = self.tracer.start_span(name, context=context, kind=kind, attributes=attrs, start_time=start_ns)
        return span

    def span(self, name: str, links: list[dict] | None = None, **attrs: Any) -> _Scope:
        return _Scope(self, name, attrs, links)

    def record_span(self, name: str, start_ns: int, end_ns: int, **attrs: Any) -> None:
        self._new_span(name, None, _attrs(attrs), start_ns).end(end_time=end_ns)

    def start_span(self, name: str, trace_headers: dict | None = None, kind: str = "internal",
                   start_ns: int | None = None, **attrs: Any) -> OTelSpan:
        return OTelSpan(self._new_span(name, remote_span_context(trace_headers), _attrs(attrs), start_ns,
                                       _KINDS[kind]))

    def use_span(self, handle: SpanHandle) -> contextlib.AbstractContextManager:
        assert isinstance(handle, OTelSpan), "a span this recorder started"
        return trace.use_span(handle.span, end_on_exit=False)

    def event(self, name: str, **attrs: Any) -> None:
        trace.get_current_span().add_event(name, _attrs(attrs))

    def snapshot(self, kind: str, data: Any, step_id: int | None = None) -> None:
        if self.level == "full" and self.store is not None:
            self.store.write_snapshot(step_id, kind, self.process_name, data)

    def inject_trace_headers(self) -> dict[str, str]:
        return inject_trace_headers()

    def now_ns(self) -> int:
        return time.time_ns()

    def set_run_meta(self, key: str, value: Any) -> None:
        if self.store is not None:
            self.store.set_meta(key, value)

    def flush(self) -> None:
        self.provider.force_flush()
        if self.store is not None:
            self.store.flush()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.provider.shutdown()
        if self.store is not None:
            self.store.set_meta("end_time_ns", self.now_ns())
            self.store.close()
        atexit.unregister(self.shutdown)
