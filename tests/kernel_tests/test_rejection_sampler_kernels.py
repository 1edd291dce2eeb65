"""The rejection sampler's Triton kernels (vllm_anatomy/kernels/rejection_sampler.py) against
the torch reference (vllm_anatomy/model_executor/rejection_sampler.py): the same output tokens
from the same random numbers.

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by this folder's
conftest); on a GPU (marked `gpu`) compiled, with a Qwen3-sized vocabulary (151,936: 19
tiles of the recovered-token loop) and batches up to 256.
"""
from __future__ import annotations

import pytest
import torch

from tests.kernel_tests.kernel_utils import DEVICE, ON_GPU, requires_cuda
from vllm_anatomy.kernels import rejection_sampler as kernels
from vllm_anatomy.model_executor import rejection_sampler as reference
from vllm_anatomy.model_executor.rejection_sampler import RejectionSampler
from vllm_anatomy.model_executor.sampler import Sampler
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata
from vllm_anatomy.spec_decode.metadata import SpecDecodeMetadata


def make_batch(num_draft_tokens: list[int], vocab: int, seed: int, match_rate: float = 0.6):
    """Drafts that often equal the target argmax (so acceptance runs vary), and the random inputs."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(num_draft_tokens)
    logits = torch.randn(num_tokens, vocab, generator=gen) * 3
    argmax = logits.argmax(-1)
    drafts = torch.randint(0, vocab, (num_tokens,), generator=gen)
    keep = torch.rand(num_tokens, generator=gen) < match_rate
    drafts = torch.where(keep, argmax, drafts).to(torch.int32)
    batch = len(num_draft_tokens)
    return dict(
        cu=torch.tensor(torch.tensor(num_draft_tokens).cumsum(0).tolist(), dtype=torch.int32).to(DEVICE),
        drafts=drafts.to(DEVICE), argmax=argmax.to(DEVICE), probs=logits.softmax(-1).to(DEVICE),
        draft_probs=torch.rand(num_tokens, vocab, generator=gen).softmax(-1).to(DEVICE),
        bonus=torch.randint(0, vocab, (batch,), generator=gen).to(DEVICE),
        uniform=torch.rand(num_tokens, generator=gen, dtype=torch.float64).to(DEVICE),
        inv_q=torch.empty(batch, vocab).exponential_(generator=gen).reciprocal().to(DEVICE),
        is_greedy=(torch.rand(batch, generator=gen) < 0.4).to(DEVICE))


def run_all(ops, b: dict, max_spec_len: int, with_draft_probs: bool):
    batch = b["bonus"].shape[0]
    greedy_out = torch.full((batch, max_spec_len + 1), -1, dtype=torch.int32, device=DEVICE)
    ops.rejection_greedy_sample(greedy_out, b["cu"], b["drafts"], b["argmax"], b["bonus"], b["is_greedy"],
                                max_spec_len)
    draft_probs = b["draft_probs"] if with_draft_probs else None
    recovered = ops.sample_recovered_tokens(b["cu"], b["drafts"], draft_probs, b["probs"], b["inv_q"], max_spec_len)
    random_out = torch.full((batch, max_spec_len + 1), -1, dtype=torch.int32, device=DEVICE)
    ops.rejection_random_sample(random_out, b["cu"], b["drafts"], draft_probs, b["probs"], b["bonus"], recovered,
                                b["uniform"], b["is_greedy"], max_spec_len)
    return greedy_out.cpu(), recovered.cpu(), random_out.cpu()


CASES = [([3, 0, 2, 1], 50), ([1], 7), ([4, 4, 4], 300), ([0, 0, 5], 20)]


@pytest.mark.parametrize("num_draft_tokens,vocab", CASES)
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_kernels_equal_reference(num_draft_tokens, vocab, with_draft_probs):
    for seed in range(3):
        b = make_batch(num_draft_tokens, vocab, seed)
        max_spec_len = max(num_draft_tokens)
        ours = run_all(kernels, b, max_spec_len, with_draft_probs)
        ref = run_all(reference, b, max_spec_len, with_draft_probs)
        for got, want, what in zip(ours, ref, ("greedy", "recovered", "random")):
            assert torch.equal(got, want), (what, seed, got, want)


def test_greedy_kernel_with_every_row_greedy():
    b = make_batch([2, 3], 30, seed=4)
    out_k = torch.full((2, 4), -1, dtype=torch.int32, device=DEVICE)
    out_r = out_k.clone()
    kernels.rejection_greedy_sample(out_k, b["cu"], b["drafts"], b["argmax"], b["bonus"], None, 3)
    reference.rejection_greedy_sample(out_r, b["cu"], b["drafts"], b["argmax"], b["bonus"], None, 3)
    assert torch.equal(out_k, out_r)


def test_recovered_token_never_the_rejected_draft():
    """Without draft probs the recovered token comes from p with the draft removed."""
    b = make_batch([5, 5], 6, seed=9)
    recovered = kernels.sample_recovered_tokens(b["cu"], b["drafts"], None, b["probs"], b["inv_q"], 5)
    assert not (recovered == b["drafts"]).any()


def test_rejection_sampler_end_to_end_same_tokens():
    """RejectionSampler with the kernels and with the reference: from the same global seed, the same tokens."""
    num_draft_tokens = [3, 1, 0, 2]
    vocab = 40
    md = SpecDecodeMetadata.make_dummy([[1] * n for n in num_draft_tokens], DEVICE)
    logits = torch.randn(sum(num_draft_tokens) + 4, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    sm = SamplingMetadata(temperature=torch.tensor([0.0, 0.7, 1.0, 0.5], device=DEVICE), all_greedy=False,
                          all_random=False, top_p=None, top_k=None, min_p=None, generators={}, max_num_logprobs=None)
    outs = []
    for use_triton in (True, False):
        torch.manual_seed(123)
        outs.append(RejectionSampler(Sampler(), use_triton=use_triton)(md, None, logits, sm).sampled_token_ids.cpu())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@requires_cuda
def test_qwen3_vocab_batch_256_on_gpu():
    assert ON_GPU
    num_draft_tokens = [3] * 200 + [0] * 30 + [1] * 26
    b = make_batch(num_draft_tokens, 151936, seed=5, match_rate=0.8)
    for with_draft_probs in (False, True):
        ours = run_all(kernels, b, 3, with_draft_probs)
        ref = run_all(reference, b, 3, with_draft_probs)
        for got, want in zip(ours, ref):
            assert torch.equal(got, want)
