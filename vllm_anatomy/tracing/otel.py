"""OTelRecorder: the Recorder backed by the OpenTelemetry SDK.

The only module (with the exporters) that imports OpenTelemetry. Each process
of a run builds one recorder, hence one TracerProvider, whose resource names
the service and the process (kind, name, pid). A BatchSpanProcessor feeds
    - the run store (tracing/store.py) when trace_dir is set, and
    - live OTLP (gRPC or HTTP/protobuf) when `otlp_traces_endpoint` is given
      (as vLLM's --otlp-traces-endpoint) or the standard OTEL_EXPORTER_OTLP_*
      environment variables name an endpoint.
Snapshots (level "full") go straight to the run store, one transaction each.

NOTE: the TracerProvider is not installed globally (set_tracer_provider can be
called once per process, and tests build several engines); but the *context*
is OpenTelemetry's global one, so an offline caller's active span becomes the
parent of the request spans, as in vLLM.
"""
from __future__ import annotations

import atexit
import functools
import os
import time
from typing import Any, Sequence
from urllib.parse import urlparse

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Span as SDKSpan
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from vllm_anatomy.tracing.recorder import LEVELS, Recorder, SpanHandle
from vllm_anatomy.tracing.store import RunStore, to_json

_PROPAGATOR = TraceContextTextMapPropagator()
# Links per span (a step links to every request of its batch: max_num_seqs of them).
MAX_LINKS_PER_SPAN = 8192
_KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT,
          "producer": SpanKind.PRODUCER, "consumer": SpanKind.CONSUMER}
_SCALARS = (str, bool, int, float)


# -- W3C trace context helpers (HTTP headers, EngineCoreRequest.trace_headers) ----------
def inject_trace_headers(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """traceparent/tracestate of the current (or given) context, as a header dict."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def extract_trace_context(headers: dict[str, str] | None) -> otel_context.Context | None:
    """The remote parent named by W3C headers; None when there is none."""
    span_context = _remote_span_context(headers)
    # (what TraceContextTextMapPropagator.extract builds from the same headers)
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context)) if span_context else None


def _link(headers: dict | None, attrs: dict | None = None) -> Link | None:
    span_context = _remote_span_context(headers)
    return Link(span_context, attrs or None) if span_context else None


def _remote_span_context(headers: dict[str, str] | None) -> trace.SpanContext | None:
    if not headers:
        return None
    lowered = {k.lower(): v for k, v in headers.items()}
    return _parse_w3c(lowered.get("traceparent"), lowered.get("tracestate"))


@functools.lru_cache(maxsize=16384)
def _parse_w3c(traceparent: str | None, tracestate: str | None) -> trace.SpanContext | None:
    """Parse W3C headers once per request, not once per step.

    NOTE: a step links to every request it serves: at batch 256 that was 256
    traceparent parses per step, the largest cost of tracing at level spans.
    A request's headers never change, so the parsed context is memoised."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent, **({"tracestate": tracestate} if tracestate else {})}
    span_context = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return span_context if span_context.is_valid else None


def _attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """OpenTelemetry accepts scalars and homogeneous sequences of them; the rest as text."""
    out = {}
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
    """SpanHandle over an SDK span: what span() yields and start_span() returns."""
    __slots__ = ("span",)

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attributes(_attrs({key: value}))

    def add_event(self, name: str, time_ns: int | None = None, **attrs: Any) -> None:
        self.span.add_event(name, _attrs(attrs), timestamp=time_ns)

    def add_link(self, trace_headers: dict | None, **attrs: Any) -> None:
        link = _link(trace_headers, _attrs(attrs))
        if link is not None:
            self.span.add_link(link.context, link.attributes)

    def trace_headers(self) -> dict[str, str]:
        return inject_trace_headers(trace.set_span_in_context(self.span))

    def end(self, end_ns: int | None = None) -> None:
        self.span.end(end_time=end_ns)


class _Scope:
    """span(): start a span, make it current, end it on exit (faster than a generator)."""
    __slots__ = ("tracer", "name", "attrs", "links", "span", "token")

    def __init__(self, tracer, name: str, attrs: dict, links: list | None) -> None:
        self.tracer, self.name, self.attrs, self.links = tracer, name, attrs, links

    def __enter__(self) -> OTelSpan:
        links = [lk for lk in map(_link, self.links) if lk is not None] if self.links else None
        self.span = self.tracer.start_span(self.name, attributes=_attrs(self.attrs), links=links)
        self.token = otel_context.attach(trace.set_span_in_context(self.span))
        return OTelSpan(self.span)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))
        otel_context.detach(self.token)
        self.span.end()


