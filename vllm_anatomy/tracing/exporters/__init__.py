"""File exporters over a run store: Jaeger UI JSON, OTLP JSON, Chrome trace-event JSON (Perfetto).

Each module has `export(run) -> dict` (a JSON-able object); `EXPORTERS` maps the
CLI's --format names to them.
"""
from __future__ import annotations

from vllm_anatomy.tracing.exporters import jaeger_json, otlp_json, perfetto

EXPORTERS = {"jaeger": jaeger_json.export, "otlp-json": otlp_json.export, "perfetto": perfetto.export}


def process_key(span) -> tuple[str, str, int]:
    """Spans of one process share (service, process kind, pid)."""
    return (span.service, span.process_kind, span.pid)
