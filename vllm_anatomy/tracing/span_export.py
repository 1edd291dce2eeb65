"""Where finished spans go: rows of the run store (StoreSpanExporter, span_to_row)
and live OTLP (make_otlp_exporter); OTelRecorder hands each a BatchSpanProcessor.

Live OTLP follows OpenTelemetry's exporter configuration
(specification/protocol/exporter.md), with vLLM's --otlp-traces-endpoint on top:
    endpoint   the argument (vLLM's flag, used as the traces endpoint), else
               OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (as is), else OTEL_EXPORTER_OTLP_ENDPOINT
               (HTTP: + "/v1/traces"); neither: no live export
    protocol   OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else what
               the endpoint says: a path ending in /v1/traces or port 4318 (OTLP/HTTP's) is
               http/protobuf, anything else gRPC (vLLM's default)
    headers, timeout, compression, certificates: OTEL_EXPORTER_OTLP_[TRACES_]* as the
               exporters read them
    OTEL_TRACES_EXPORTER=none turns live export off; OTEL_SDK_DISABLED=true all of it.
A protocol that contradicts the endpoint (gRPC to a /v1/traces URL), or one the SDK
cannot speak (http/json), is refused at start-up with a ValueError saying what to set.
A failed export is counted (CountingExporter) and reported once, with its cause;
the total lost is logged at shutdown.
"""
from __future__ import annotations

import functools
import logging
import operator
import os
import threading
from typing import Sequence
from urllib.parse import urlparse

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanKind, StatusCode

from vllm_anatomy.tracing.deferred_span import DeferredSpan, PlainSpan
from vllm_anatomy.tracing.gil_yield import offering_gil
from vllm_anatomy.tracing.store import RunStore, to_json
from vllm_anatomy.tracing.trace_context import SharedLink, link_dict, plain_attributes

logger = logging.getLogger(__name__)
TRACER_NAME = "vllm_anatomy"      # (the instrumentation scope of our own spans: otel.py's tracer)
_KIND_NAMES = {kind: kind.name.lower() for kind in SpanKind}
_LINK_JSON = operator.attrgetter("json")     # (SharedLink's run-store text)
_RESOURCE_FIELDS: dict[int, tuple] = {}


class StoreSpanExporter(SpanExporter):
    """Writes finished spans into the run store (called on the batch processor's thread).

    NOTE: it takes DeferredSpans as they are (DeferredSpanProcessor hands it the batch
    unbuilt): the row of one is made from its plain values (DeferredSpan.plain: the
    LocalSpan's, read without building it), else from the LocalSpan it builds."""
    takes_deferred_spans = True

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def export(self, spans: Sequence[ReadableSpan | DeferredSpan]) -> SpanExportResult:
        rows, details = [], []
        for s in offering_gil(spans):       # (gil_yield.py: the engine's thread waits little)
            if type(s) is DeferredSpan:
                plain = s.plain()
                if plain is not None:
                    rows.append(plain_span_to_row(plain, s._sink.resource))
                    continue                # (our scope, no status message: no details row)
                s = s.build()
            rows.append(span_to_row(s))
            if (row := span_details(s)) is not None:
                details.append(row)
        self.store.write_spans(rows)
        if details:
            self.store.write_span_details(details)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_to_row(s) -> tuple:
    """A finished span as a run-store row (SPAN_COLUMNS' order).

    NOTE: runs on the exporter's thread but holds the GIL, so the engine's
    thread waits for it: every span of every step passes here once."""
    events, status = s.events, s.status.status_code
    return _row(s.context, s.parent, s.name, s.kind, s.start_time, s.end_time, plain_attributes(s.attributes),
                to_json([{"name": e.name, "time_ns": e.timestamp, "attributes": plain_attributes(e.attributes)}
                         for e in events]) if events else "[]",
                s.links, "UNSET" if status is StatusCode.UNSET else status.name, s.resource)


def plain_span_to_row(s: PlainSpan, resource: Resource) -> tuple:
    """span_to_row of the LocalSpan a DeferredSpan stands for, from its plain values
    (status unset). NOTE: tests/tracing/test_deferred_spans.py holds the two equal."""
    events = s.events
    return _row(s.context, s.parent, s.name, s.kind, s.start_time, s.end_time, s.attributes,
                to_json([{"name": name, "time_ns": time_ns, "attributes": event_attrs}
                         for name, event_attrs, time_ns in events]) if events else "[]",
                s.links, "UNSET", resource)


