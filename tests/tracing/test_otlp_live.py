"""A real LLM run exports live over OTLP (HTTP/protobuf and gRPC) to a local
receiver that decodes ExportTraceServiceRequest: the layers' span names, the
parent/child structure, the GenAI request attributes and journey events."""
import pytest

from tests.tracing.otlp_receiver import GrpcReceiver, HttpReceiver
from vllm_anatomy import LLM, SamplingParams

pytestmark = pytest.mark.model

LAYER_SPANS = {"llm_request", "InputProcessor.process_inputs", "OutputProcessor.process_outputs",
               "EngineCore.add_request", "EngineCore.step", "Scheduler.schedule",
               "Executor.execute_model", "Worker.execute_model", "GPUModelRunner.execute_model",
               "Worker.sample_tokens", "GPUModelRunner._prepare_inputs",
               "GPUModelRunner._model_forward", "Executor.sample_tokens", "GPUModelRunner.sample_tokens",
               "GPUModelRunner._bookkeeping_sync", "Scheduler.update_from_output"}


def _run(model_dir, endpoint, monkeypatch, protocol):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    llm = LLM(model_dir, trace_level="spans", otlp_traces_endpoint=endpoint)
    prompts = [{"prompt_token_ids": [1, 504, 3458, 2]}, {"prompt_token_ids": [1, 2, 3, 4, 5, 6]}]
    llm.generate(prompts, SamplingParams(temperature=0.5, top_p=0.9, max_tokens=3, ignore_eos=True, seed=1),
                 use_tqdm=False)
    llm.llm_engine.shutdown()          # flushes the batch processor


def _check(spans):
    names = {s["name"] for s in spans}
    assert LAYER_SPANS <= names, LAYER_SPANS - names
    by_id = {s["span_id"]: s for s in spans}
    parent = lambda s: by_id[s["parent_id"]]["name"] if s["parent_id"] else None  # noqa: E731
    for s in spans:
        assert s["parent_id"] is None or s["parent_id"] in by_id, f"{s['name']}: dangling parent"
        if s["name"] == "Scheduler.schedule":
            assert parent(s) == "EngineCore.step"
        if s["name"] == "GPUModelRunner._model_forward":
            assert parent(s) == "GPUModelRunner.execute_model"
            assert parent(by_id[s["parent_id"]]) == "Worker.execute_model"
        if s["name"] == "Worker.execute_model":
            assert parent(s) == "Executor.execute_model"
        if s["name"] == "GPUModelRunner.sample_tokens":
            assert parent(s) == "Worker.sample_tokens" and parent(by_id[s["parent_id"]]) == "Executor.sample_tokens"
        if s["name"] == "EngineCore.add_request":
            assert parent(s) == "llm_request"
            assert by_id[s["parent_id"]]["trace_id"] == s["trace_id"]
    requests = [s for s in spans if s["name"] == "llm_request"]
    assert len(requests) == 2 and {r["trace_id"] for r in requests}.__len__() == 2
    for r in requests:
        a = r["attributes"]
        assert r["kind"] == 2                                  # SPAN_KIND_SERVER
        assert a["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
        assert a["gen_ai.request.max_tokens"] == 3 and a["gen_ai.usage.output_tokens"] == 3
        assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
        assert a["gen_ai.usage.input_tokens"] in (4, 6)
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        events = [e["name"] for e in r["events"]]
        assert events[0] == "QUEUED" and events[-1] == "FINISHED" and "FIRST_TOKEN" in events
        assert r["events"][-1]["attributes"]["vllm_anatomy.finish_reason"] == "length"
        assert r["resource"]["service.name"] == "vllm_anatomy.frontend"
        assert r["resource"]["vllm_anatomy.process.kind"] == "frontend" and r["resource"]["service.instance.id"]
    steps = [s for s in spans if s["name"] == "EngineCore.step"]
    assert [s["attributes"]["vllm_anatomy.step_id"] for s in steps] == list(range(1, len(steps) + 1))
    assert all(not any(k.startswith("gen_ai.") for k in s["attributes"]) for s in steps)
    # Requests and steps are separate trees joined by links: every step links
    # to each request it served, and each request is linked from every step it
    # needed (1 prefill + 2 more decodes for 3 tokens).
    request_ids = {(r["trace_id"], r["span_id"]) for r in requests}
    for s in steps:
        linked = {(lk["trace_id"], lk["span_id"]) for lk in s["links"]}
        assert linked and linked <= request_ids and s["trace_id"] not in {t for t, _ in request_ids}
    for key in request_ids:
        assert sum(key in {(lk["trace_id"], lk["span_id"]) for lk in s["links"]} for s in steps) == 3


def test_otlp_http(default_model_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with HttpReceiver() as rx:
        _run(default_model_dir, rx.endpoint, monkeypatch, "http/protobuf")
    _check(rx.spans)


def test_otlp_http_endpoint_alone(default_model_dir, monkeypatch, tmp_path):
    """Jaeger's documented HTTP form, with no protocol set: spoken to over HTTP, nothing lost."""
    monkeypatch.chdir(tmp_path)
    for key in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(key, raising=False)
    with HttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint + "/v1/traces")
        llm = LLM(default_model_dir, trace_level="spans")
        llm.generate([{"prompt_token_ids": [1, 504, 3458, 2]}, {"prompt_token_ids": [1, 2, 3, 4, 5, 6]}],
                     SamplingParams(temperature=0.5, top_p=0.9, max_tokens=3, ignore_eos=True, seed=1),
                     use_tqdm=False)
        llm.llm_engine.shutdown()
    _check(rx.spans)
    assert not list(tmp_path.iterdir()), "an OTLP endpoint from the environment: no run store written"


def test_otlp_grpc(default_model_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with GrpcReceiver() as rx:
        _run(default_model_dir, rx.endpoint, monkeypatch, "grpc")
    _check(rx.spans)
    assert not list(tmp_path.iterdir()), "no trace_dir given: nothing written besides OTLP"
