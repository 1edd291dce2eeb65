"""OTelRecorder: the Recorder backed by the OpenTelemetry SDK.

With deferred_span.py, local_span.py, trace_context.py (the W3C codec), span_export.py (where
finished spans go) and the exporters, the only modules that import
OpenTelemetry. Each process of a run builds one recorder, hence one
TracerProvider, whose resource names the service and the process
(process_resource: a service per process role, `vllm_anatomy.frontend`,
`vllm_anatomy.engine_core`, `vllm_anatomy.worker`, unless OTEL_SERVICE_NAME or
OTEL_RESOURCE_ATTRIBUTES name one; the service instance, pid, runtime and host
per OpenTelemetry's semantic conventions). The run store keeps each process'
resource in its meta table (`resource.<pid>`), so the file exports carry it
too. Spans the SDK's default sampler would record are ours: the engine's
thread writes each down as a DeferredSpan, and the exporter's thread builds
it into a LocalSpan (deferred_span.py, local_span.py: the SDK tracer's
per-span work was most of level spans' host cost); the others are the
provider's tracer's. A DeferredSpanProcessor (deferred_span.py: what the
SDK's BatchSpanProcessor does, building our spans as it exports) feeds
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
import platform
import socket
import sys
import time
import uuid
from typing import Any, Iterable, Iterator, Mapping, Sequence, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from vllm_anatomy.tracing.deferred_span import DeferredSpan, DeferredSpanProcessor, SpanSink
from vllm_anatomy.tracing.local_span import LocalSpan, _kept
from vllm_anatomy.tracing.recorder import LEVELS, Recorder, SpanHandle, StepRef
from vllm_anatomy.tracing.span_export import StoreSpanExporter, make_otlp_exporter
from vllm_anatomy.tracing.store import RunStore, to_json
from vllm_anatomy.tracing.trace_context import (headers_of, link_for, new_link,
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


def _context_of(cause: Any) -> trace.SpanContext | None:
    """The span context of a cause: a handle of ours, or W3C headers (None for None)."""
    if cause is None:
        return None
    if isinstance(cause, OTelSpan):
        return cause.span.get_span_context()
    return remote_span_context(cause)


def _extend_links(span: trace.Span, links: list[Link]) -> None:
    """span.add_link(...) for each of `links`, in one batch.

    NOTE: the SDK span keeps its links in a BoundedList (`_links`), whose
    extend counts what the limit drops as add_link would. An ended span, or
    an SDK whose span keeps its links otherwise, takes the public path.
    test_links_take_the_batch_path_on_sdk_spans pins that the installed SDK takes the fast one."""
    if type(span) is DeferredSpan or type(span) is LocalSpan:
        span.extend_links(links)
        return
    bounded = getattr(span, "_links", None)
    if type(bounded) is BoundedList and span.is_recording():
        bounded.extend(links)
    else:
        for link in links:
            span.add_link(link.context, link.attributes)


def _attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
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


_PLAIN = frozenset(_SCALARS)
_STR = frozenset((str,))


def _kept_attrs(attrs: Mapping[str, Any]) -> dict[str, Any] | None:
    """local_span._kept(_attrs(attrs)): the attributes as a DeferredSpan keeps them, or None
    where the caller must take the general path (_attrs, then the span's set_attributes)."""
    # NOTE: most calls carry scalars under our own (str) keys: checked in C-level passes, copied as is.
    if set(map(type, attrs.values())) <= _PLAIN and set(map(type, attrs)) <= _STR and "" not in attrs:
        return dict(attrs)
    return _kept(_attrs(attrs))


def _set_attributes(span: trace.Span, attrs: Mapping[str, Any]) -> None:
    """span.set_attributes(_attrs(attrs)); on a DeferredSpan in one pass where the values are plain."""
    if type(span) is DeferredSpan:
        kept = _kept_attrs(attrs)
        if kept is not None:
            span.set_kept_attributes(kept)
            return
    span.set_attributes(_attrs(attrs))


class _Use:
    """use_span(): make a started span current inside, without ending it; an exception
    leaving the block is recorded on it, as OpenTelemetry's use_span does (a class: entered
    for every request's admission and every step)."""
    __slots__ = ("span", "token")

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def __enter__(self) -> trace.Span:
        self.token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, exc_type, exc, tb) -> None:
        otel_context.detach(self.token)
        if exc is not None and self.span.is_recording():
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))


