"""RequestTracer: a request's span from add to finish, fed step by step by the
OutputProcessor with what changed (engine events, first token, finish, abort)."""
import time

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vllm_anatomy.engine.output_processor import OutputProcessor
from vllm_anatomy.engine.protocol import (EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreRequest,
                                          FinishReason)
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.tracing.recorder import InMemoryRecorder, parse_traceparent
from vllm_anatomy.tracing.request_tracer import RequestTracer


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", unk_token="t0")


def _request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.5, seed=7), time.time())


def _traced(rec: InMemoryRecorder, *rids: str) -> tuple[RequestTracer, OutputProcessor]:
    tracer = RequestTracer(rec, "m")
    op = OutputProcessor(_tokenizer(), tracer)
    for rid in rids:
        request = _request(rid)
        op.add_request(request, None)
        tracer.on_add(request)
        assert parse_traceparent(request.trace_headers) is not None   # the engine side parents on the span
    return tracer, op


def test_request_span_events_and_usage():
    rec = InMemoryRecorder("spans")
    tracer, op = _traced(rec, "a", "b")
    scheduled = EngineCoreEvent(EngineCoreEventType.SCHEDULED, time.monotonic())
    steps = [
        [EngineCoreOutput("a", [], events=[scheduled]), EngineCoreOutput("b", [5], events=[scheduled])],
        [EngineCoreOutput("a", [6, 7]), EngineCoreOutput("b", [8]), EngineCoreOutput("gone", [1])],
        [EngineCoreOutput("a", [9], finish_reason=FinishReason.LENGTH), EngineCoreOutput("b", [])],
        [EngineCoreOutput("b", [10], finish_reason=FinishReason.STOP)],
    ]
    for outputs in steps:
        op.process_outputs(outputs)
    assert tracer.requests == {}
    spans = {s.attrs["vllm_anatomy.request_id"]: s for s in rec.find("llm_request")}
    assert [e.name for e in spans["a"].events] == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"]
    assert [e.name for e in spans["b"].events] == ["QUEUED", "SCHEDULED", "FIRST_TOKEN", "FINISHED"]
    assert spans["a"].attrs["gen_ai.usage.output_tokens"] == 3 and spans["b"].attrs["gen_ai.usage.output_tokens"] == 3
    assert spans["a"].attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert spans["b"].events[-1].attrs == {"vllm_anatomy.finish_reason": "stop"}
    assert spans["a"].attrs["gen_ai.request.seed"] == 7 and spans["a"].attrs["gen_ai.usage.input_tokens"] == 3
    assert all(s.end_ns is not None and s.kind == "server" for s in spans.values())


def test_aborted_and_refused_requests_end_their_spans():
    rec = InMemoryRecorder("spans")
    tracer, op = _traced(rec, "a", "b", "c")
    op.process_outputs([EngineCoreOutput("a", [5]), EngineCoreOutput("b", [6])])
    assert op.abort_requests(["a"]) == ["a"]
    assert op.abort_requests(["b"], trace_reason="error") == ["b"]
    assert tracer.requests.keys() == {"c"}
    spans = {s.attrs["vllm_anatomy.request_id"]: s for s in rec.find("llm_request")}
    assert spans["a"].attrs["gen_ai.response.finish_reasons"] == ["abort"]
    assert spans["b"].attrs["gen_ai.response.finish_reasons"] == ["error"]
    assert spans["a"].attrs["gen_ai.usage.output_tokens"] == 1
    assert [e.name for e in spans["a"].events] == ["QUEUED", "FIRST_TOKEN", "FINISHED"]
