"""Where finished spans go: rows of the run store (StoreSpanExporter, span_to_row)
and live OTLP (make_otlp_exporter); OTelRecorder hands each a BatchSpanProcessor.
"""
from __future__ import annotations

import functools
import operator
import os
from typing import Sequence
from urllib.parse import urlparse

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanKind, StatusCode

from vllm_anatomy.tracing.store import RunStore, to_json
from vllm_anatomy.tracing.trace_context import SharedLink, link_dict, plain_attributes

_KIND_NAMES = {kind: kind.name.lower() for kind in SpanKind}
_LINK_JSON = operator.attrgetter("json")     # (SharedLink's run-store text)
_RESOURCE_FIELDS: dict[int, tuple] = {}


class StoreSpanExporter(SpanExporter):
    """Writes finished spans into the run store (called on the batch processor's thread)."""

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.store.write_spans([span_to_row(s) for s in spans])
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_to_row(s) -> tuple:
    """A finished span as a run-store row (SPAN_COLUMNS' order).

    NOTE: runs on the exporter's thread but holds the GIL, so the engine's
    thread waits for it: every span of every step passes here once."""
    ctx, parent, attrs, events, links = s.context, s.parent, plain_attributes(s.attributes), s.events, s.links
    service, process_kind, pid = _resource_fields(s.resource)
    kind, status = s.kind, s.status.status_code
    request_id = attrs.get("vllm_anatomy.request_id")
    return (_trace_hex(ctx.trace_id), f"{ctx.span_id:016x}", f"{parent.span_id:016x}" if parent else None,
            s.name, "internal" if kind is SpanKind.INTERNAL else _KIND_NAMES[kind], s.start_time, s.end_time,
            to_json(attrs),
            to_json([{"name": e.name, "time_ns": e.timestamp, "attributes": plain_attributes(e.attributes)}
                     for e in events]) if events else "[]",
            _links_json(links) if links else "[]",
            "UNSET" if status is StatusCode.UNSET else status.name, service, process_kind, pid,
            attrs.get("vllm_anatomy.step_id"), str(request_id) if request_id is not None else None)


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
