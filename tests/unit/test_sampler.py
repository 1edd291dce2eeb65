"""Sampler: greedy, temperature, min-p, top-k/top-p, seeded generators, logprobs."""
from __future__ import annotations

import pytest
import torch

from vllm_anatomy.model_executor.sampler import Sampler
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata

sampler = Sampler()


def md(n: int, temperature=None, top_k=None, top_p=None, min_p=None, generators=None,
       max_num_logprobs=None) -> SamplingMetadata:
    """Metadata for n rows; scalars broadcast to every row, lists give one value per row."""
    def t(v, dtype):
        if v is None:
            return None
        return torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dtype)
    temp = t(temperature, torch.float32)
    greedy = temp is None or bool((temp < 1e-5).all())
    return SamplingMetadata(temperature=None if greedy else temp, all_greedy=greedy,
                            all_random=temp is not None and bool((temp >= 1e-5).all()),
                            top_p=t(top_p, torch.float32), top_k=t(top_k, torch.int32),
                            min_p=t(min_p, torch.float32), generators=generators or {},
                            max_num_logprobs=max_num_logprobs)


def logits_rows(n: int, v: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logits_untouched():
    logits = logits_rows(6)
    before = logits.clone()
    out = sampler(logits, md(6))
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs_tensors is None
    assert torch.equal(logits, before)


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(0)
    logits = logits_rows(64)
    argmax = logits.argmax(-1).tolist()
    assert sampler(logits, md(64, temperature=1.5, top_k=1)).sampled_token_ids.tolist() == argmax
    assert sampler(logits, md(64, temperature=1.5, top_p=1e-6)).sampled_token_ids.tolist() == argmax


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = logits_rows(2, v=1000)
    # Row 0 greedy; row 1 hot sampling over a flat-ish distribution rarely hits argmax.
    hits = 0
    for _ in range(20):
        out = sampler(logits, md(2, temperature=[0.0, 5.0])).sampled_token_ids
        assert out[0] == logits[0].argmax()
        hits += int(out[1] == logits[1].argmax())
    assert hits < 10


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


N_DRAWS = 20000
CHI2_DF4_P001 = 18.47   # chi-square critical value, 4 degrees of freedom, p = 0.001


def test_temperature_distribution():
    torch.manual_seed(1)
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    logits = row.expand(N_DRAWS, 5).contiguous()
    samples = sampler(logits, md(N_DRAWS, temperature=0.7)).sampled_token_ids
    assert chi_square(samples, torch.softmax(row / 0.7, -1)) < CHI2_DF4_P001
    # The test can tell temperatures apart: the T=1 distribution is rejected.
    assert chi_square(samples, torch.softmax(row, -1)) > 10 * CHI2_DF4_P001


def test_top_k_top_p_distribution():
    torch.manual_seed(2)
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    logits = row.expand(N_DRAWS, 6).contiguous()
    # top-k 3 keeps tokens 0..2, renormalised.
    samples = sampler(logits, md(N_DRAWS, temperature=1.0, top_k=3)).sampled_token_ids
    p = torch.softmax(row, -1)
    p3 = torch.where(torch.arange(6) < 3, p, 0.0)
    assert chi_square(samples, p3 / p3.sum()) < 13.82   # df=2
    # top-p: smallest prefix with mass >= 0.6 -> tokens 0 and 1 (0.39, then 0.63).
    assert p[0] < 0.6 < p[0] + p[1]
    samples = sampler(logits, md(N_DRAWS, temperature=1.0, top_p=0.6)).sampled_token_ids
    p2 = torch.where(torch.arange(6) < 2, p, 0.0)
    assert chi_square(samples, p2 / p2.sum()) < 10.83   # df=1


def test_min_p_drops_unlikely_tokens():
    torch.manual_seed(3)
    row = torch.tensor([3.0, 2.6, 2.0, 1.0, 0.0])
    p = torch.softmax(row, -1)
    allowed = p >= 0.5 * p.max()          # tokens 0 and 1 (2 is at ~0.30 of the max)
    assert allowed.tolist() == [True, True, False, False, False]
    logits = row.expand(N_DRAWS, 5).contiguous()
    samples = sampler(logits, md(N_DRAWS, temperature=1.0, min_p=0.5)).sampled_token_ids
    q = torch.where(allowed, p, 0.0)
    assert chi_square(samples, q / q.sum()) < 10.83


def test_seeded_sampling_reproducible_across_batches():
    x = logits_rows(1, v=300, seed=5)[0]

    def run(batch_rows: int, x_row: int, steps: int = 5) -> list[int]:
        g = torch.Generator().manual_seed(1234)
        out = []
        for step in range(steps):
            others = logits_rows(batch_rows, v=300, seed=100 + step)
            logits = others.clone()
            logits[x_row] = x
            temps = [0.9] * batch_rows
            temps[0] = 0.0 if x_row != 0 else 0.9          # a greedy neighbour
            gens = {x_row: g}
            if batch_rows > 2:                              # another seeded neighbour
                other = (x_row + 1) % batch_rows
                gens[other] = torch.Generator().manual_seed(step)
            res = sampler(logits, md(batch_rows, temperature=temps, top_p=0.95, generators=gens))
            out.append(int(res.sampled_token_ids[x_row]))
        return out

    alone = run(1, 0)
    assert run(3, 1) == alone
    assert run(5, 4) == alone
    assert len(set(alone)) > 1                          # it really samples (not argmax)
    torch.manual_seed(99)                               # the global RNG plays no part
    assert run(4, 2) == alone


def test_logprobs_values_and_ranks():
    torch.manual_seed(4)
    logits = logits_rows(8, v=40)
    out = sampler(logits, md(8, temperature=2.0, max_num_logprobs=3))
    lt = out.logprobs_tensors
    assert lt is not None
    raw = torch.log_softmax(logits, -1)                 # raw: before temperature
    sampled = out.sampled_token_ids
    assert lt.logprob_token_ids.shape == (8, 4)
    assert lt.logprob_token_ids[:, 0].tolist() == sampled.tolist()
    for r in range(8):
        ids = lt.logprob_token_ids[r]
        torch.testing.assert_close(lt.logprobs[r], raw[r, ids])
        top3 = raw[r].topk(3).indices.tolist()
        assert ids[1:].tolist() == top3
        order = raw[r].argsort(descending=True).tolist()
        assert int(lt.selected_token_ranks[r]) == order.index(int(sampled[r])) + 1
    # Greedy: the sampled token is rank 1 and equals the first top token.
    out = sampler(logits, md(8, max_num_logprobs=0))
    assert out.logprobs_tensors.selected_token_ranks.tolist() == [1] * 8
    assert out.logprobs_tensors.logprob_token_ids.shape == (8, 1)


@pytest.mark.parametrize("v", [2, 7])
def test_sampled_ids_in_range_and_dtype(v):
    out = sampler(logits_rows(3, v=v), md(3, temperature=1.0, top_k=[1, v, v], top_p=[1.0, 0.5, 1.0]))
    assert out.sampled_token_ids.shape == (3,)
    assert out.sampled_token_ids.dtype == torch.int64
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < v)).all()


