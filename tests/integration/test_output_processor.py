"""Incremental detokenization and stop strings, with the real tokenizer and
fabricated EngineCoreOutputs (no model): the frontend half of the engine."""
import pytest

from vllm_anatomy.engine.detokenizer import IncrementalDetokenizer
from vllm_anatomy.engine.output_processor import OutputProcessor
from vllm_anatomy.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_anatomy.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tok():
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
    return get_tokenizer(ensure_default_model())


TEXT = "Héllo wörld — 東京 🙂 is 12345 and done."


def test_streaming_equals_full_decode(tok):
    ids = tok.encode(TEXT)
    det = IncrementalDetokenizer(tok, tok.encode("Say:"), SamplingParams())
    for t in ids:   # one token at a time, as the engine produces them
        det.update([t], stop_terminated=False)
    assert det.output_text == tok.decode(ids)


def test_stop_string_found_across_token_boundaries(tok):
    ids = tok.encode("The answer is 42. ### Next question")
    det = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["###"]))
    matched = None
    for t in ids:
        matched = det.update([t], stop_terminated=False)
        if matched:
            break
    assert matched == "###"
    assert det.output_text == "The answer is 42. "


def test_stop_string_included_when_asked(tok):
    det = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["42"], include_stop_str_in_output=True))
    assert det.update(tok.encode("The answer is 42 and more"), False) == "42"
    assert det.output_text == "The answer is 42"


def test_eos_token_is_not_detokenized(tok):
    det = IncrementalDetokenizer(tok, [1], SamplingParams(skip_special_tokens=False))
    det.update(tok.encode("Paris.") + [tok.eos_token_id], stop_terminated=True)
    assert det.output_text == "Paris."


def _req(tok, rid, params):
    return EngineCoreRequest(rid, tok.encode("Hi"), params, 0.0, external_req_id=rid)


def test_stop_string_finishes_and_asks_engine_to_abort(tok):
    op = OutputProcessor(tok)
    op.add_request(_req(tok, "a", SamplingParams(stop=["\n\n"])), "Hi")
    ids = tok.encode("First line.\n\nSecond line.")
    res = op.process_outputs([EngineCoreOutput("a", ids)])
    out = res.request_outputs[0]
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "\n\n"
    assert out.outputs[0].text == "First line."
    assert res.reqs_to_abort == ["a"]
    assert not op.has_unfinished_requests()
    # Tokens after the stop string are trimmed so tokens and text agree.
    assert tok.decode(out.outputs[0].token_ids).startswith("First line.")
    assert "Second" not in tok.decode(out.outputs[0].token_ids)


def test_engine_finish_is_not_aborted_again(tok):
    op = OutputProcessor(tok)
    op.add_request(_req(tok, "a", SamplingParams(max_tokens=3)), "Hi")
    res = op.process_outputs([EngineCoreOutput("a", tok.encode(" one two three"),
                                               finish_reason=FinishReason.LENGTH)])
    assert res.request_outputs[0].outputs[0].finish_reason == "length"
    assert res.reqs_to_abort == []


def test_delta_outputs_concatenate_to_the_whole(tok):
    op = OutputProcessor(tok)
    op.add_request(_req(tok, "d", SamplingParams(output_kind=RequestOutputKind.DELTA)), "Hi")
    ids = tok.encode(TEXT)
    pieces = []
    for i, t in enumerate(ids):
        fin = FinishReason.LENGTH if i == len(ids) - 1 else None
        for o in op.process_outputs([EngineCoreOutput("d", [t], finish_reason=fin)]).request_outputs:
            pieces.append(o.outputs[0].text)
    assert "".join(pieces) == tok.decode(ids) == TEXT


def test_final_only_emits_once(tok):
    op = OutputProcessor(tok)
    op.add_request(_req(tok, "f", SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)), "Hi")
    ids = tok.encode(" a b c")
    outs = []
    for i, t in enumerate(ids):
        fin = FinishReason.LENGTH if i == len(ids) - 1 else None
        outs += op.process_outputs([EngineCoreOutput("f", [t], finish_reason=fin)]).request_outputs
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].token_ids == ids


def test_unknown_ids_are_ignored(tok):
    op = OutputProcessor(tok)
    assert op.process_outputs([EngineCoreOutput("ghost", [5])]).request_outputs == []
    assert op.abort_requests(["ghost"]) == []
