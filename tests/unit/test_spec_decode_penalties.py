"""Penalties, bad_words and allowed_token_ids at the draft positions of the RejectionSampler.

With speculation, the target's logits at draft position j were computed as if
the drafts before j had been sampled; the logits processors must see the same
past tokens (vLLM: RejectionSampler.apply_logits_processors, apply_bad_words_with_drafts).
Checked three ways:
- each draft position's penalized row equals the per-token reference loop of
  tests/unit/test_sampling_penalties.py over the output + the drafts before it;
- bad words and the allowed-ids mask, per position, against readable references;
- end to end with a fabricated model (logits a function of the whole prefix): the
  greedy tokens the RejectionSampler keeps from any drafts equal those of plain
  sequential decoding with the same penalties, bad words and allowed ids;
- random rows: the target distribution of a draft position is the processed one;
- host cost: a batch with drafts but without penalties or bad words builds no
  per-position lists, and a step without drafts carries no spec_token_ids.
"""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_sampling_penalties import V, make_batch, reference_bad_words, reference_penalties, state
from vllm_anatomy.model_executor.bad_words import apply_bad_words_with_drafts
from vllm_anatomy.model_executor.rejection_sampler import RejectionSampler
from vllm_anatomy.model_executor.sampler import Sampler
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata
from vllm_anatomy.spec_decode.metadata import SpecDecodeMetadata


def metadata_for(states, drafts: list[list[int]]) -> SamplingMetadata:
    """The InputBatch's SamplingMetadata for these requests (rows in order) with these drafts."""
    batch = make_batch()
    for s in states:
        batch.add_request(s)
    batch.spec_token_ids = drafts
    return batch.refresh_metadata()


def test_combine_outputs_with_spec_tokens():
    combine = RejectionSampler._combine_outputs_with_spec_tokens
    assert combine([[1], [2, 3], [4]], [[7, 8, 9], [], [5]]) == [[1], [1, 7], [1, 7, 8], [4]]
    md = metadata_for([state("a", [0], [1], repetition_penalty=1.2), state("b", [0], [2])], [[7, 8], []])
    assert RejectionSampler._bonus_output_token_ids(md) == [[1, 7, 8], [2]]


def test_penalties_at_each_draft_position_equal_the_reference_loop():
    states = [state("a", [1, 2, 3], [3, 4], repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3),
              state("b", [5], [6], presence_penalty=1.1),
              state("c", [7, 8], [], frequency_penalty=-0.5, repetition_penalty=0.8),
              state("d", [9], [10, 10])]                                    # no penalties at all
    drafts = [[4, 4, 11], [], [8, 12], [10]]
    md = metadata_for(states, drafts)
    spec = SpecDecodeMetadata.make_dummy(drafts, "cpu")
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 3
    got = RejectionSampler(Sampler()).apply_logits_processors(logits.clone(), md, spec, {})
    position = 0
    for s, ds in zip(states, drafts):
        sp = s.sampling_params
        for j in range(len(ds)):
            want = reference_penalties(logits[position].tolist(), s.prompt_token_ids,
                                       s.output_token_ids + ds[:j], sp.presence_penalty,
                                       sp.frequency_penalty, sp.repetition_penalty)
            torch.testing.assert_close(got[position], torch.tensor(want), rtol=1e-6, atol=1e-6)
            position += 1
    assert position == got.shape[0]
    # The test can fail: draft 11 of request a is penalized only at its own position's successors.
    assert got[2, 11] == logits[2, 11] and got[1, 4] != logits[1, 4]


@pytest.mark.parametrize("drafts", [[1, 2, 3], [2, 3, 1], [9, 1, 2]])
def test_bad_words_with_drafts_equal_the_reference(drafts):
    words = [[7], [1, 2, 3], [2, 4], [3, 1, 5]]
    output = [5, 1]
    logits = torch.randn(len(drafts) + 2, V, generator=torch.Generator().manual_seed(3))
    got = logits.clone()
    # Row 0 (two drafts, no bad words), row 1 (this request's drafts).
    past = [[0], [0, 6], *[output + drafts[:j] for j in range(len(drafts))]]
    apply_bad_words_with_drafts(got, {1: words}, past, [2, len(drafts)])
    assert torch.equal(got[:2], logits[:2])
    for j in range(len(drafts)):
        assert got[2 + j].tolist() == reference_bad_words(logits[2 + j].tolist(), words, output + drafts[:j])