class StoreSpanExporter(SpanExporter):
    """Writes finished spans into the run store (called on the batch processor's thread)."""

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def export(self, spans: Sequence[SDKSpan]) -> SpanExportResult:
        self.store.write_spans([span_to_row(s) for s in spans])
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_to_row(s) -> tuple:
    ctx, res, attrs = s.context, s.resource.attributes, dict(s.attributes or {})
    events = [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
              for e in s.events]
    links = [{"trace_id": f"{lk.context.trace_id:032x}", "span_id": f"{lk.context.span_id:016x}",
              "attributes": dict(lk.attributes or {})} for lk in s.links]
    request_id = attrs.get("vllm_anatomy.request_id")
    return (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}",
            f"{s.parent.span_id:016x}" if s.parent else None, s.name, s.kind.name.lower(),
            s.start_time, s.end_time, to_json(attrs), to_json(events), to_json(links),
            s.status.status_code.name, res.get("service.name", ""),
            res.get("vllm_anatomy.process.kind", ""), res.get("process.pid", 0),
            attrs.get("vllm_anatomy.step_id"), str(request_id) if request_id is not None else None)


def make_otlp_exporter(endpoint: str | None) -> SpanExporter | None:
    """OTLP exporter for `endpoint` (grpc://, http(s)://, host:port) or the OTEL_* env vars."""
    env = os.environ
    if endpoint is None and not (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                                 or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if endpoint and endpoint.startswith("grpc://"):
        # NOTE: vLLM's spelling; the gRPC exporter wants http:// (plaintext) or https://.
        protocol, endpoint = "grpc", "http://" + endpoint[len("grpc://"):]
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        if endpoint and urlparse(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"OTLP protocol {protocol!r} is not supported (use grpc or http/protobuf)")


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
        self.provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_links=max_links))
        if store is not None:
            # NOTE: a short delay so the live dashboard (and a crash) lose little.
            self.provider.add_span_processor(BatchSpanProcessor(StoreSpanExporter(store),
                                                                schedule_delay_millis=200))
        live = make_otlp_exporter(otlp_traces_endpoint)
        for exporter in ([live] if live else []) + list(exporters):
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("vllm_anatomy")
        self._closed = False
        atexit.register(self.shutdown)

    def span(self, name: str, links: list[dict] | None = None, **attrs: Any) -> _Scope:
        return _Scope(self.tracer, name, attrs, links)

    def record_span(self, name: str, start_ns: int, end_ns: int, **attrs: Any) -> None:
        self.tracer.start_span(name, start_time=start_ns, attributes=_attrs(attrs)).end(end_time=end_ns)

    def start_span(self, name: str, trace_headers: dict | None = None, kind: str = "internal",
                   start_ns: int | None = None, **attrs: Any) -> OTelSpan:
        return OTelSpan(self.tracer.start_span(name, context=extract_trace_context(trace_headers),
                                               kind=_KINDS[kind], attributes=_attrs(attrs),
                                               start_time=start_ns))

    def use_span(self, handle: OTelSpan):
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

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.provider.shutdown()
        if self.store is not None:
            self.store.set_meta("end_time_ns", self.now_ns())
            self.store.close()
        atexit.unregister(self.shutdown)
