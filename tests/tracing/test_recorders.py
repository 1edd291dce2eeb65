"""Recorder API without a model: nesting, links, explicit-time spans, request
spans, W3C trace-context round trip, for InMemoryRecorder and OTelRecorder."""
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from vllm_anatomy.tracing.otel import OTelRecorder
from vllm_anatomy.tracing.trace_context import extract_trace_context, inject_trace_headers
from vllm_anatomy.tracing.recorder import InMemoryRecorder, NullRecorder, parse_traceparent


def _drive(rec):
    """What the engine does: a request span; a step span linking to it; a device-lane span."""
    req = rec.start_span("llm_request", kind="server", **{"gen_ai.request.model": "m"})
    req.add_event("QUEUED")
    with rec.use_span(req):
        with rec.span("EngineCore.add_request"):
            pass
    headers = req.trace_headers()
    t0 = rec.now_ns()
    with rec.span("EngineCore.step", links=[headers], **{"vllm_anatomy.step_id": 1}) as step:
        with rec.span("Scheduler.schedule"):
            rec.event("admitted")
        step.set_attribute("vllm_anatomy.num_reqs", 1)
    rec.record_span("device.forward", t0 + 10, t0 + 20, **{"vllm_anatomy.lane": "device"})
    req.add_event("FINISHED", **{"vllm_anatomy.finish_reason": "stop"})
    req.end()
    return headers


def test_null_recorder_is_inert():
    rec = NullRecorder()
    assert _drive(rec) == {} and rec.inject_trace_headers() == {} and not rec.enabled


def test_in_memory_recorder_structure():
    rec = InMemoryRecorder("spans")
    headers = _drive(rec)
    by = {s.name: s for s in rec.spans}
    req, step = by["llm_request"], by["EngineCore.step"]
    assert parse_traceparent(headers) == (req.trace_id, req.span_id)
    assert by["EngineCore.add_request"].parent_id == req.span_id
    assert by["Scheduler.schedule"].parent_id == step.span_id and step.parent_id is None
    assert step.trace_id != req.trace_id and step.links == [(req.trace_id, req.span_id)]
    assert by["device.forward"].duration_ns == 10
    assert [e.name for e in req.events] == ["QUEUED", "FINISHED"]
    assert rec.events[0].span_id == by["Scheduler.schedule"].span_id
    assert step.attrs["vllm_anatomy.num_reqs"] == 1


def test_otel_recorder_structure():
    exporter = InMemorySpanExporter()
    rec = OTelRecorder("spans", service_name="svc", process_kind="engine_core", exporters=[exporter])
    headers = _drive(rec)
    rec.shutdown()
    by = {s.name: s for s in exporter.get_finished_spans()}
    req, step = by["llm_request"], by["EngineCore.step"]
    assert headers["traceparent"].split("-")[2] == f"{req.context.span_id:016x}"
    assert by["EngineCore.add_request"].parent.span_id == req.context.span_id
    assert by["Scheduler.schedule"].parent.span_id == step.context.span_id and step.parent is None
    assert step.context.trace_id != req.context.trace_id
    assert [lk.context.span_id for lk in step.links] == [req.context.span_id]
    dev = by["device.forward"]
    assert dev.end_time - dev.start_time == 10 and dev.attributes["vllm_anatomy.lane"] == "device"
    assert req.kind.name == "SERVER" and [e.name for e in req.events] == ["QUEUED", "FINISHED"]
    assert req.resource.attributes["service.name"] == "svc"
    assert req.resource.attributes["vllm_anatomy.process.kind"] == "engine_core"


def test_trace_context_round_trip():
    exporter = InMemorySpanExporter()
    rec = OTelRecorder("spans", exporters=[exporter])
    with rec.span("outer") as outer:
        headers = rec.inject_trace_headers()
    assert headers == outer.trace_headers() and "traceparent" in headers
    assert inject_trace_headers() == {}               # nothing current after the span
    child = rec.start_span("remote_child", trace_headers={"TraceParent": headers["traceparent"]})
    child.end()
    rec.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["remote_child"].parent.span_id == spans["outer"].context.span_id
    flags = spans["outer"].context.trace_flags       # SDK 1.45 writes 03, not 01
    assert headers["traceparent"].endswith(f"-{flags:02x}")
    assert extract_trace_context(None) is None and extract_trace_context({"traceparent": "junk"}) is None


def test_bad_level():
    with pytest.raises(ValueError):
        OTelRecorder("off")
    with pytest.raises(ValueError):
        InMemoryRecorder("verbose")


def test_otel_step_keeps_a_link_per_request_beyond_the_sdk_default():
    """OpenTelemetry's default keeps 128 links per span; a batch of 300 needs 300."""
    exporter = InMemorySpanExporter()
    rec = OTelRecorder("spans", exporters=[exporter])
    requests = []
    for i in range(300):
        handle = rec.start_span("llm_request", **{"gen_ai.request.id": str(i)})
        requests.append((handle, handle.trace_headers()))
        handle.end()
    for _ in range(2):                   # the second step reuses the parsed contexts
        with rec.span("EngineCore.step") as step:
            for _, headers in requests:
                step.add_link(headers)
    rec.shutdown()
    steps = [s for s in exporter.get_finished_spans() if s.name == "EngineCore.step"]
    expected = {h.span.get_span_context().span_id for h, _ in requests}
    assert len(steps) == 2
    for s in steps:
        assert len(s.links) == 300 and {link.context.span_id for link in s.links} == expected
