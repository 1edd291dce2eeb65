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


# -- n > 1: a ParentRequest span over its children's llm_request spans --------------------------
class _OpenSpans(InMemoryRecorder):
    """InMemoryRecorder that also remembers every span it started (so none is left open)."""

    def __init__(self) -> None:
        super().__init__("spans")
        self.started: list = []

    def start_span(self, name, trace_headers=None, kind="internal", start_ns=None, **kw):
        span = super().start_span(name, trace_headers, kind, start_ns, **kw)
        self.started.append(span)
        return span


def _admitted(rec: _OpenSpans, rid: str, n: int) -> tuple[RequestTracer, OutputProcessor, list]:
    """As LLMEngine: admitting() while tokenizing, then fan_out; (tracer, processor, children)."""
    from vllm_anatomy.engine.parallel_sampling import fan_out
    tracer = RequestTracer(rec, "m")
    op = OutputProcessor(_tokenizer(), tracer)
    request = EngineCoreRequest(rid, [1, 2, 3], SamplingParams(n=n, max_tokens=4, temperature=0.5, seed=7),
                                time.time())
    with tracer.admitting(rid, None, n):
        pass
    return tracer, op, fan_out(request)


def _add(tracer: RequestTracer, op: OutputProcessor, children) -> None:
    for parent, index, child in children:
        op.add_request(child, None, None, parent, index)
        tracer.on_add(child, parent, index)


def _closed(rec: _OpenSpans, tracer: RequestTracer) -> dict[str, list]:
    """Every span ended, once (one FINISHED event), nothing left in the tracer; spans by name."""
    assert all(s.end_ns is not None for s in rec.started), [s.name for s in rec.started if s.end_ns is None]
    assert all([e.name for e in s.events].count("FINISHED") == 1 for s in rec.started)
    assert (tracer.requests, tracer.parents, tracer.child_parents, tracer.admitted) == ({}, {}, {}, {})
    by_name: dict[str, list] = {}
    for s in rec.spans:
        by_name.setdefault(s.name, []).append(s)
    return by_name


def test_n_children_under_one_parent_span():
    rec = _OpenSpans()
    tracer, op, children = _admitted(rec, "r", 3)
    _add(tracer, op, children)
    op.process_outputs([EngineCoreOutput("0_r", [5]), EngineCoreOutput("1_r", [6], finish_reason=FinishReason.STOP)])
    assert [s.name for s in rec.spans] == ["llm_request"]           # the parent waits for its other children
    op.process_outputs([EngineCoreOutput("0_r", [7, 8], finish_reason=FinishReason.LENGTH),
                        EngineCoreOutput("2_r", [9], finish_reason=FinishReason.STOP)])
    spans = _closed(rec, tracer)
    (parent,) = spans["ParentRequest"]
    kids = sorted(spans["llm_request"], key=lambda s: s.attrs["vllm_anatomy.child_index"])
    assert [k.attrs["vllm_anatomy.request_id"] for k in kids] == ["0_r", "1_r", "2_r"]
    assert all(k.parent_id == parent.span_id and k.trace_id == parent.trace_id for k in kids)
    assert parent.parent_id is None and parent.kind == "server"
    assert parent.attrs["gen_ai.request.choice.count"] == 3 and parent.attrs["vllm_anatomy.request_id"] == "r"
    assert parent.attrs["vllm_anatomy.span_type"] == "parent_request"
    assert parent.attrs["gen_ai.response.finish_reasons"] == ["length", "stop", "stop"]     # by child index
    assert parent.attrs["gen_ai.usage.output_tokens"] == 5
    assert [e.name for e in parent.events] == ["QUEUED", "FIRST_TOKEN", "FINISHED"]
    assert parent.events[1].attrs == {"vllm_anatomy.request_id": "0_r"}
    assert [k.attrs["vllm_anatomy.child_index"] for k in kids] == [0, 1, 2]
    assert [k.attrs["gen_ai.request.seed"] for k in kids] == [7, 8, 9]           # each child's own seed


def test_aborting_the_parent_ends_every_span():
    rec = _OpenSpans()
    tracer, op, children = _admitted(rec, "r", 2)
    _add(tracer, op, children)
    op.process_outputs([EngineCoreOutput("0_r", [5]), EngineCoreOutput("1_r", [6])])
    assert sorted(op.abort_requests(["r"])) == ["0_r", "1_r"]
    spans = _closed(rec, tracer)
    assert spans["ParentRequest"][0].attrs["gen_ai.response.finish_reasons"] == ["abort", "abort"]
    assert len(spans["llm_request"]) == 2


