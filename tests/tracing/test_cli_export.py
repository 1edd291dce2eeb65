"""`vllm-anatomy export` over a small hand-made run store (no model)."""
import json

import pytest

from vllm_anatomy.entrypoints.cli.main import main
from vllm_anatomy.tracing.otel import OTelRecorder
from vllm_anatomy.tracing.store import RunStore


@pytest.fixture
def run_path(tmp_path):
    store = RunStore.create(str(tmp_path), {"model": "m", "device": "cpu"})
    rec = OTelRecorder("spans", process_kind="frontend", store=store)
    req = rec.start_span("llm_request", kind="server", **{"vllm_anatomy.span_type": "request",
                                                          "vllm_anatomy.request_id": "0"})
    with rec.span("EngineCore.step", links=[req.trace_headers()], **{"vllm_anatomy.step_id": 1}):
        with rec.span("GPUModelRunner._model_forward"):
            pass
    req.add_event("FINISHED")
    req.end()
    rec.shutdown()
    return store.path


@pytest.mark.parametrize("fmt,top", [("jaeger", "data"), ("otlp-json", "resourceSpans"),
                                     ("perfetto", "traceEvents")])
def test_export_formats(run_path, tmp_path, fmt, top, capsys):
    out = tmp_path / f"out.{fmt}.json"
    assert main(["export", run_path, "--format", fmt, "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert top in doc
    if fmt == "jaeger":
        spans = [s for t in doc["data"] for s in t["spans"]]
        step = next(s for s in spans if s["operationName"] == "EngineCore.step")
        req = next(s for s in spans if s["operationName"] == "llm_request")
        assert {"refType": "FOLLOWS_FROM", "traceID": req["traceID"], "spanID": req["spanID"]} in step["references"]
        assert len(spans) == 3
    if fmt == "perfetto":       # the flow comes from the step's link
        assert [e["ph"] for e in doc["traceEvents"] if e.get("cat") == "flow"] == ["s", "f"]


def test_export_bad_file(tmp_path, capsys):
    bad = tmp_path / "x.sqlite"
    bad.write_text("{}")
    assert main(["export", str(bad), "--format", "jaeger"]) == 2
    assert "not a vllm_anatomy run store" in capsys.readouterr().err