class OTelSpan(SpanHandle):
    """SpanHandle over an OpenTelemetry span (a DeferredSpan, a LocalSpan or the SDK's): what
    span() yields and start_span() returns.

    NOTE: links added without attributes wait in `_pending` and join the
    span in one batch when the handle ends it (before the span is exported,
    so the exported links, and their order, are what add_link was given).
    After end `_pending` is None and add_link takes the SDK's path, which
    ignores (and warns about) a link added to an ended span."""
    __slots__ = ("span", "_pending", "_headers")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self._pending: list[Link] | None = []
        self._headers: dict[str, str] | None = None

    def set_attribute(self, key: str, value: Any) -> None:
        span = self.span
        if type(value) in _SCALARS:         # NOTE: exact types: a bool subclass or numpy scalar is converted
            if type(span) is DeferredSpan and type(key) is str and key:
                span.set_kept_attributes({key: value})
            else:
                span.set_attribute(key, value)
        else:
            _set_attributes(span, {key: value})

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        """All at once: one pass of the span's attribute bookkeeping, not one per key."""
        _set_attributes(self.span, attributes)

    def add_event(self, name: str, time_ns: int | None = None, **attrs: Any) -> None:
        span = self.span
        if type(span) is DeferredSpan:
            kept = _kept_attrs(attrs) if attrs else None
            if kept is not None or not attrs:
                span.add_kept_event(name, kept, time_ns)
                return
        span.add_event(name, _attrs(attrs), timestamp=time_ns)

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
        # (a span's context never changes: its headers are made once; each caller gets its own dict)
        headers = self._headers
        if headers is None:
            headers = self._headers = headers_of(self.span.get_span_context())
        return dict(headers)

    def end(self, end_ns: int | None = None) -> None:
        if self._pending:
            self.flush_links()
        self._pending = None
        self.span.end(end_time=end_ns)


class _Scope(OTelSpan):
    """span(): start a span, make it current, end it on exit (faster than a generator).
    The scope is the span's handle too (what `with recorder.span(...) as handle` gives)."""
    __slots__ = ("recorder", "name", "attrs", "links", "follows", "token")

    def __init__(self, recorder: OTelRecorder, name: str, attrs: dict, links: list | None,
                 follows: trace.SpanContext | None = None) -> None:
        self.recorder, self.name, self.attrs, self.links, self.follows = recorder, name, attrs, links, follows

    def __enter__(self) -> OTelSpan:
        recorder = self.recorder
        span: trace.Span | None
        # (the current context, read once: the parent is in it, and the span's own context extends it)
        context = otel_context.get_current()
        if self.links:
            links = [lk for lk in map(new_link, self.links) if lk is not None]
            span = recorder.tracer.start_span(self.name, attributes=_attrs(self.attrs), links=links)
        elif self.follows is None:
            # NOTE: _new_span(name, None, attrs) for a child of the current span, the common
            # case, in fewer calls (a child of a span of ours in the fewest: SpanSink.child);
            # a follower or the SDK's span takes _new_span itself.
            current = trace.get_current_span(context)
            span = recorder.sink.child(self.name, current)
            if span is None:
                parent = current.get_span_context()
                if parent is not recorder._follow:
                    span = recorder.sink.start(self.name, parent, SpanKind.INTERNAL)
            if span is None:
                span = recorder._new_span(self.name, None, self.attrs)
            elif self.attrs:
                _set_attributes(span, self.attrs)
        else:
            span = recorder._new_span(self.name, None, self.attrs, follows=self.follows)
        self.token = otel_context.attach(trace.set_span_in_context(span, context))
        self.span, self._pending, self._headers = span, [], None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        span = self.span
        if exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))
        otel_context.detach(self.token)
        self.end()