def _row(ctx, parent, name: str, kind: SpanKind, start_time: int, end_time: int, attrs: dict, events_json: str,
         links, status: str, resource: Resource) -> tuple:
    """The row of a span given its plain attributes, its events as JSON and its status name."""
    service, process_kind, pid = _resource_fields(resource)
    request_id = attrs.get("vllm_anatomy.request_id")
    return (_trace_hex(ctx.trace_id), f"{ctx.span_id:016x}", f"{parent.span_id:016x}" if parent else None,
            name, "internal" if kind is SpanKind.INTERNAL else _KIND_NAMES[kind], start_time, end_time,
            to_json(attrs), events_json, _links_json(links) if links else "[]",
            status, service, process_kind, pid,
            attrs.get("vllm_anatomy.step_id"), str(request_id) if request_id is not None else None)


def span_details(s) -> tuple | None:
    """(trace id, span id, scope name, scope version, status message) of a span whose
    instrumentation scope is not ours (e.g. FastAPI's) or whose status has a message;
    None for the rest (docs/trace-format.md: span_details)."""
    scope, status = s.instrumentation_scope, s.status
    name, version = (scope.name, scope.version or "") if scope is not None else ("", "")
    message = status.description or ""
    if name == TRACER_NAME and not version and not message:
        return None
    ctx = s.context
    return (_trace_hex(ctx.trace_id), f"{ctx.span_id:016x}", name, version, message)


@functools.lru_cache(maxsize=1024)
def _trace_hex(trace_id: int) -> str:
    """NOTE: a step's spans share its trace id (and a request's, the request's): formatted once."""
    return f"{trace_id:032x}"


def _resource_fields(resource: Resource) -> tuple[str, str, int]:
    """(service, process kind, pid) of a resource (one per recorder)."""
    hit = _RESOURCE_FIELDS.get(id(resource))
    if hit is None or hit[0] is not resource:
        # NOTE: keyed by id and checked by identity (a Resource hashes by a JSON dump of its attributes).
        attrs = resource.attributes
        hit = _RESOURCE_FIELDS[id(resource)] = (resource, (attrs.get("service.name", ""),
                                                           attrs.get("vllm_anatomy.process.kind", ""),
                                                           attrs.get("process.pid", 0)))
    return hit[1]


def _links_json(links: Sequence[Link]) -> str:
    """to_json([link_dict(link) for link in links]), reusing the text of shared links.

    NOTE: a step span lists every request it served (hundreds), and each of
    those links is the same object step after step (link_for): its text is
    made once, with the link, not once per step."""
    try:
        # NOTE: all shared (our own step spans' links): one C-level pass, no Python per link.
        return "[" + ",".join(map(_LINK_JSON, links)) + "]"
    except AttributeError:
        return "[" + ",".join([lk.json if type(lk) is SharedLink else to_json(link_dict(lk)) for lk in links]) + "]"


HTTP_PORT, GRPC_PORT = 4318, 4317