def test_allowed_token_ids_mask_repeated_per_position():
    states = [state("free", [1], []), state("only", [1], [], allowed_token_ids=[6, 7])]
    drafts = [[3], [6, 7, 8]]
    md = metadata_for(states, drafts)
    spec = SpecDecodeMetadata.make_dummy(drafts, "cpu")
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4))
    got = RejectionSampler(Sampler()).apply_logits_processors(logits.clone(), md, spec, {})
    assert torch.equal(got[0], logits[0])
    for row in got[1:]:
        assert torch.isfinite(row).nonzero().flatten().tolist() == [6, 7]


# -- end to end: the kept tokens equal plain sequential decoding ------------------------------
def fabricated_logits(prefix: list[int]) -> torch.Tensor:
    """A deterministic 'model': logits [V] from the whole prefix, favouring tokens it has seen
    (so a repetition penalty changes what greedy decoding says)."""
    g = torch.Generator().manual_seed(hash(tuple(prefix)) % (2 ** 31))
    logits = torch.randn(V, generator=g)
    for t in prefix[-4:]:
        logits[t] += 2.5
    return logits


def reference_next_token(s, past: list[int]) -> int:
    """Plain decoding, readable: the logits of prompt + past, every rule by hand, then argmax."""
    sp = s.sampling_params
    row = fabricated_logits(s.prompt_token_ids + past).tolist()
    if sp.allowed_token_ids:
        row = [x if t in sp.allowed_token_ids else float("-inf") for t, x in enumerate(row)]
    row = reference_bad_words(row, sp.bad_words_token_ids or [], past)
    row = reference_penalties(row, s.prompt_token_ids, past, sp.presence_penalty, sp.frequency_penalty,
                              sp.repetition_penalty)
    return max(range(V), key=lambda t: row[t])


def reference_continuation(s, n: int) -> list[int]:
    past = list(s.output_token_ids)
    for _ in range(n):
        past.append(reference_next_token(s, past))
    return past[len(s.output_token_ids):]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_tokens_with_drafts_equal_sequential_decoding(seed):
    states = [state("rep", [3, 4, 5], [6], repetition_penalty=1.8),
              state("freq", [1, 2], [2], frequency_penalty=1.5, presence_penalty=0.5),
              state("bad", [9, 10], [11], bad_words_token_ids=[[12, 13], [14]]),
              state("allowed", [15], [], allowed_token_ids=[15, 16, 17, 18])]
    k = 3
    gen = torch.Generator().manual_seed(seed)
    drafts, expected = [], []
    for s in states:
        want = reference_continuation(s, k + 1)
        ds = want[:k]
        # Corrupt one draft (or none): the sampler must keep exactly the matching prefix.
        wrong = int(torch.randint(0, k + 1, (1,), generator=gen))
        if wrong < k:
            ds = ds[:wrong] + [(ds[wrong] + 1 + int(torch.randint(0, V - 1, (1,), generator=gen))) % V] \
                + ds[wrong + 1:]
        drafts.append(ds)
        num_kept = next((j for j in range(k) if ds[j] != want[j]), k)
        expected.append(want[:num_kept + 1])
    md = metadata_for(states, drafts)
    spec = SpecDecodeMetadata.make_dummy(drafts, "cpu")
    logits = torch.stack([fabricated_logits(s.prompt_token_ids + s.output_token_ids + ds[:j])
                          for s, ds in zip(states, drafts) for j in range(len(ds) + 1)])
    out = RejectionSampler(Sampler())(spec, None, logits, md).sampled_token_ids
    valid, _ = RejectionSampler.parse_output(out, V)
    assert valid == expected
    # The test can fail: without the processors the fabricated model repeats itself.
    plain = [int(fabricated_logits(s.prompt_token_ids + s.output_token_ids).argmax()) for s in states]
    assert plain != [e[0] for e in expected]


