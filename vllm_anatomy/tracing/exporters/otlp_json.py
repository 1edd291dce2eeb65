"""OTLP JSON (the protobuf JSON mapping of ExportTraceServiceRequest), one object.

    {"resourceSpans": [{"resource": {"attributes": [...]},
                        "scopeSpans": [{"scope": {"name", "version"}, "spans": [...]}]}]}

One resource per process of the run (its recorded resource attributes, meta
`resource.<pid>`; older runs: service, process kind and pid), one scope per
instrumentation scope. NOTE: ids are hex strings (the OTLP/JSON rule, not
base64), 64-bit integers and nanosecond times are JSON strings. Jaeger's UI does
not read this format itself: it hands an OTLP file to its server's
`/api/transform`, so it opens only in a UI served by a running Jaeger.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

_KIND = {"internal": 1, "server": 2, "client": 3, "producer": 4, "consumer": 5}
_STATUS = {"UNSET": 0, "OK": 1, "ERROR": 2}


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    if isinstance(v, dict):
        return {"kvlistValue": {"values": _attrs(v)}}
    return {"stringValue": str(v)}


def _attrs(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in d.items()]


def _span(s) -> dict[str, Any]:
    status: dict[str, Any] = {"code": _STATUS.get(s.status or "UNSET", 0)}
    if s.status_message:
        status["message"] = s.status_message
    out = {"traceId": s.trace_id, "spanId": s.span_id, "name": s.name, "kind": _KIND.get(s.kind, 1),
           "startTimeUnixNano": str(s.start_ns), "endTimeUnixNano": str(s.end_ns),
           "attributes": _attrs(s.attributes),
           "events": [{"timeUnixNano": str(e["time_ns"]), "name": e["name"],
                       "attributes": _attrs(e["attributes"])} for e in s.events],
           "links": [{"traceId": lk["trace_id"], "spanId": lk["span_id"], "attributes": _attrs(lk["attributes"])}
                     for lk in s.links],
           "status": status}
    if s.parent_id:
        out["parentSpanId"] = s.parent_id
    return out


def export(run) -> dict[str, Any]:
    from vllm_anatomy.tracing.exporters.jaeger_json import resource_of
    from vllm_anatomy.tracing.trace_check import resources_of
    resources = resources_of(run)
    groups: dict[tuple, dict[tuple[str, str], list]] = defaultdict(lambda: defaultdict(list))
    resource_attrs: dict[tuple, dict] = {}
    for s in run.spans():
        key = (s.service, s.process_kind, s.pid)
        resource_attrs.setdefault(key, resource_of(s, resources))
        groups[key][(s.scope_name, s.scope_version)].append(s)
    return {"resourceSpans": [
        {"resource": {"attributes": _attrs(resource_attrs[key])},
         "scopeSpans": [{"scope": {"name": name, **({"version": version} if version else {})},
                         "spans": [_span(s) for s in spans]} for (name, version), spans in scopes.items()]}
        for key, scopes in groups.items()]}