# -- the fused sampling seam (sampler.py NOTE; the kernel: tests/kernel_tests/test_sampling.py) ----------

@pytest.fixture
def fused_calls(monkeypatch):
    """Let the seam consider CPU tensors, and record fused_sample's calls instead of running it."""
    import vllm_anatomy.model_executor.sampler as sampler_mod
    calls = []

    def fake_fused_sample(logits, temperature):
        calls.append(logits.shape)
        return logits.argmax(-1)

    monkeypatch.setattr(sampler_mod, "FUSED_SAMPLING_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(sampler_mod, "USE_FUSED_SAMPLING", True)
    monkeypatch.setattr(sampler_mod, "fused_sample", fake_fused_sample)
    return calls


def test_fused_path_taken_for_temperature_only_batches(fused_calls):
    logits = logits_rows(4)
    sampler(logits, md(4, temperature=0.6))
    sampler(logits, md(4, temperature=[0.0, 0.6, 1.0, 0.0]))           # mixed greedy / random
    out = sampler(logits, md(4, temperature=0.6, max_num_logprobs=2))   # logprobs: from the raw logits
    assert fused_calls == [logits.shape] * 3
    assert out.logprobs_tensors is not None
    torch.testing.assert_close(out.logprobs_tensors.logprobs[:, 1:],
                               torch.log_softmax(logits, -1).topk(2, dim=-1).values)


@pytest.mark.parametrize("case", ["all_greedy", "top_k", "top_p", "min_p", "seeded", "min_tokens",
                                  "logit_bias", "switched_off", "not_cuda"])
def test_fused_path_falls_back(fused_calls, monkeypatch, case):
    import vllm_anatomy.model_executor.sampler as sampler_mod
    logits = logits_rows(4)
    meta = {
        "all_greedy": md(4),
        "top_k": md(4, temperature=0.6, top_k=5),
        "top_p": md(4, temperature=0.6, top_p=0.9),
        "min_p": md(4, temperature=0.6, min_p=0.1),
        "seeded": md(4, temperature=0.6, generators={2: torch.Generator().manual_seed(0)}),
    }.get(case) or md(4, temperature=0.6)
    if case == "min_tokens":
        meta.min_tokens = {1: [3]}
    if case == "logit_bias":
        meta.logit_bias = (torch.tensor([0]), torch.tensor([3]), torch.tensor([5.0]))
    if case == "switched_off":
        monkeypatch.setattr(sampler_mod, "USE_FUSED_SAMPLING", False)
    if case == "not_cuda":
        monkeypatch.setattr(sampler_mod, "FUSED_SAMPLING_DEVICES", ("cuda",))
    out = sampler(logits, meta)
    assert fused_calls == []
    assert out.sampled_token_ids.shape == (4,)