def process_resource(process_kind: str, process_name: str, service_name: str | None = None) -> dict[str, Any]:
    """The resource attributes of one process of a run (OpenTelemetry semantic conventions).

    service.name: `service_name` if given, else what OTEL_SERVICE_NAME or
    OTEL_RESOURCE_ATTRIBUTES say (Resource.create reads them: left out here), else one
    service per process role, `vllm_anatomy.<process_kind>`: Jaeger lists each, and its
    process view tells their instances apart by service.instance.id, pid and host."""
    from vllm_anatomy import __version__
    attrs: dict[str, Any] = {
        "service.namespace": "vllm_anatomy", "service.instance.id": str(uuid.uuid4()),
        "service.version": __version__,
        "process.pid": os.getpid(), "process.executable.name": os.path.basename(sys.executable),
        "process.runtime.name": sys.implementation.name, "process.runtime.version": platform.python_version(),
        "host.name": socket.gethostname(), "host.arch": _HOST_ARCH.get(platform.machine(), platform.machine()),
        "os.type": sys.platform if sys.platform != "win32" else "windows",
        "vllm_anatomy.process.kind": process_kind, "vllm_anatomy.process.name": process_name}
    env_service = os.environ.get("OTEL_SERVICE_NAME") or _env_resource_attributes().get("service.name")
    if service_name or not env_service:
        attrs["service.name"] = service_name or f"vllm_anatomy.{process_kind}"
    return attrs


# platform.machine() -> the semantic conventions' host.arch
_HOST_ARCH = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64", "i686": "x86",
              "ppc64le": "ppc64", "s390x": "s390x"}


