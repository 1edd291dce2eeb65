"""One request through three processes — API server (+AsyncLLM), EngineCoreProc,
a worker process behind the shared-memory ring buffer — and its spans form the
DESIGN's two trees: the request's trace (HTTP span -> llm_request ->
EngineCore.add_request, continuing the client's traceparent) and the steps'
traces (EngineCore.step -> Executor.* -> Worker.* -> GPUModelRunner.*), joined
by links. Checked twice: live over OTLP, and in the run store all three
processes write."""
import glob
import os

import httpx
import pytest

from server_utils import RemoteOpenAIServer
from tests.tracing.otlp_receiver import HttpReceiver
from vllm_anatomy.tracing.reader import open_run

pytestmark = pytest.mark.model

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    trace_dir = str(tmp_path_factory.mktemp("runs"))
    with pytest.MonkeyPatch.context() as mp, HttpReceiver() as rx:
        mp.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")   # the server inherits it
        with RemoteOpenAIServer("--trace-level", "spans", "--trace-dir", trace_dir,
                                "--otlp-traces-endpoint", rx.endpoint,
                                "--distributed-executor-backend", "mp") as server:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120, headers={"traceparent": TRACEPARENT},
                           json={"model": "SmolLM2-135M-Instruct", "prompt": "The sky is", "max_tokens": 3,
                                 "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        # server.stop() waits for every process to exit: each flushed its spans.
    (path,) = glob.glob(os.path.join(trace_dir, "*.sqlite"))
    return rx.spans, path


def _check_trees(spans, kind_of):
    by_id = {s["span_id"]: s for s in spans}
    (request,) = [s for s in spans if s["name"] == "llm_request"]
    # The request trace continues the client's trace id, through the HTTP span.
    assert request["trace_id"] == CLIENT_TRACE
    http = by_id[request["parent_id"]]
    assert kind_of(http) == "frontend" and "completions" in http["name"]
    # AsyncLLM.add_request (with InputProcessor.process_inputs inside) runs under the request's span.
    (front_add,) = [s for s in spans if s["name"] == "AsyncLLM.add_request"]
    assert front_add["parent_id"] == request["span_id"] and kind_of(front_add) == "frontend"
    (tokenize,) = [s for s in spans if s["name"] == "InputProcessor.process_inputs"]
    assert tokenize["parent_id"] == front_add["span_id"]
    # The engine's side is in the request's trace too, following from its span (nothing in
    # the frontend waits for it): no parent, its first link the request's span.
    (add,) = [s for s in spans if s["name"] == "EngineCore.add_request"]
    assert add["parent_id"] is None and add["trace_id"] == CLIENT_TRACE
    assert add["links"][0]["span_id"] == request["span_id"]
    assert kind_of(add) == "engine_core"
    # Steps: their own traces, in the engine process, linked to the request;
    # the worker process' spans are children of the executor's spans.
    # (A last step with nothing scheduled only tells the worker the request finished.)
    steps = [s for s in spans if s["name"] == "EngineCore.step" and s["links"]]
    assert len(steps) == 3 and all(kind_of(s) == "engine_core" for s in steps)
    for step in steps:
        assert step["trace_id"] != CLIENT_TRACE
        assert [(lk["trace_id"], lk["span_id"]) for lk in step["links"]] == [(CLIENT_TRACE, request["span_id"])]
        workers = [s for s in spans if s["trace_id"] == step["trace_id"] and s["name"].startswith("Worker.")]
        assert {w["name"] for w in workers} == {"Worker.execute_model", "Worker.sample_tokens"}
        for w in workers:
            assert kind_of(w) == "worker"
            assert by_id[w["parent_id"]]["name"] == w["name"].replace("Worker.", "Executor.")
            assert kind_of(by_id[w["parent_id"]]) == "engine_core"


def test_live_otlp_joins_three_processes(traced):
    spans, _ = traced
    _check_trees(spans, lambda s: s["resource"]["vllm_anatomy.process.kind"])


def test_run_store_holds_all_three_processes(traced):
    _, path = traced
    with open_run(path) as run:
        rows = run.spans()
    spans = [{"name": r.name, "trace_id": r.trace_id, "span_id": r.span_id, "parent_id": r.parent_id,
              "links": [{"trace_id": lk["trace_id"], "span_id": lk["span_id"]} for lk in r.links],
              "kind_": r.process_kind} for r in rows]
    assert {s["kind_"] for s in spans} == {"frontend", "engine_core", "worker"}
    _check_trees(spans, lambda s: s["kind_"])
