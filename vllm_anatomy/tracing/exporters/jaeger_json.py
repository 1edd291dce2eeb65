"""Jaeger UI upload format ("Search -> JSON File"): the query API's trace JSON.

    {"data": [{"traceID", "spans": [...], "processes": {"p1": {"serviceName", "tags"}}}]}

Times in microseconds since the epoch, ids as lowercase hex. A parent becomes a
CHILD_OF reference; a span link (a step serving a request) a FOLLOWS_FROM
reference into the other trace; span events become logs.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any


def _tag(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, str):
        return {"key": key, "type": "string", "value": value}
    return {"key": key, "type": "string", "value": json.dumps(value)}


def _span(s, process_id: str) -> dict[str, Any]:
    refs = []
    if s.parent_id:
        refs.append({"refType": "CHILD_OF", "traceID": s.trace_id, "spanID": s.parent_id})
    refs += [{"refType": "FOLLOWS_FROM", "traceID": lk["trace_id"], "spanID": lk["span_id"]} for lk in s.links]
    tags = [_tag(k, v) for k, v in s.attributes.items()]
    if s.kind != "internal":
        tags.append(_tag("span.kind", s.kind))
    if s.status == "ERROR":
        tags.append(_tag("error", True))
    logs = [{"timestamp": e["time_ns"] // 1000,
             "fields": [_tag("event", e["name"])] + [_tag(k, v) for k, v in e["attributes"].items()]}
            for e in s.events]
    return {"traceID": s.trace_id, "spanID": s.span_id, "operationName": s.name, "references": refs,
            "startTime": s.start_ns // 1000, "duration": max(0, (s.end_ns - s.start_ns) // 1000),
            "tags": tags, "logs": logs, "processID": process_id, "warnings": None, "flags": 1}


def export(run) -> dict[str, Any]:
    from vllm_anatomy.tracing.exporters import process_key
    spans = run.spans()
    pids: dict[tuple, str] = {}
    for s in spans:
        pids.setdefault(process_key(s), f"p{len(pids) + 1}")
    by_trace: dict[str, list] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    data = []
    for trace_id, members in by_trace.items():
        used = {pids[process_key(s)]: process_key(s) for s in members}
        processes = {pid: {"serviceName": key[0],
                           "tags": [_tag("vllm_anatomy.process.kind", key[1]), _tag("process.pid", key[2])]}
                     for pid, key in used.items()}
        data.append({"traceID": trace_id, "spans": [_span(s, pids[process_key(s)]) for s in members],
                     "processes": processes, "warnings": None})
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}
