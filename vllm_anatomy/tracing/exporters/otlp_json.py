"""OTLP JSON (the protobuf JSON mapping of ExportTraceServiceRequest), one object.

    {"resourceSpans": [{"resource": {"attributes": [...]},
                        "scopeSpans": [{"scope": {"name": "vllm_anatomy"}, "spans": [...]}]}]}

NOTE: ids are hex strings (the OTLP/JSON rule, and what Jaeger's upload expects;
not base64), 64-bit integers and nanosecond times are JSON strings.
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
    return {"stringValue": str(v)}


def _attrs(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in d.items()]


def _span(s) -> dict[str, Any]:
    out = {"traceId": s.trace_id, "spanId": s.span_id, "name": s.name, "kind": _KIND.get(s.kind, 1),
           "startTimeUnixNano": str(s.start_ns), "endTimeUnixNano": str(s.end_ns),
           "attributes": _attrs(s.attributes),
           "events": [{"timeUnixNano": str(e["time_ns"]), "name": e["name"],
                       "attributes": _attrs(e["attributes"])} for e in s.events],
           "links": [{"traceId": lk["trace_id"], "spanId": lk["span_id"], "attributes": _attrs(lk["attributes"])}
                     for lk in s.links],
           "status": {"code": _STATUS.get(s.status or "UNSET", 0)}}
    if s.parent_id:
        out["parentSpanId"] = s.parent_id
    return out


def export(run) -> dict[str, Any]:
    from vllm_anatomy.tracing.exporters import process_key
    groups: dict[tuple, list] = defaultdict(list)
    for s in run.spans():
        groups[process_key(s)].append(s)
    return {"resourceSpans": [
        {"resource": {"attributes": _attrs({"service.name": service, "vllm_anatomy.process.kind": kind,
                                            "process.pid": pid})},
         "scopeSpans": [{"scope": {"name": "vllm_anatomy"}, "spans": [_span(s) for s in spans]}]}
        for (service, kind, pid), spans in groups.items()]}