def test_bonus_token_sees_every_draft():
    """All drafts accepted: the bonus token is sampled after them, so their repeats are penalized."""
    states = [state("rep", [1], [], repetition_penalty=2.0), state("bad", [1], [], bad_words_token_ids=[[5, 5, 5]])]
    drafts = [[5, 5], [5, 5]]
    logits = torch.zeros(6, V)
    logits[:, 5], logits[:, 6] = 9.0, 8.0          # token 5 first everywhere, 6 second
    out = RejectionSampler(Sampler())(SpecDecodeMetadata.make_dummy(drafts, "cpu"), None, logits,
                                      metadata_for(states, drafts)).sampled_token_ids
    # rep: 5 accepted at position 0; at position 1 it was seen (9 / 2 < 8): rejected, 6 recovered.
    # bad: both drafts accepted ([5, 5, 5] needs two 5s before it); the bonus would complete the word: 6.
    assert out.tolist() == [[5, 6, -1], [5, 5, 6]]


# -- host cost: only the batches that read past tokens pay for per-position lists -------------
@pytest.mark.parametrize("params", [dict(), dict(allowed_token_ids=[3, 4, 5]), dict(min_tokens=5),
                                    dict(temperature=0.7, top_k=4)], ids=["plain", "allowed", "min_tokens", "random"])
def test_drafts_without_penalties_build_no_per_position_lists(params, monkeypatch):
    def forbidden(*args):
        raise AssertionError("per-position past-token lists built for a batch that does not read them")
    monkeypatch.setattr(RejectionSampler, "_combine_outputs_with_spec_tokens", staticmethod(forbidden))
    sp = dict(params)
    temperature = sp.pop("temperature", 0.0)
    states = [state("a", [1, 2], [3], **sp), state("b", [4], [])]
    for s in states:
        s.sampling_params.temperature = temperature
    drafts = [[3, 4], [5]]
    md = metadata_for(states, drafts)
    assert md.no_penalties and not md.bad_words_token_ids and md.output_token_ids == []
    assert RejectionSampler._bonus_output_token_ids(md) is md.output_token_ids
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(5))
    out = RejectionSampler(Sampler())(SpecDecodeMetadata.make_dummy(drafts, "cpu"), None, logits, md)
    assert out.sampled_token_ids.shape == (2, 3)


def test_a_step_without_drafts_carries_none():
    """The plain Sampler path: no drafts, no spec_token_ids (nothing reads them)."""
    md = metadata_for([state("a", [1, 2], [3], repetition_penalty=1.5)], None)
    assert md.spec_token_ids is None
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(6))
    want = reference_penalties(logits[0].tolist(), [1, 2], [3], 0.0, 0.0, 1.5)
    assert int(Sampler()(logits, md).sampled_token_ids[0]) == max(range(V), key=lambda t: want[t])


def test_random_sampling_target_distribution_is_penalized():
    """Random rows: the target distribution p at a draft position is the penalized one,
    so a draft the penalty makes impossible (bad word) is never accepted, and the
    recovered token is never the banned one."""
    states = [state("bad", [1], [7], bad_words_token_ids=[[7, 8, 9]])]
    states[0].sampling_params.temperature = 1.0
    drafts = [[8, 9]]
    logits = torch.zeros(3, V)
    logits[:, 9] = 20.0                     # the target all but certainly says 9 ...
    logits[:, 8] = 20.0                     # ... or 8
    md = metadata_for(states, drafts)
    sampler = RejectionSampler(Sampler())
    for seed in range(20):
        torch.manual_seed(seed)
        out = sampler(SpecDecodeMetadata.make_dummy(drafts, "cpu"), None, logits.clone(), md).sampled_token_ids
        first, second = out[0, 0].item(), out[0, 1].item()
        # Position 0 (past [7]): 8 allowed; position 1 (past [7, 8]): 9 forbidden.
        assert first in (8, 9)
        if first == 8:
            assert second not in (9, -1), out
