"""A real Jaeger (v1.75.0's all-in-one, in-memory storage, on loopback) receives a live
three-process run over OTLP/HTTP and says, through its own HTTP API, what a user sees:
the three services, one trace per request (with its engine side), no warning on any span,
our `--format jaeger` upload the shape of its /api/traces, and its /api/transform
accepting our `--format otlp-json` (the route its UI takes for an OTLP file).

Skipped unless a `jaeger` binary is on PATH (`make jaeger-test`); build one with Go:
    go install github.com/jaegertracing/jaeger/cmd/jaeger@v1.75.0      # puts jaeger in $(go env GOPATH)/bin
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("jaeger") is None, reason="no jaeger binary on PATH")]

SERVICES = {"vllm_anatomy.frontend", "vllm_anatomy.engine_core", "vllm_anatomy.worker"}
CONFIG = """
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
extensions:
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:{health}
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{grpc}
      http:
        endpoint: 127.0.0.1:{http}
processors:
  batch:
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory):
    ports = {k: _free_port() for k in ("query", "query_grpc", "health", "grpc", "http")}
    config = tmp_path_factory.mktemp("jaeger") / "config.yaml"
    config.write_text(CONFIG.format(**ports))
    proc = subprocess.Popen(["jaeger", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{ports['query']}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(f"{api}/api/services")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("jaeger did not start") from None
                time.sleep(0.5)
        yield api, f"http://127.0.0.1:{ports['http']}/v1/traces"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def exported(jaeger, tmp_path_factory):
    """A three-process run exported live to Jaeger (the endpoint alone: OTLP/HTTP inferred)."""
    from tests.tracing.live_runs import three_process_run
    api, endpoint = jaeger
    path = three_process_run(str(tmp_path_factory.mktemp("runs")), otlp_endpoint=endpoint)
    deadline = time.monotonic() + 60
    while not SERVICES <= set(_get(f"{api}/api/services")["data"] or ()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return api, path


def _traces(api: str, service: str) -> list[dict]:
    return _get(f"{api}/api/traces?service={service}&limit=10000&lookback=1h")["data"]


def test_services_and_no_warnings(exported):
    api, _ = exported
    assert SERVICES <= set(_get(f"{api}/api/services")["data"])
    for service in SERVICES:
        for trace in _traces(api, service):
            assert all(not s.get("warnings") for s in trace["spans"]), (service, trace["traceID"])


def test_one_trace_per_request(exported):
    api, path = exported
    from vllm_anatomy.tracing.reader import open_run
    with open_run(path) as run:
        requests = {s.request_id: s.trace_id for s in run.spans("llm_request")}
    found = {}
    for trace in _traces(api, "vllm_anatomy.frontend"):
        for s in trace["spans"]:
            if s["operationName"] == "llm_request":
                rid = next(t["value"] for t in s["tags"] if t["key"] == "vllm_anatomy.request_id")
                found[rid] = trace
    assert set(found) == set(requests)
    for rid, trace in found.items():
        assert trace["traceID"] == requests[rid]
        services = {trace["processes"][s["processID"]]["serviceName"] for s in trace["spans"]}
        assert {"vllm_anatomy.frontend", "vllm_anatomy.engine_core"} <= services
        assert {"EngineCore.add_request", "Request"} <= {s["operationName"] for s in trace["spans"]}


def test_upload_json_is_the_api_traces_shape(exported):
    """Our `--format jaeger` trace for a request equals Jaeger's /api/traces/{id}, process ids
    and span order aside."""
    api, path = exported
    from vllm_anatomy.tracing.exporters import jaeger_json
    from vllm_anatomy.tracing.reader import open_run
    with open_run(path) as run:
        ours = {t["traceID"]: t for t in jaeger_json.export(run)["data"]}
    (request_trace,) = [t for t in ours.values() if any(s["operationName"] == "llm_request" for s in t["spans"])][:1]
    theirs = _get(f"{api}/api/traces/{request_trace['traceID']}")["data"][0]

    def canonical(trace: dict) -> list:
        out = []
        for s in sorted(trace["spans"], key=lambda s: s["spanID"]):
            process = trace["processes"][s["processID"]]
            out.append({**{k: v for k, v in s.items() if k not in ("processID", "flags")}, "process": process})
        return out
    assert canonical(request_trace) == canonical(theirs)


def test_transform_accepts_our_otlp_json(exported):
    api, path = exported
    from vllm_anatomy.tracing.exporters import otlp_json
    from vllm_anatomy.tracing.reader import open_run
    with open_run(path) as run:
        body = json.dumps(otlp_json.export(run)).encode()
    req = urllib.request.Request(f"{api}/api/transform", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        doc = json.loads(r.read())
    spans = [s for t in doc["data"] for s in t["spans"]]
    with open_run(path) as run:
        assert len(spans) == len(run.spans())
    assert os.path.exists(path)
