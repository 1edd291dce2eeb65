"""The file exports' shapes, on a small hand-made run store (no model):
- `--format jaeger` is what Jaeger v1.75.0's /api/traces returns for the same spans (its UI
  model after OpenTelemetry's OTLP-to-Jaeger mapping): scope, kind and status as tags, list
  attributes as compact JSON, events as logs sorted by name, one process per resource with
  every resource attribute as a tag, followers as FOLLOWS_FROM references;
- `--format otlp-json` keeps each process' resource and each span's scope and status message;
- `vllm-anatomy export` without -o writes to the current directory, not next to the run.
"""
import json
import os

import pytest

from vllm_anatomy.entrypoints.cli.main import main
from vllm_anatomy.tracing.exporters import jaeger_json, otlp_json
from vllm_anatomy.tracing.otel import OTelRecorder
from vllm_anatomy.tracing.reader import open_run
from vllm_anatomy.tracing.store import RunStore

SPAN_KEYS = ["traceID", "spanID", "operationName", "references", "startTime", "duration", "tags", "logs",
             "processID", "warnings"]


@pytest.fixture
def run_path(tmp_path):
    store = RunStore.create(str(tmp_path), {"model": "m", "device": "cpu"})
    rec = OTelRecorder("spans", process_kind="frontend", store=store)
    req = rec.start_span("llm_request", kind="server", root=True, **{"vllm_anatomy.span_type": "request",
                                                                    "vllm_anatomy.request_id": "0"})
    req.add_event("QUEUED")
    with rec.use_span(req):
        with rec.span("InputProcessor.process_inputs", **{"zeta": 1, "alpha": [1, 2, 3], "mid": 0.5, "flag": True}):
            pass
    step = rec.start_span("EngineCore.step", root=True, **{"vllm_anatomy.step_id": 1})
    step.add_link(req.trace_headers())
    with rec.use_span(step):
        with pytest.raises(ValueError), rec.span("GPUModelRunner._model_forward"):
            raise ValueError("boom")
    step.end()
    rec.record_span("OutputProcessor.process_outputs", step.span.end_time + 10, step.span.end_time + 20,
                    follows_from=step)
    req.set_attribute("gen_ai.response.finish_reasons", ["stop"])
    req.add_event("FINISHED", **{"vllm_anatomy.finish_reason": "stop"})
    req.end()
    rec.shutdown()
    return store.path


def test_jaeger_json_is_the_api_traces_shape(run_path):
    with open_run(run_path) as run:
        doc = json.loads(json.dumps(jaeger_json.export(run)))
    assert list(doc) == ["data", "total", "limit", "offset", "errors"] and doc["errors"] is None
    assert len(doc["data"]) == 2                                    # the request's trace, the step's
    spans = {s["operationName"]: s for t in doc["data"] for s in t["spans"]}
    for t in doc["data"]:
        assert list(t) == ["traceID", "spans", "processes", "warnings"] and t["warnings"] is None
        assert list(t["processes"]) == ["p1"]
        for s in t["spans"]:
            assert list(s) == SPAN_KEYS and s["warnings"] is None and s["processID"] == "p1"
    tok = spans["InputProcessor.process_inputs"]
    keys = [t["key"] for t in tok["tags"]]
    assert keys == ["otel.scope.name", "alpha", "flag", "mid", "zeta", "span.kind"]
    tags = {t["key"]: t for t in tok["tags"]}
    assert tags["alpha"] == {"key": "alpha", "type": "string", "value": "[1,2,3]"}
    assert tags["flag"]["type"] == "bool" and tags["mid"]["type"] == "float64" and tags["zeta"]["type"] == "int64"
    assert tags["span.kind"]["value"] == "internal" and tags["otel.scope.name"]["value"] == "vllm_anatomy"
    assert tok["references"] == [{"refType": "CHILD_OF", "traceID": tok["traceID"],
                                  "spanID": spans["llm_request"]["spanID"]}]
    req = spans["llm_request"]
    assert {t["key"]: t["value"] for t in req["tags"]}["gen_ai.response.finish_reasons"] == '["stop"]'
    assert {t["key"]: t["value"] for t in req["tags"]}["span.kind"] == "server"
    assert [lg["fields"][0] for lg in req["logs"]] == [{"key": "event", "type": "string", "value": "FINISHED"},
                                                      {"key": "event", "type": "string", "value": "QUEUED"}]
    err = {t["key"]: t["value"] for t in spans["GPUModelRunner._model_forward"]["tags"]}
    assert err["otel.status_code"] == "ERROR" and err["error"] is True
    assert err["otel.status_description"] == "ValueError: boom"
    # A follower: in the step's trace, no parent, a FOLLOWS_FROM reference to the step first.
    out, step = spans["OutputProcessor.process_outputs"], spans["EngineCore.step"]
    assert out["traceID"] == step["traceID"]
    assert out["references"] == [{"refType": "FOLLOWS_FROM", "traceID": step["traceID"], "spanID": step["spanID"]}]
    assert step["references"] == [{"refType": "FOLLOWS_FROM", "traceID": req["traceID"], "spanID": req["spanID"]}]
    # The process: its service and every resource attribute (sorted), per the semantic conventions.
    process = doc["data"][0]["processes"]["p1"]
    assert process["serviceName"] == "vllm_anatomy.frontend"
    pkeys = [t["key"] for t in process["tags"]]
    assert pkeys == sorted(pkeys) and "service.name" not in pkeys
    assert {"service.instance.id", "service.namespace", "process.pid", "host.name", "telemetry.sdk.name",
            "vllm_anatomy.process.kind"} <= set(pkeys)