def test_aborting_one_child_leaves_the_parent_open_until_the_last():
    rec = _OpenSpans()
    tracer, op, children = _admitted(rec, "r", 2)
    _add(tracer, op, children)
    op.abort_requests(["0_r"])
    assert tracer.parents.keys() == {"r"}
    op.process_outputs([EngineCoreOutput("1_r", [6], finish_reason=FinishReason.LENGTH)])
    spans = _closed(rec, tracer)
    (parent,) = spans["ParentRequest"]
    assert parent.attrs["gen_ai.response.finish_reasons"] == ["abort", "length"]
    assert parent.events[-1].attrs == {"vllm_anatomy.finish_reason": "length"}


def test_adding_fails_halfway():
    """Child 1 of 3 is refused: the frontend aborts child 0 (and 1) with "error", then says
    no more come; the parent ends then, with the children added."""
    rec = _OpenSpans()
    tracer, op, children = _admitted(rec, "r", 3)
    _add(tracer, op, children[:2])
    op.abort_requests(["0_r", "1_r"], trace_reason="error")
    assert tracer.parents.keys() == {"r"}           # (child 2 might still come)
    tracer.discard_admission("r")
    tracer.discard_admission("r")                   # (twice: nothing more happens)
    spans = _closed(rec, tracer)
    (parent,) = spans["ParentRequest"]
    assert parent.attrs["gen_ai.response.finish_reasons"] == ["error", "error"]
    assert parent.events[-1].attrs == {"vllm_anatomy.finish_reason": "error"}


def test_refused_before_any_child_ends_the_admission_span():
    rec = _OpenSpans()
    tracer, _, _ = _admitted(rec, "r", 2)
    tracer.discard_admission("r")
    spans = _closed(rec, tracer)
    assert list(spans) == ["ParentRequest"] and spans["ParentRequest"][0].events[-1].attrs == \
        {"vllm_anatomy.finish_reason": "error"}
    # Refused while tokenizing (inside admitting): the span ends there.
    rec = _OpenSpans()
    tracer = RequestTracer(rec, "m")
    try:
        with tracer.admitting("bad", None, 2):
            raise ValueError("n too large")
    except ValueError:
        pass
    assert all(s.end_ns is not None for s in rec.started) and tracer.admitted == {}


def test_a_child_finishing_before_its_siblings_are_added():
    """AsyncLLM awaits each child's send: child 0 may finish (even with an error) before child 1
    is added; the parent's span stays open for it, and there is only one."""
    rec = _OpenSpans()
    tracer, op, children = _admitted(rec, "r", 2)
    _add(tracer, op, children[:1])
    op.process_outputs([EngineCoreOutput("0_r", [5], finish_reason=FinishReason.ERROR)])
    assert tracer.parents.keys() == {"r"}
    _add(tracer, op, children[1:])
    tracer.discard_admission("r")                   # (added in full: a no-op)
    op.process_outputs([EngineCoreOutput("1_r", [6], finish_reason=FinishReason.LENGTH)])
    spans = _closed(rec, tracer)
    (parent,) = spans["ParentRequest"]
    assert parent.attrs["gen_ai.response.finish_reasons"] == ["error", "length"]
    assert parent.events[-1].attrs == {"vllm_anatomy.finish_reason": "error"}
    assert {k.parent_id for k in spans["llm_request"]} == {parent.span_id}


def test_n_one_keeps_its_single_span():
    rec = _OpenSpans()
    tracer, op, children = _admitted(rec, "a", 1)
    _add(tracer, op, children)
    op.process_outputs([EngineCoreOutput("a", [5], finish_reason=FinishReason.LENGTH)])
    spans = _closed(rec, tracer)
    assert list(spans) == ["llm_request"] and spans["llm_request"][0].parent_id is None
    assert "vllm_anatomy.child_index" not in spans["llm_request"][0].attrs


def test_refused_inside_admission_ends_after_the_admission_block():
    """AsyncLLM refuses a child inside `admitting` (AsyncLLM.add_request, the span's child, still
    open): the request's span ends when the block does, not before its own child."""
    from vllm_anatomy.engine.parallel_sampling import fan_out
    for n in (1, 2):
        rec = _OpenSpans()
        tracer = RequestTracer(rec, "m")
        op = OutputProcessor(_tokenizer(), tracer)
        request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(n=n, max_tokens=4, temperature=0.5), time.time())
        try:
            with tracer.admitting("r", None, n), rec.span("AsyncLLM.add_request"):
                request.request_id = "r-1234"                   # (assign_request_id)
                children = fan_out(request)
                _add(tracer, op, children[:1])
                op.abort_requests([children[0][2].request_id], trace_reason="error")
                tracer.discard_admission("r-1234")
                raise ValueError("refused")
        except ValueError:
            pass
        spans = _closed(rec, tracer)
        (top,) = spans["ParentRequest" if n > 1 else "llm_request"]
        (inner,) = spans["AsyncLLM.add_request"]
        assert inner.parent_id == top.span_id and inner.end_ns <= top.end_ns, n
