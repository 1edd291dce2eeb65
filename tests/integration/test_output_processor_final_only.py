"""FINAL_ONLY outputs without stop strings (what LLM.generate asks for): the
detokenizer only collects token ids per step and decodes them when the text is
first read. The text must be exactly what per-step decoding gives, with the
real byte-level tokenizer, for random ids, special tokens, a final EOS and an
output cut in the middle of a multi-byte character."""
import random

import pytest

from vllm_anatomy.engine.detokenizer import IncrementalDetokenizer
from vllm_anatomy.engine.output_processor import OutputProcessor
from vllm_anatomy.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_anatomy.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.model

FINAL, CUMULATIVE = RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE


@pytest.fixture(scope="module")
def tok():
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
    return get_tokenizer(ensure_default_model())


def sequences(tok) -> list[list[int]]:
    rng = random.Random(0)
    cut = tok.encode("東京")[:-1]                       # ends inside a character
    text = tok.encode("Héllo wörld — 東京 🙂 is 12345.")
    out = [text, text + cut, cut, [tok.eos_token_id] + text, text + [tok.eos_token_id] + text]
    out += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 300))] for _ in range(200)]
    return out


def decode_by_steps(tok, prompt, ids, kind, stop_terminated=False, skip_special_tokens=True, chunk=1):
    det = IncrementalDetokenizer(tok, prompt, SamplingParams(output_kind=kind,
                                                             skip_special_tokens=skip_special_tokens))
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        det.update(part, stop_terminated=stop_terminated and start + chunk >= len(ids))
    return det


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decoding_when_read_equals_decoding_every_step(tok, skip_special_tokens):
    prompt = tok.encode("Say something:")
    for i, ids in enumerate(sequences(tok)):
        for stop_terminated in (False, True):
            kw = dict(stop_terminated=stop_terminated, skip_special_tokens=skip_special_tokens)
            every_step = decode_by_steps(tok, prompt, ids, CUMULATIVE, **kw)
            when_read = decode_by_steps(tok, prompt, ids, FINAL, chunk=1 + i % 3, **kw)
            assert when_read.decode_when_read and not every_step.decode_when_read
            assert when_read.output_text == every_step.output_text, (i, stop_terminated)
            assert when_read.token_ids == every_step.token_ids == ids


def test_stop_strings_are_still_checked_every_step(tok):
    det = IncrementalDetokenizer(tok, [1], SamplingParams(output_kind=FINAL, stop=["###"]))
    assert not det.decode_when_read
    matched = None
    for t in tok.encode("The answer is 42. ### Next"):
        if matched := det.update([t], stop_terminated=False):
            break
    assert matched == "###" and det.output_text == "The answer is 42. "


def test_final_only_builds_one_output_equal_to_cumulatives_last(tok):
    rng = random.Random(1)
    ids = {rid: [rng.randrange(10000) for _ in range(n)] for rid, n in (("a", 5), ("b", 40), ("c", 90))}
    results = {}
    for kind in (FINAL, CUMULATIVE):
        op = OutputProcessor(tok)
        for rid in ids:
            op.add_request(EngineCoreRequest(rid, tok.encode("Hi"), SamplingParams(output_kind=kind), 0.0), "Hi")
        last = {}
        for step in range(max(map(len, ids.values()))):
            outs = [EngineCoreOutput(rid, [seq[step]], finish_reason=FinishReason.LENGTH if step == len(seq) - 1
                                     else None)
                    for rid, seq in ids.items() if step < len(seq)]
            produced = op.process_outputs(outs).request_outputs
            if kind == FINAL:
                assert all(o.finished for o in produced)            # nothing before a request finishes
            last.update({o.request_id: o for o in produced})
        assert not op.has_unfinished_requests()
        results[kind] = last
    for rid, seq in ids.items():
        final, cumulative = results[FINAL][rid], results[CUMULATIVE][rid]
        assert final.outputs[0].text == cumulative.outputs[0].text
        assert final.outputs[0].token_ids == cumulative.outputs[0].token_ids == seq
        assert final.outputs[0].finish_reason == "length"
        m = final.metrics
        assert m.num_generation_tokens == len(seq) and m.first_token_time <= m.last_token_time <= m.finished_time
