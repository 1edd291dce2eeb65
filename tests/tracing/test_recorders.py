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


def _drive_followers(rec):
    """Followers, explicit parents, a remote caller that waits and one that does not, the step scope."""
    cause = rec.start_span("EngineCore.step", root=True)
    step_headers = cause.trace_headers()
    with rec.step_scope(cause):
        assert rec.current_step() == (step_headers, False)
        assert rec.rpc_trace_headers() == (rec.inject_trace_headers() or None, step_headers)
    assert rec.current_step() is None
    cause.end()
    t0 = rec.now_ns()
    out = rec.record_span("EngineCoreProc.process_output_sockets", t0, t0 + 5, follows_from=step_headers)
    rec.record_span("MPClient._decode_output", t0 + 6, t0 + 8, follows_from=out)
    gpu = rec.start_span("GPU.step", start_ns=t0, trace_headers=step_headers)
    rec.record_span("GPU.model_forward", t0 + 1, t0 + 2, parent=gpu)
    gpu.end(t0 + 3)
    with rec.remote_parent(step_headers, follows=True, step_headers=step_headers):
        assert rec.current_step() == (step_headers, True)
        with rec.span("Worker.execute_model"):
            with rec.span("GPUModelRunner.execute_model"):
                pass
    with rec.remote_parent(step_headers):
        with rec.span("Worker.sample_tokens"):
            pass
    with rec.span("llm_request") as req:
        assert rec.is_current(req.trace_headers()) and not rec.is_current(step_headers)
        rec.start_span("root", root=True).end()
    return step_headers


def test_followers_in_memory():
    rec = InMemoryRecorder("spans")
    headers = _drive_followers(rec)
    by = {s.name: s for s in rec.spans}
    step = by["EngineCore.step"]
    assert parse_traceparent(headers) == (step.trace_id, step.span_id)
    out, dec = by["EngineCoreProc.process_output_sockets"], by["MPClient._decode_output"]
    assert out.parent_id is None and out.trace_id == step.trace_id and out.links == [(step.trace_id, step.span_id)]
    assert dec.parent_id is None and dec.trace_id == step.trace_id and dec.links == [(out.trace_id, out.span_id)]
    assert by["GPU.step"].parent_id == step.span_id and by["GPU.model_forward"].parent_id == by["GPU.step"].span_id
    worker = by["Worker.execute_model"]
    assert worker.parent_id is None and worker.links == [(step.trace_id, step.span_id)]
    assert by["GPUModelRunner.execute_model"].parent_id == worker.span_id
    assert by["Worker.sample_tokens"].parent_id == step.span_id
    assert by["root"].parent_id is None and by["root"].trace_id != by["llm_request"].trace_id


def test_followers_otel():
    exporter = InMemorySpanExporter()
    rec = OTelRecorder("spans", process_kind="worker", exporters=[exporter])
    _drive_followers(rec)
    rec.shutdown()
    by = {s.name: s for s in exporter.get_finished_spans()}
    step = by["EngineCore.step"]
    for name, cause in (("EngineCoreProc.process_output_sockets", step), ("MPClient._decode_output",
                                                                        by["EngineCoreProc.process_output_sockets"]),
                        ("Worker.execute_model", step)):
        s = by[name]
        assert s.parent is None and s.context.trace_id == step.context.trace_id, name
        (link,) = s.links
        assert link.context.span_id == cause.context.span_id
        assert dict(link.attributes) == {"opentracing.ref_type": "follows_from"}
    assert by["GPUModelRunner.execute_model"].parent.span_id == by["Worker.execute_model"].context.span_id
    assert by["Worker.sample_tokens"].parent.span_id == step.context.span_id
    assert by["GPU.model_forward"].parent.span_id == by["GPU.step"].context.span_id
    assert by["GPU.step"].parent.span_id == step.context.span_id
    assert by["root"].parent is None and by["root"].context.trace_id != by["llm_request"].context.trace_id
    assert by["EngineCore.step"].resource.attributes["service.name"] == "vllm_anatomy.worker"
