"""RejectionSampler (vllm_anatomy/model_executor/rejection_sampler.py), on fabricated logits.

Greedy: the drafts are kept while they equal the target's argmax; the first
mismatch emits the argmax; all kept -> the bonus token. Random: every output
position is distributed as the target's own sample (temperature and top-k
applied), whatever the drafts were: checked with a chi-square test over a tiny
vocabulary (as vLLM's rejection-sampler tests do), with deterministic drafts
(ngram, a greedy draft model: draft_probs None) and with drafts sampled from
another distribution q (draft_probs given). The same counts must reject the
distributions a bug would give (the drafts' own q, or "accept if u < 0.5").
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_anatomy.model_executor.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from vllm_anatomy.model_executor.sampler import Sampler
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata
from vllm_anatomy.spec_decode.metadata import SpecDecodeMetadata

V = 8
# Chi-square critical values at p = 0.001 (df = V - 1 = 7).
CHI2_P001_DF7 = 24.32


def metadata(batch: int, temperature: float | None, top_k: int | None = None, logprobs: int | None = None,
             generators: dict | None = None) -> SamplingMetadata:
    greedy = temperature is None
    return SamplingMetadata(
        temperature=None if temperature is None else torch.full((batch,), temperature), all_greedy=greedy,
        all_random=not greedy,
        top_p=None, top_k=None if top_k is None else torch.full((batch,), top_k, dtype=torch.int32), min_p=None,
        generators=generators or {}, max_num_logprobs=logprobs)


def batch_logits(per_request: list[torch.Tensor]) -> torch.Tensor:
    """Stack each request's [k + 1, V] rows (its drafts' rows, then its bonus row)."""
    return torch.cat(per_request)


def test_greedy_keeps_drafts_while_they_match_argmax():
    # Request 0: drafts [1, 2, 3], argmax [1, 2, 5] -> [1, 2, 5] (rejected at 2).
    # Request 1: drafts [4], argmax [4], bonus row argmax 6 -> [4, 6].
    # Request 2: no drafts, bonus row argmax 7 -> [7].
    def rows(ids):
        return torch.nn.functional.one_hot(torch.tensor(ids), V).float() * 5
    logits = batch_logits([rows([1, 2, 5, 0]), rows([4, 6]), rows([7])])
    md = SpecDecodeMetadata.make_dummy([[1, 2, 3], [4], []], "cpu")
    out = RejectionSampler(Sampler())(md, None, logits, metadata(3, None)).sampled_token_ids
    assert out.tolist() == [[1, 2, 5, -1], [4, 6, -1, -1], [7, -1, -1, -1]]
    valid, keep = RejectionSampler.parse_output(out, V)
    assert valid == [[1, 2, 5], [4, 6], [7]]
    assert RejectionSampler.parse_output(out, V, discard_req_indices=[1])[0] == [[1, 2, 5], [], [7]]
    assert keep[1] == [True, True, False, False]


def test_all_drafts_accepted_appends_the_bonus():
    rows = torch.nn.functional.one_hot(torch.tensor([3, 3, 2]), V).float() * 5
    md = SpecDecodeMetadata.make_dummy([[3, 3]], "cpu")
    out = RejectionSampler(Sampler())(md, None, rows, metadata(1, None)).sampled_token_ids
    assert out.tolist() == [[3, 3, 2]]


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected.clamp_min(1e-300)).sum())


TARGET = torch.tensor([[1.5, 0.2, -0.4, 0.9, 0.0, -1.0, 0.6, 0.3],      # draft position 0
                       [0.1, 1.1, 0.5, -0.3, 0.8, 0.0, -0.6, 0.4],      # draft position 1
                       [0.7, -0.2, 0.3, 1.0, -0.5, 0.2, 0.6, -0.1]])    # bonus
TEMPERATURE = 0.8


def target_probs(row: int, top_k: int | None = None) -> torch.Tensor:
    logits = TARGET[row] / TEMPERATURE
    if top_k is not None:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    return logits.softmax(-1)


def sample_many(n: int, drafts: torch.Tensor, draft_probs: torch.Tensor | None, top_k: int | None = None,
                seed: int = 0) -> torch.Tensor:
    """n requests, each with the 2 drafts drafts[i] and the same target logits -> outputs [n, 3]."""
    torch.manual_seed(seed)
    md = SpecDecodeMetadata.make_dummy(drafts.tolist(), "cpu")
    logits = TARGET.repeat(n, 1)                                               # [n * 3, V]
    out = RejectionSampler(Sampler())(md, draft_probs, logits, metadata(n, TEMPERATURE, top_k)).sampled_token_ids
    return out


@pytest.mark.parametrize("draft_kind", ["deterministic", "sampled_from_q"])
def test_random_outputs_follow_the_target_distribution(draft_kind):
    n = 20000
    gen = torch.Generator().manual_seed(1)
    q = torch.tensor([0.05, 0.3, 0.05, 0.2, 0.1, 0.1, 0.1, 0.1])            # the drafter's distribution
    if draft_kind == "deterministic":
        drafts = torch.tensor([[3, 4]]).repeat(n, 1)                           # always the same guess
        draft_probs = None
    else:
        drafts = torch.multinomial(q, 2 * n, replacement=True, generator=gen).view(n, 2)
        draft_probs = q.repeat(2 * n, 1)                                       # [n * 2, V]
    out = sample_many(n, drafts, draft_probs)
    first = out[:, 0].long()
    assert chi_square(first, target_probs(0)) < CHI2_P001_DF7
    # A bug that emitted the drafts' own distribution (or accepted every draft) fails the same test.
    wrong = q if draft_kind == "sampled_from_q" else torch.nn.functional.one_hot(torch.tensor(3), V).float()
    assert chi_square(first, (wrong + 1e-9) / (wrong + 1e-9).sum()) > 10 * CHI2_P001_DF7
    # Position 1, for the requests whose first draft was accepted: the target's row 1.
    accepted = out[:, 0] == drafts[:, 0]
    second = out[accepted, 1].long()
    assert second.numel() > 1000 and (second >= 0).all()
    assert chi_square(second, target_probs(1)) < CHI2_P001_DF7
    # Both accepted: the bonus token, from the bonus row.
    both = accepted & (out[:, 1] == drafts[:, 1])
    assert chi_square(out[both, 2].long(), target_probs(2)) < CHI2_P001_DF7


def test_top_k_applies_to_every_draft_position():
    n = 20000
    drafts = torch.tensor([[6, 1]]).repeat(n, 1)       # token 6 is outside row 0's top 3
    out = sample_many(n, drafts, None, top_k=3)
    first = out[:, 0].long()
    p = target_probs(0, top_k=3)
    assert set(first.unique().tolist()) <= set(torch.nonzero(p).flatten().tolist())
    assert chi_square(first, p) < CHI2_P001_DF7


def test_accept_rule_is_not_a_coin_flip():
    """The acceptance rate of a deterministic draft d is p(d) (not a constant)."""
    n = 20000
    for token in (0, 5):
        out = sample_many(n, torch.tensor([[token, 1]]).repeat(n, 1), None, seed=token)
        rate = float((out[:, 0] == token).double().mean())
        assert abs(rate - float(target_probs(0)[token])) < 0.015, (token, rate)


def test_seeded_requests_reproduce():
    drafts = torch.tensor([[3, 4], [1, 2]])

    def run(seed_state: int):
        gens = {0: torch.Generator().manual_seed(7)}
        torch.manual_seed(seed_state)                  # the unseeded row's global RNG differs between runs
        md = SpecDecodeMetadata.make_dummy(drafts.tolist(), "cpu")
        return RejectionSampler(Sampler())(md, None, TARGET.repeat(2, 1),
                                           metadata(2, TEMPERATURE, generators=gens)).sampled_token_ids

    runs = [run(s) for s in range(6)]
    assert all(r[0].tolist() == runs[0][0].tolist() for r in runs)


def test_min_tokens_masks_only_the_positions_before_it():
    # A request 1 output short of min_tokens with stop token 2: draft position 0 may not be 2,
    # position 1 may; with 2 drafts the bonus row (position 2) may too.
    rows = torch.nn.functional.one_hot(torch.tensor([2, 2, 2]), V).float() * 5
    rows[0, 4] = 4.0                                   # the runner-up at position 0
    md = SpecDecodeMetadata.make_dummy([[4, 2]], "cpu")
    sm = dataclasses.replace(metadata(1, None), min_tokens={0: [2]})
    out = RejectionSampler(Sampler())(md, None, rows, sm, min_tokens_remaining={0: (1, [2])}).sampled_token_ids
    assert out.tolist() == [[4, 2, 2]]
    # Two short: the bonus row is masked too only when all drafts' positions are still before min_tokens.
    out = RejectionSampler(Sampler())(md, None, rows.clone(), sm,
                                      min_tokens_remaining={0: (3, [2])}).sampled_token_ids
    assert out[0, 0].item() == 4 and out[0, 1].item() != 2


def test_logprobs_of_kept_positions():
    rows = torch.nn.functional.one_hot(torch.tensor([1, 2, 5, 0]), V).float() * 5
    md = SpecDecodeMetadata.make_dummy([[1, 2, 3]], "cpu")
    out = RejectionSampler(Sampler())(md, None, rows, metadata(1, None, logprobs=2))
    lp = out.logprobs_tensors
    assert lp is not None and lp.logprob_token_ids.shape == (4, 3)
    ref = rows.log_softmax(-1)
    for j, token in enumerate([1, 2, 5]):              # the kept positions, in order
        assert lp.logprob_token_ids[j, 0].item() == token
        assert lp.logprobs[j, 0].item() == pytest.approx(ref[j, token].item())
        assert lp.selected_token_ranks[j].item() == 1
    assert out.sampled_token_ids[0, 3].item() == PLACEHOLDER_TOKEN_ID