def test_jaeger_json_warns_as_jaeger_would(run_path, tmp_path):
    """An old run (no resources kept) whose child sticks out of its parent: the upload carries
    the warning Jaeger's query service would attach."""
    import sqlite3
    copy = tmp_path / "old.sqlite"
    with sqlite3.connect(run_path) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)
        dst.execute("DELETE FROM meta WHERE key LIKE 'resource.%'")
        dst.execute("UPDATE spans SET start_ns = (SELECT start_ns FROM spans WHERE name = 'llm_request') - 1000 "
                    "WHERE name = 'InputProcessor.process_inputs'")
    with open_run(str(copy)) as run:
        doc = jaeger_json.export(run)
    spans = {s["operationName"]: s for t in doc["data"] for s in t["spans"]}
    (warning,) = spans["InputProcessor.process_inputs"]["warnings"]
    assert warning.startswith("clock skew adjustment disabled; not applying calculated delta of")
    assert doc["data"][0]["processes"]["p1"]["serviceName"] == "vllm_anatomy.frontend"


def test_otlp_json_keeps_resource_scope_and_status(run_path):
    with open_run(run_path) as run:
        doc = otlp_json.export(run)
    (rs,) = doc["resourceSpans"]
    attrs = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
    assert attrs["service.name"] == {"stringValue": "vllm_anatomy.frontend"}
    assert "service.instance.id" in attrs and "host.name" in attrs and "process.pid" in attrs
    (scope,) = rs["scopeSpans"]
    assert scope["scope"] == {"name": "vllm_anatomy"}
    err = next(s for s in scope["spans"] if s["name"] == "GPUModelRunner._model_forward")
    assert err["status"] == {"code": 2, "message": "ValueError: boom"}
    out = next(s for s in scope["spans"] if s["name"] == "OutputProcessor.process_outputs")
    assert "parentSpanId" not in out and out["links"][0]["attributes"] == [
        {"key": "opentracing.ref_type", "value": {"stringValue": "follows_from"}}]


def test_export_writes_to_the_current_directory(run_path, tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    before = set(os.listdir(os.path.dirname(run_path)))
    assert main(["export", run_path, "--format", "perfetto"]) == 0
    name = os.path.splitext(os.path.basename(run_path))[0] + ".perfetto.json"
    assert os.listdir(here) == [name]
    assert set(os.listdir(os.path.dirname(run_path))) == before
