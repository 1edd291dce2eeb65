"""Penalties, allowed_token_ids and bad_words, each against a readable reference.

- apply_all_penalties (model_executor/penalties.py) equals a per-token Python
  loop written from the formulas (OpenAI's presence/frequency, CTRL's
  repetition), and transformers' RepetitionPenaltyLogitsProcessor;
- apply_bad_words equals "forbid the last token when the output ends with the
  rest of the word";
- the InputBatch's bookkeeping (prompt tensor padded with vocab_size, output
  lists shared with the request, rows moved by condense) feeds the Sampler the
  right tokens, and the Sampler applies them before the greedy argmax;
- SamplingParams.update_from_tokenizer tokenizes bad words as vLLM does.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from vllm_anatomy.model_executor.bad_words import apply_bad_words
from vllm_anatomy.model_executor.penalties import apply_all_penalties
from vllm_anatomy.model_executor.sampler import Sampler, fused_sampling_applies
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.worker.gpu_input_batch import CachedRequestState, InputBatch

V = 40


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], presence: float,
                        frequency: float, repetition: float) -> list[float]:
    """One row, token by token, straight from the definitions."""
    out = list(logits)
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        out[t] -= frequency * output.count(t)
        out[t] -= presence * (1.0 if t in output else 0.0)
    return out


def padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


def test_penalties_equal_the_per_token_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    prompts = [[1, 2, 3, 3], [5], [7, 8, 9, 10, 11], [0, 39]]
    outputs = [[3, 3, 4, 20], [], [8, 8, 8], [39, -1]]          # -1: an async placeholder, ignored
    presence = [0.5, 1.0, -0.7, 0.0]
    frequency = [0.3, 0.0, 1.2, -0.4]
    repetition = [1.3, 2.0, 0.8, 1.0]
    got = apply_all_penalties(logits.clone(), padded(prompts, V), torch.tensor(presence),
                              torch.tensor(frequency), torch.tensor(repetition), outputs)
    for i in range(4):
        want = reference_penalties(logits[i].tolist(), prompts[i], [t for t in outputs[i] if t >= 0],
                                   presence[i], frequency[i], repetition[i])
        torch.testing.assert_close(got[i], torch.tensor(want), rtol=1e-6, atol=1e-6)
    # One value by hand: row 2, token 8 (in the prompt, three times in the output).
    x = logits[2, 8].item()
    x = x / 0.8 if x > 0 else x * 0.8
    assert got[2, 8].item() == pytest.approx(x - 1.2 * 3 + 0.7, abs=1e-5)


def test_neutral_penalties_change_nothing():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    got = apply_all_penalties(logits.clone(), padded([[1, 2], [3], [4, 5, 6]], V), torch.zeros(3),
                              torch.zeros(3), torch.ones(3), [[1, 1], [], [7]])
    assert torch.equal(got, logits)


def test_repetition_penalty_equals_transformers():
    """transformers' processor penalizes every id of input_ids (prompt + generated): ours the same set."""
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(1, V, generator=g) * 4
    prompt, output = [3, 4, 5, 4], [9, 3, 17]
    want = transformers.RepetitionPenaltyLogitsProcessor(penalty=1.7)(torch.tensor([prompt + output]),
                                                                      scores.clone())
    got = apply_all_penalties(scores.clone(), torch.tensor([prompt]), torch.zeros(1), torch.zeros(1),
                              torch.tensor([1.7]), [output])
    torch.testing.assert_close(got, want)


def reference_bad_words(logits: list[float], words: list[list[int]], output: list[int]) -> list[float]:
    out = list(logits)
    for word in words:
        *prefix, last = word
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            out[last] = float("-inf")
    return out


@pytest.mark.parametrize("output", [[], [5], [1, 2], [9, 1, 2], [2, 1], [1, 2, 3]])
def test_bad_words_equal_the_reference(output):
    words = [[7], [1, 2, 3], [2, 4], [9, 9, 9, 9]]
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    got = logits.clone()
    apply_bad_words(got, {1: words}, [[], output])
    assert torch.equal(got[0], logits[0])                       # a row without bad words
    assert got[1].tolist() == reference_bad_words(logits[1].tolist(), words, output)