def otlp_settings(endpoint: str | None) -> tuple[str, str | None] | None:
    """(protocol, endpoint to hand the exporter: None = let it read the environment) of the
    live OTLP export, or None when there is none. Raises ValueError for a setting that
    would lose every span (see the module docstring)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters = {x.strip() for x in env.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",")}
    if "none" in exporters:
        return None
    if "otlp" not in exporters:
        raise ValueError(f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: vllm_anatomy exports "
                         "traces over OTLP only (or none)")
    traces_env, base_env = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint is None and not (traces_env or base_env):
        return None
    named = endpoint or traces_env or base_env
    assert named is not None
    if endpoint is None and not traces_env and urlparse(named).path.rstrip("/").endswith("/v1/traces"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_ENDPOINT={named!r} names the traces path, but it is the base URL "
                         "(the exporter appends /v1/traces to it): set OTEL_EXPORTER_OTLP_TRACES_ENDPOINT instead")
    implied = _implied_protocol(named, signal_path=endpoint is not None or bool(traces_env))
    if named.startswith("grpc://"):
        # NOTE: vLLM's spelling; the gRPC exporter wants http:// (plaintext) or https://.
        named = "http://" + named[len("grpc://"):]
        endpoint = named if endpoint is not None else endpoint
        implied = "grpc"
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or implied or "grpc").strip()
    where = f"the OTLP traces endpoint {named!r}"
    if protocol == "http/json":
        raise ValueError("OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL=http/json: the OpenTelemetry Python SDK has no "
                         "OTLP/JSON exporter; use http/protobuf or grpc")
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTLP protocol {protocol!r} is not supported (use grpc or http/protobuf)")
    if implied is not None and protocol != implied:
        raise ValueError(f"{where} is an {'OTLP/HTTP' if implied == 'http/protobuf' else 'OTLP/gRPC'} one "
                         f"({'port 4318 or a /v1/traces path' if implied == 'http/protobuf' else 'port 4317 or grpc://'}), "
                         f"but the protocol is {protocol}: set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={implied}, "
                         f"or give the endpoint of the protocol you set")
    if protocol == "http/protobuf" and not named.startswith(("http://", "https://")):
        raise ValueError(f"{where}: OTLP/HTTP needs an http:// or https:// URL")
    if protocol == "http/protobuf" and endpoint is not None and urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return protocol, endpoint


def _implied_protocol(url: str, signal_path: bool) -> str | None:
    """What an endpoint says about its protocol: OTLP/HTTP's port or its traces path, gRPC's port."""
    parsed = urlparse(url if "://" in url else "//" + url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if port == HTTP_PORT or (signal_path and parsed.path.rstrip("/").endswith("/v1/traces")):
        return "http/protobuf"
    if port == GRPC_PORT:
        return "grpc"
    return None


def make_otlp_exporter(endpoint: str | None) -> SpanExporter | None:
    """The live OTLP exporter (counting its failures), or None; see otlp_settings."""
    settings = otlp_settings(endpoint)
    if settings is None:
        return None
    protocol, endpoint = settings
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        inner: SpanExporter = GrpcExporter(endpoint=endpoint)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        inner = HttpExporter(endpoint=endpoint)
    where = getattr(inner, "_endpoint", None) or endpoint or "(from the environment)"
    return CountingExporter(inner, f"{protocol} {where}")


class CountingExporter(SpanExporter):
    """A live exporter whose failures are counted and reported once.

    NOTE: the OTLP exporters retry a failing export until their timeout
    (OTEL_EXPORTER_OTLP_TIMEOUT, 10 s) and then log and drop the batch, again
    for every batch. Here the first failure is logged once (where, why, how
    many spans); later ones are only counted, and the total is logged once at
    shutdown. After a failure the next COOLDOWN_S seconds of batches are
    dropped at once (counted too): a collector that is not there costs one
    timeout, not one per batch (or per shutdown flush)."""
    COOLDOWN_S = 5.0

    def __init__(self, inner: SpanExporter, where: str) -> None:
        self.inner = inner
        self.where = where
        self.exported = self.failed_spans = self.failed_exports = 0
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        import time
        if time.monotonic() < self._retry_at:
            self._count_failure(len(spans), None)
            return SpanExportResult.FAILURE
        why: Exception | None = None
        try:
            result = self.inner.export(spans)
        except Exception as e:                   # noqa: BLE001 (an exporter must not raise into the SDK)
            result, why = SpanExportResult.FAILURE, e
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            return result
        self._retry_at = time.monotonic() + self.COOLDOWN_S
        self._count_failure(len(spans), why)
        return result

    def _count_failure(self, num_spans: int, why: Exception | None) -> None:
        with self._lock:
            first = self.failed_exports == 0
            self.failed_exports += 1
            self.failed_spans += num_spans
        if first:
            logger.warning("OTLP trace export to %s failed%s: %d spans lost. Later failures are counted, not "
                           "logged; the total is logged at shutdown.", self.where,
                           f" ({why!r})" if why is not None else "", num_spans)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.inner.shutdown()
        if self.failed_exports > 1:
            logger.warning("OTLP trace export to %s: %d of %d spans lost in %d failed exports.", self.where,
                           self.failed_spans, self.failed_spans + self.exported, self.failed_exports)
