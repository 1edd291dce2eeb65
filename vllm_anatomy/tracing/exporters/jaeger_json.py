"""Jaeger UI upload format ("Search -> JSON File"): what Jaeger's own `/api/traces` returns.

    {"data": [{"traceID", "spans": [...], "processes": {"p1": {"serviceName", "tags"}}, "warnings"}],
     "total": 0, "limit": 0, "offset": 0, "errors": null}

The span JSON is the one Jaeger v1.75.0's query service makes from the same
spans received over OTLP (its adjusters, then OpenTelemetry's OTLP-to-Jaeger
mapping, then its UI model):
- times in microseconds since the epoch (start and duration truncated), ids as lowercase hex;
- references: the parent as CHILD_OF first, then each link as FOLLOWS_FROM;
- tags: `otel.scope.name` (and `otel.scope.version`), the attributes sorted by key, then
  `span.kind` (also "internal"), `otel.status_code` (OK / ERROR), `error` (true on ERROR),
  `otel.status_description`; a list attribute is a string, the list as compact JSON
  (`[1,2,3]`, `["stop"]`), an integer beyond 2^53 a string too;
- logs: the events sorted by name, each `event` (its name) first, then its attributes sorted;
- processes: one per distinct resource in the trace ("p1", "p2", ... as first met), the
  service from `service.name`, the other resource attributes sorted by key as tags;
- warnings: what Jaeger's clock-skew adjuster would say about the span
  (tracing/trace_check.py), null when nothing.
Runs recorded before the resources were kept (meta `resource.<pid>`) show the service,
process kind and pid they do have.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

JS_MAX_SAFE_INTEGER = (1 << 53) - 1


def _go_json(value: Any) -> str:
    """Compact JSON as Go's encoding/json writes it (a list attribute's string in Jaeger)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _go_float(value)
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
        return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
                .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_go_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_go_json(str(k))}:{_go_json(v)}" for k, v in sorted(value.items())) + "}"
    if value is None:
        return "null"
    return _go_json(str(value))


def _go_float(f: float) -> str:
    """Go's JSON float: shortest digits, plain notation for 1e-6 <= |f| < 1e21, else e-notation."""
    if math.isnan(f) or math.isinf(f):
        return json.dumps(str(f))
    if f == 0:
        return "0"
    a = abs(f)
    if 1e-6 <= a < 1e21:
        text = repr(f)
        if "e" in text or "E" in text:
            from decimal import Decimal
            text = format(Decimal(text), "f")
        return text[:-2] if text.endswith(".0") else text
    mant, _, exp = repr(f).partition("e")
    mant = mant[:-2] if mant.endswith(".0") else mant
    sign = exp[0] if exp[0] in "+-" else "+"
    digits = exp.lstrip("+-").lstrip("0") or "0"
    return f"{mant}e{sign}{digits.zfill(2)}"


def tag(key: str, value: Any) -> dict[str, Any]:
    """One Jaeger tag (KeyValue) for an OpenTelemetry attribute value."""
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64",
                "value": value if -JS_MAX_SAFE_INTEGER <= value <= JS_MAX_SAFE_INTEGER else str(value)}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, str):
        return {"key": key, "type": "string", "value": value}
    return {"key": key, "type": "string", "value": _go_json(value)}


def resource_of(span, resources: dict[int, dict]) -> dict[str, Any]:
    """The span's process resource: as recorded, else what the span row itself says."""
    recorded = resources.get(span.pid)
    if recorded:
        return recorded
    return {"service.name": span.service, "process.pid": span.pid, "vllm_anatomy.process.kind": span.process_kind}


def _references(s) -> list[dict[str, str]]:
    refs = []
    if s.parent_id:
        refs.append({"refType": "CHILD_OF", "traceID": s.trace_id, "spanID": s.parent_id})
    for lk in s.links:
        ref_type = "CHILD_OF" if lk.get("attributes", {}).get("opentracing.ref_type") == "child_of" else "FOLLOWS_FROM"
        if s.parent_id and lk["trace_id"] == s.trace_id and lk["span_id"] == s.parent_id:
            refs[0]["refType"] = ref_type        # (the parent, linked again: the link's type wins)
            continue
        refs.append({"refType": ref_type, "traceID": lk["trace_id"], "spanID": lk["span_id"]})
    return refs


def _tags(s) -> list[dict[str, Any]]:
    tags = [tag("otel.scope.name", s.scope_name)] if s.scope_name else []
    if s.scope_version:
        tags.append(tag("otel.scope.version", s.scope_version))
    tags += [tag(k, s.attributes[k]) for k in sorted(s.attributes)]
    tags.append(tag("span.kind", s.kind or "internal"))
    if s.status in ("OK", "ERROR"):
        tags.append(tag("otel.status_code", s.status))
    if s.status == "ERROR":
        tags.append(tag("error", True))
    if s.status_message:
        tags.append(tag("otel.status_description", s.status_message))
    return tags


def _logs(s) -> list[dict[str, Any]]:
    out = []
    for e in sorted(s.events, key=lambda e: e["name"]):
        attrs = e.get("attributes") or {}
        fields = [tag("event", e["name"])] if e["name"] and "event" not in attrs else []
        fields += [tag(k, attrs[k]) for k in sorted(attrs)]
        out.append({"timestamp": e["time_ns"] // 1000, "fields": fields})
    return out


def _process(resource: dict[str, Any]) -> dict[str, Any]:
    return {"serviceName": str(resource.get("service.name", "")),
            "tags": [tag(k, resource[k]) for k in sorted(resource) if k != "service.name"]}


def span_json(s, process_id: str, warnings: list[str] | None) -> dict[str, Any]:
    return {"traceID": s.trace_id, "spanID": s.span_id, "operationName": s.name, "references": _references(s),
            "startTime": s.start_ns // 1000, "duration": max(0, s.end_ns - s.start_ns) // 1000,
            "tags": _tags(s), "logs": _logs(s), "processID": process_id, "warnings": warnings or None}


def export(run) -> dict[str, Any]:
    from vllm_anatomy.tracing.trace_check import jaeger_warnings, resources_of
    spans = run.spans()
    resources = resources_of(run)
    by_trace: dict[str, list] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    data = []
    for trace_id, members in by_trace.items():
        warnings = jaeger_warnings(members, lambda s: resources.get(s.pid))
        processes: dict[str, str] = {}          # process JSON (as text) -> its id in this trace
        out_spans, out_processes = [], {}
        for s in members:
            process = _process(resource_of(s, resources))
            key = json.dumps(process, sort_keys=True)
            if key not in processes:
                processes[key] = f"p{len(processes) + 1}"
                out_processes[processes[key]] = process
            out_spans.append(span_json(s, processes[key], warnings.get(s.span_id)))
        data.append({"traceID": trace_id, "spans": out_spans, "processes": out_processes, "warnings": None})
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}
