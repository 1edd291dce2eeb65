"""RequestTracer: a request's span from add to finish, fed with the engine's outputs step by step."""
import time

from vllm_anatomy.engine.protocol import (EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreRequest,
                                          FinishReason)
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.tracing.recorder import InMemoryRecorder, parse_traceparent
from vllm_anatomy.tracing.request_tracer import RequestTracer


def _request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.5, seed=7), time.time())


def test_request_span_events_and_usage():
    rec = InMemoryRecorder("spans")
    tracer = RequestTracer(rec, "m")
    a, b = _request("a"), _request("b")
    tracer.on_add(a)
    tracer.on_add(b)
    assert parse_traceparent(a.trace_headers) is not None       # the engine side parents on the span
    scheduled = EngineCoreEvent(EngineCoreEventType.SCHEDULED, time.monotonic())
    steps = [
        [EngineCoreOutput("a", [], events=[scheduled]), EngineCoreOutput("b", [5], events=[scheduled])],
        [EngineCoreOutput("a", [6, 7]), EngineCoreOutput("b", [8]), EngineCoreOutput("gone", [1])],
        [EngineCoreOutput("a", [9], finish_reason=FinishReason.LENGTH), EngineCoreOutput("b", [])],
        [EngineCoreOutput("b", [10], finish_reason=FinishReason.STOP)],
    ]
    for outputs in steps:
        tracer.on_outputs(outputs)
    assert tracer.requests == {}
    spans = {s.attrs["vllm_anatomy.request_id"]: s for s in rec.find("llm_request")}
    assert [e.name for e in spans["a"].events] == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"]
    assert [e.name for e in spans["b"].events] == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"]
    assert spans["a"].attrs["gen_ai.usage.output_tokens"] == 3 and spans["b"].attrs["gen_ai.usage.output_tokens"] == 3
    assert spans["a"].attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert spans["b"].events[-1].attrs == {"vllm_anatomy.finish_reason": "stop"}
    assert spans["a"].attrs["gen_ai.request.seed"] == 7 and spans["a"].attrs["gen_ai.usage.input_tokens"] == 3
    assert all(s.end_ns is not None and s.kind == "server" for s in spans.values())