class WordTokenizer:
    """Splits on spaces; a word with a leading space is another token (as BPE tokenizers do)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        pieces = [("Ġ" if i or text.startswith(" ") else "") + w for i, w in enumerate(text.split(" ")) if w]
        return [self.vocab.setdefault(p, len(self.vocab)) for p in pieces]


def test_bad_words_tokenized_plain_and_after_a_space():
    tok = WordTokenizer()
    sp = SamplingParams(bad_words=["bad", "very bad", "  spaced"])
    sp.update_from_tokenizer(tok)
    bad, gbad, gvery = tok.vocab["bad"], tok.vocab["Ġbad"], tok.vocab["Ġvery"]
    assert [bad] in sp.bad_words_token_ids and [gbad] in sp.bad_words_token_ids
    assert [tok.vocab["very"], gbad] in sp.bad_words_token_ids and [gvery, gbad] in sp.bad_words_token_ids
    # Leading spaces are stripped first: "  spaced" is the word "spaced".
    assert [tok.vocab["spaced"]] in sp.bad_words_token_ids
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["   "]).update_from_tokenizer(tok)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words_token_ids=[[V + 5]]).verify(V)


# -- through the InputBatch and the Sampler ------------------------------------------------------
def make_batch() -> InputBatch:
    return InputBatch(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=64, device="cpu",
                      pin_memory=False, vocab_size=V, block_size=4)


def state(req_id: str, prompt: list[int], output: list[int], **sp) -> CachedRequestState:
    return CachedRequestState(req_id, prompt, SamplingParams(temperature=0.0, **sp), None, ([1],),
                              num_computed_tokens=len(prompt) + len(output) - 1, output_token_ids=list(output))


def test_input_batch_penalty_bookkeeping_follows_rows():
    batch = make_batch()
    a = state("a", [1, 2], [3])
    b = state("b", [4, 5, 6, 7], [8, 8], repetition_penalty=1.5, frequency_penalty=0.5)
    c = state("c", [9], [], presence_penalty=1.0)
    for s in (a, b, c):
        batch.add_request(s)
    md = batch.refresh_metadata()
    assert not md.no_penalties
    assert md.prompt_token_ids.tolist() == [[1, 2, V, V], [4, 5, 6, 7], [9, V, V, V]]
    assert md.output_token_ids == [[3], [8, 8], []] and md.output_token_ids[1] is b.output_token_ids
    assert md.repetition_penalties.tolist() == [1.0, 1.5, 1.0]
    assert md.frequency_penalties.tolist() == [0.0, 0.5, 0.0]
    assert md.presence_penalties.tolist() == [0.0, 0.0, 1.0]
    # A sampled token appended to the request's own list is seen without a copy.
    c.output_token_ids.append(11)
    assert md.output_token_ids[2] == [11]
    # Row 0 leaves: condense moves c (row 2) into it, with its penalties and lists.
    batch.remove_request("a")
    batch.condense()
    md = batch.refresh_metadata()
    assert batch.req_ids == ["c", "b"]
    assert md.prompt_token_ids.tolist() == [[9, V, V, V], [4, 5, 6, 7]]
    assert md.output_token_ids == [[11], [8, 8]] and md.presence_penalties.tolist() == [1.0, 0.0]
    assert md.repetition_penalties.tolist() == [1.0, 1.5]
    # No penalties left: nothing is built.
    batch.remove_request("b")
    batch.remove_request("c")
    batch.condense()
    batch.add_request(state("d", [1], []))
    md = batch.refresh_metadata()
    assert md.no_penalties and md.prompt_token_ids is None and md.output_token_ids == []


def test_greedy_sampling_sees_penalties_allowed_ids_and_bad_words():
    """The Sampler applies all three before the greedy argmax (vLLM's order), per row."""
    batch = make_batch()
    # Logits favour token 3 everywhere, then 5, then 6.
    logits = torch.zeros(4, V)
    logits[:, 3], logits[:, 5], logits[:, 6] = 9.0, 8.0, 7.0
    batch.add_request(state("plain", [1], [3]))
    batch.add_request(state("rep", [3], [], repetition_penalty=2.0))         # 9 / 2 < 8: token 5
    batch.add_request(state("allowed", [1], [], allowed_token_ids=[6, 7]))    # only 6 or 7: token 6
    batch.add_request(state("bad", [1], [2], bad_words_token_ids=[[2, 3], [5]]))   # 3 and 5 banned: 6
    md = batch.refresh_metadata()
    assert not fused_sampling_applies(logits, md)
    before = logits.clone()
    out = Sampler()(logits, md).sampled_token_ids.tolist()
    assert out == [3, 5, 6, 6]
    assert torch.equal(logits, before), "the Sampler must not modify the runner's logits"
    mask = md.allowed_token_ids_mask
    assert mask is not None and mask.shape == (4, V) and not mask[0].any() and (~mask[2]).nonzero().flatten().tolist() == [6, 7]


def test_allowed_token_ids_random_sampling_stays_inside():
    batch = make_batch()
    batch.add_request(CachedRequestState("r", [1], SamplingParams(temperature=1.5, allowed_token_ids=[4, 9, 30]),
                                         None, ([1],), 0))
    md = batch.refresh_metadata()
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    seen = {Sampler()(logits, md).sampled_token_ids.item() for _ in range(200)}
    assert seen == {4, 9, 30}


def test_prompt_tensor_pads_with_vocab_size_not_stale_tokens():
    """A row reused by a shorter prompt must not leak the old prompt's tail into the prompt mask."""
    batch = make_batch()
    batch.add_request(state("long", [1, 2, 3, 4, 5, 6], [], repetition_penalty=1.2))
    batch.remove_request("long")
    batch.condense()
    batch.add_request(state("short", [7], [], repetition_penalty=1.2))
    batch.add_request(state("other", [8, 9, 10], [], repetition_penalty=1.2))
    md = batch.refresh_metadata()
    assert md.prompt_token_ids.tolist() == [[7, V, V], [8, 9, 10]]
    assert np.all(batch.num_prompt_tokens[:2] == [1, 3])