def _env_resource_attributes() -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES (key=value,... percent-encoded) as a dict."""
    from urllib.parse import unquote
    out = {}
    for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[key.strip()] = unquote(value.strip())
    return out


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
        resource = Resource.create(process_resource(process_kind, self.process_name, service_name))
        # NOTE: OpenTelemetry keeps at most 128 links per span by default and
        # silently drops the rest; a step links to each request it serves, and
        # a batch can be much larger than 128 (OTEL_SPAN_LINK_COUNT_LIMIT wins).
        max_links = int(os.environ.get("OTEL_SPAN_LINK_COUNT_LIMIT", MAX_LINKS_PER_SPAN))
        limits = SpanLimits(max_links=max_links)
        self.provider = TracerProvider(resource=resource, span_limits=limits)
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        # NOTE: child spans of sampled parents skip the SDK's tracer (deferred_span.py);
        # they reach the same processors through the sink.
        self.sink = SpanSink(self.provider, limits, self.tracer, TRACER_NAME)
        if store is not None:
            # The process, as the exports show it (tracing/exporters).
            store.set_meta(f"resource.{os.getpid()}", dict(resource.attributes))
            # NOTE: a short delay so the live dashboard (and a crash) lose little.
            self._add_processor(StoreSpanExporter(store), schedule_delay_millis=200)
        self.live_exporter = make_otlp_exporter(otlp_traces_endpoint)
        for exporter in ([self.live_exporter] if self.live_exporter else []) + list(exporters):
            self._add_processor(exporter)
        # The caller whose work follows (remote_parent(follows=True)), and the step being worked on.
        self._follow: trace.SpanContext | None = None
        self._step: StepRef | None = None
        self._closed = False
        atexit.register(self.shutdown)

    def _add_processor(self, exporter: SpanExporter, **options: Any) -> None:
        """A DeferredSpanProcessor for `exporter` (deferred_span.py: BatchSpanProcessor's job)."""
        processor = DeferredSpanProcessor(exporter, **options)
        self.provider.add_span_processor(processor)
        self.sink.add_processor(processor)

    def _new_span(self, name: str, remote_parent: trace.SpanContext | None, attrs: dict,
                  start_ns: int | None = None, kind: SpanKind = SpanKind.INTERNAL,
                  follows: trace.SpanContext | None = None, root: bool = False) -> trace.Span:
        """A span, not made current: under `remote_parent` if given, else under the current
        span; or, given `follows`, a follower of that span (recorder.py: "Followers").
        `attrs` as the recorder's callers give them (_attrs converts them)."""
        parent: trace.SpanContext | None
        if root:
            parent = trace.INVALID_SPAN_CONTEXT
        elif follows is None and remote_parent is None:
            parent = trace.get_current_span().get_span_context()
            if parent is self._follow and parent is not None:
                follows = parent                # (the top span of a call nothing waits for)
        else:
            parent = remote_parent
        if follows is not None:
            span: trace.Span | None = self.sink.start_follower(name, follows, kind, start_ns)
            if span is not None:
                if attrs:
                    _set_attributes(span, attrs)
                return span
            # NOTE: the SDK's tracer cannot make a follower: a child of the cause instead.
            remote_parent = follows
            parent = follows
        assert parent is not None
        span = self.sink.start(name, parent, kind, start_ns)
        if span is not None:
            # (as given to the span's start: its first change)
            if attrs:
                _set_attributes(span, attrs)
            return span
        # another sampler, an unsampled parent: the SDK decides
        context = (trace.set_span_in_context(trace.NonRecordingSpan(remote_parent))
                   if remote_parent is not None else otel_context.Context() if root else None)
        return self.tracer.start_span(name, context=context, kind=kind, attributes=_attrs(attrs),
                                      start_time=start_ns)

    def span(self, name: str, links: list[dict] | None = None, *, follows_from: Any = None, **attrs: Any) -> _Scope:
        return _Scope(self, name, attrs, links, None if follows_from is None else _context_of(follows_from))

    def record_span(self, name: str, start_ns: int, end_ns: int, *, parent: SpanHandle | None = None,
                    follows_from: Any = None, **attrs: Any) -> OTelSpan:
        span = self._new_span(name, _context_of(parent), attrs, start_ns, follows=_context_of(follows_from))
        span.end(end_time=end_ns)
        return OTelSpan(span)

    def start_span(self, name: str, trace_headers: dict | None = None, kind: str = "internal",
                   start_ns: int | None = None, *, parent: SpanHandle | None = None,
                   follows_from: Any = None, root: bool = False, **attrs: Any) -> OTelSpan:
        # (None, the common case for each, costs no call)
        remote = (None if parent is None else _context_of(parent)) or (
            None if not trace_headers else remote_span_context(trace_headers))
        return OTelSpan(self._new_span(name, remote, attrs, start_ns, _KINDS[kind],
                                       follows=None if follows_from is None else _context_of(follows_from),
                                       root=root and remote is None))

    @contextlib.contextmanager
    def remote_parent(self, trace_headers: dict | None, follows: bool = False,
                      step_headers: dict | None = None) -> Iterator[None]:
        remote = remote_span_context(trace_headers)
        saved = self._follow, self._step
        token = otel_context.attach(trace.set_span_in_context(trace.NonRecordingSpan(remote))) if remote else None
        self._follow = remote if follows else None
        self._step = StepRef(step_headers, follows) if step_headers else None
        try:
            yield
        finally:
            self._follow, self._step = saved
            if token is not None:
                otel_context.detach(token)

    def has_current_span(self) -> bool:
        return trace.get_current_span().get_span_context().is_valid

    def is_current(self, trace_headers: dict | None) -> bool:
        named = remote_span_context(trace_headers)
        current = trace.get_current_span().get_span_context()
        return named is not None and named.span_id == current.span_id and named.trace_id == current.trace_id

    def use_span(self, handle: SpanHandle) -> contextlib.AbstractContextManager:
        assert isinstance(handle, OTelSpan), "a span this recorder started"
        return _Use(handle.span)

    def event(self, name: str, **attrs: Any) -> None:
        trace.get_current_span().add_event(name, _attrs(attrs))

    def snapshot(self, kind: str, data: Any, step_id: int | None = None) -> None:
        if self.level == "full" and self.store is not None:
            self.store.write_snapshot(step_id, kind, self.process_name, data)

    def inject_trace_headers(self) -> dict[str, str]:
        # (what inject_trace_headers() writes, without the propagator: see headers_of)
        return headers_of(trace.get_current_span().get_span_context())

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
