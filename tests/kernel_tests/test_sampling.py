"""gumbel_sample (vllm_anatomy/kernels/sampling.py): greedy rows are argmax, temperature rows sample softmax(logits / T).

On CPU the kernel runs in Triton's interpreter (fp32, small vocabularies, a
few hundred draws: each row is one program there, ~tens of ms); on a GPU
(marked `gpu`) bf16 logits at Qwen3's vocabulary (151,936), batches of 1, 7
and 256, ~20k draws per distribution, and the Sampler's seam on CUDA.

A sampler that is wrong in distribution still returns valid token ids, so
the statistical tests compare counts with the exact probabilities
(chi-square), and check that the same counts reject the distributions a bug
would give: the wrong temperature (T = 1), or the wrong sign of the noise
(argmax(logits / T + log E)).
"""
import pytest
import torch
import triton
import triton.language as tl

from tests.kernel_tests.kernel_utils import DEVICE, ON_GPU, requires_cuda
from vllm_anatomy.kernels import sampling
from vllm_anatomy.kernels.sampling import gumbel_sample
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata

# Chi-square critical values at p = 0.001 (df = categories - 1).
CHI2_P001 = {7: 24.32}
ROW8 = torch.tensor([1.2, 0.9, 0.6, 0.3, 0.0, -0.3, -0.6, 0.45])    # softmax(ROW8 / 0.6) >= 0.018


def seed_tensor(seed: int, device=DEVICE) -> torch.Tensor:
    return torch.tensor([seed], dtype=torch.int64, device=device)


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples.cpu(), minlength=probs.numel()).double()
    expected = probs.double().cpu() * samples.numel()
    # (a category of probability 0: 0 if never drawn, else inf)
    return float(((counts - expected) ** 2 / expected.clamp_min(1e-300)).sum())


def wrong_sign_probs(row: torch.Tensor, temp: float, draws: int = 400_000) -> torch.Tensor:
    """The distribution of argmax(row / T + log E): the bug of a flipped noise sign (Monte Carlo)."""
    gen = torch.Generator().manual_seed(7)
    e = torch.empty(draws, row.numel()).exponential_(generator=gen)
    ids = (row / temp + e.log()).argmax(-1)
    return torch.bincount(ids, minlength=row.numel()).double() / draws


def check_distribution(samples: torch.Tensor, row: torch.Tensor, temp: float, alt_factor: float) -> None:
    """samples ~ softmax(row / temp), and the same counts reject T = 1 and the flipped sign
    (by alt_factor x the critical value)."""
    crit = CHI2_P001[row.numel() - 1]
    assert chi_square(samples, torch.softmax(row.double() / temp, -1)) < crit
    assert chi_square(samples, torch.softmax(row.double(), -1)) > alt_factor * crit
    assert chi_square(samples, wrong_sign_probs(row, temp)) > alt_factor * crit


# ---------------------------------------------------------------- the noise

# What gumbel_sample passes: lg2.approx on a GPU, tl.log2 in the interpreter.
FAST_LOG2 = ON_GPU
LOG2E = 1.4426950408889634


@triton.jit
def _noise_kernel(bits_ptr, out_ptr, N: tl.constexpr, FAST_LOG2: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, sampling._exponential_noise(tl.load(bits_ptr + offs), FAST_LOG2))


@triton.jit
def _random_noise_kernel(seed_ptr, out_ptr, N: tl.constexpr, FAST_LOG2: tl.constexpr):
    offs = tl.arange(0, N)
    b0, b1, b2, b3 = tl.randint4x(tl.load(seed_ptr), offs.to(tl.int64))
    tl.store(out_ptr + offs, sampling._exponential_noise(b0, FAST_LOG2))
    tl.store(out_ptr + N + offs, sampling._exponential_noise(b1, FAST_LOG2))
    tl.store(out_ptr + 2 * N + offs, sampling._exponential_noise(b2, FAST_LOG2))
    tl.store(out_ptr + 3 * N + offs, sampling._exponential_noise(b3, FAST_LOG2))


def test_exponential_noise_is_minus_log1p_of_the_uniform():
    """Random word x (int32 >= 0) -> u = x * 2**-31 -> E2 = -log1p(-u) * log2(e), accurate at
    both ends (the GPU's lg2.approx: within ~1e-5 relative where the series does not apply)."""
    xs = [0, 1, 1000, 2**20, 2**25 - 1, 2**25, 2**25 + 1, 2**28, 2**30, 2**31 - 2**8, 2**31 - 1]
    n = 16
    bits = torch.tensor(xs + [2**24] * (n - len(xs)), dtype=torch.int32, device=DEVICE)
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    _noise_kernel[(1,)](bits, out, N=n, FAST_LOG2=FAST_LOG2)
    u = (bits.cpu().double() * 4.6566127342e-10).clamp_min(4.6566127342e-10)
    # The kernel's u is rounded to fp32 first: compare with that u.
    expected = -torch.log1p(-u.float().double()) * LOG2E
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-5 if FAST_LOG2 else 2e-6, atol=0)


def test_exponential_noise_is_exp1():
    n = 4096
    out = torch.empty(4 * n, dtype=torch.float32, device=DEVICE)
    _random_noise_kernel[(1,)](seed_tensor(11), out, N=n, FAST_LOG2=FAST_LOG2)
    e = (out.cpu().double() / LOG2E).sort().values
    assert (e > 0).all() and e.isfinite().all()
    # Kolmogorov-Smirnov against Exp(1): D < 1.95 / sqrt(n) at p = 0.001.
    ecdf = torch.arange(1, e.numel() + 1, dtype=torch.float64) / e.numel()
    d = float((ecdf - (1 - torch.exp(-e))).abs().max())
    assert d < 1.95 / e.numel() ** 0.5, d
    # The four Philox words are four independent streams, not copies.
    a, b = out[:n].cpu(), out[n:2 * n].cpu()
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.06


# ---------------------------------------------------------------- the kernel

def test_greedy_rows_are_argmax_with_ties_to_the_lowest_id():
    v = 300                                    # block 64 (16 per sub-block): 5 blocks a row
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, v, generator=gen) * 3
    logits[0, [10, 200]] = 50.0                # tie across blocks
    logits[1, [17, 20]] = 50.0                 # tie inside a sub-block
    logits[3, [70, 100]] = 50.0                # tie across sub-blocks of one block
    temp = torch.tensor([0.0, 0.0, 0.8, 0.0, 1.5, 0.0])
    logits, temp = logits.to(DEVICE), temp.to(DEVICE)
    before = logits.clone()
    ids = gumbel_sample(logits, temp, seed_tensor(1), block_size=64)
    assert ids.dtype == torch.int64 and ids.shape == (6,)
    greedy = temp.cpu() < 1e-5
    assert ids.cpu()[greedy].tolist() == logits.cpu().argmax(-1)[greedy].tolist()
    assert ids[[0, 1, 3]].tolist() == [10, 17, 70]
    assert ((ids >= 0) & (ids < v)).all()
    assert torch.equal(logits, before)


def test_non_contiguous_rows():
    logits = (torch.randn(3, 2 * 100, generator=torch.Generator().manual_seed(1)) * 3).to(DEVICE)
    view = logits[:, 50:150]                   # row stride 200
    ids = gumbel_sample(view, torch.zeros(3, device=DEVICE), seed_tensor(1))
    assert ids.tolist() == view.argmax(-1).tolist()


def test_same_seed_same_ids_other_seed_other_ids():
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    temp = torch.ones(8, device=DEVICE)
    a = gumbel_sample(logits, temp, seed_tensor(123))
    assert torch.equal(a, gumbel_sample(logits, temp, seed_tensor(123)))
    assert not torch.equal(a, gumbel_sample(logits, temp, seed_tensor(124)))


@pytest.mark.slow
def test_temperature_distribution_small_vocab():
    """One 8-token row at T = 0.6 in every row: one draw per row (rows must get independent
    noise). 400 rows in the interpreter (~20 s; chi-square vs T = 1 is ~2x the critical value
    on average), 20,480 on a GPU."""
    n, temp = (20480, 0.6) if ON_GPU else (400, 0.6)
    logits = ROW8.expand(n, 8).contiguous().to(DEVICE)
    samples = gumbel_sample(logits, torch.full((n,), temp, device=DEVICE), seed_tensor(5))
    check_distribution(samples, ROW8, temp, alt_factor=10.0 if ON_GPU else 1.0)


def test_sampler_takes_the_fused_path(monkeypatch):
    """The Sampler's seam with the real kernel (CPU allowed here, in the interpreter)."""
    import vllm_anatomy.model_executor.sampler as sampler_mod
    monkeypatch.setattr(sampler_mod, "FUSED_SAMPLING_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(sampler_mod, "USE_FUSED_SAMPLING", True)
    calls = []
    real = sampler_mod.fused_sample
    monkeypatch.setattr(sampler_mod, "fused_sample", lambda *a: calls.append(1) or real(*a))
    logits = (torch.randn(4, 100, generator=torch.Generator().manual_seed(3)) * 3).to(DEVICE)
    temp = torch.tensor([0.0, 0.7, 0.0, 1.0], device=DEVICE)
    md = SamplingMetadata(temperature=temp, all_greedy=False, all_random=False, top_p=None,
                          top_k=None, min_p=None, generators={}, max_num_logprobs=1)
    torch.manual_seed(0)
    out = sampler_mod.Sampler()(logits, md)
    assert calls == [1]
    ids = out.sampled_token_ids
    assert ids[[0, 2]].tolist() == logits.argmax(-1)[[0, 2]].tolist()
    assert out.logprobs_tensors is not None
    assert out.logprobs_tensors.logprob_token_ids[:, 0].tolist() == ids.tolist()
    torch.manual_seed(0)                       # the seed comes from torch's generator
    assert torch.equal(sampler_mod.Sampler()(logits, md).sampled_token_ids, ids)


# ---------------------------------------------------------------- on a GPU: bf16, Qwen3's vocabulary

VOCAB = 151936


def bf16_logits(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 3).to(torch.bfloat16).cuda()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_gpu_bf16_greedy_exact_and_seeded(rows):
    logits = bf16_logits(rows, rows)
    temp = torch.where(torch.arange(rows) % 3 == 0, 0.0, 0.6).float().cuda()   # row 0 greedy
    if rows == 1:
        temp[0] = 0.0
    ids = gumbel_sample(logits, temp, seed_tensor(1, "cuda"))
    assert ids.dtype == torch.int64 and ids.shape == (rows,)
    assert ((ids >= 0) & (ids < VOCAB)).all()
    greedy = temp < 1e-5
    assert torch.equal(ids[greedy], logits.float().argmax(-1)[greedy])
    assert torch.equal(ids, gumbel_sample(logits, temp, seed_tensor(1, "cuda")))
    # Flat logits at T = 1: other seeds give other ids.
    flat = torch.randn(rows, VOCAB, device="cuda").to(torch.bfloat16)
    ones = torch.ones(rows, device="cuda")
    draws = torch.stack([gumbel_sample(flat, ones, seed_tensor(s, "cuda")) for s in range(4)])
    assert (draws != draws[0]).any()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_distribution_small_vocab(dtype):
    n, temp = 20480, 0.6
    row = ROW8.to(dtype).float()
    logits = row.expand(n, 8).contiguous().to(dtype).cuda()
    samples = gumbel_sample(logits, torch.full((n,), temp, device="cuda"), seed_tensor(5, "cuda"))
    check_distribution(samples, row, temp, alt_factor=10.0)


@pytest.mark.gpu
@requires_cuda
def test_gpu_distribution_full_vocab():
    """8 likely tokens spread over Qwen3's vocabulary (other blocks, sub-blocks, the last
    partial block), the rest at -20: 80 steps x 256 rows."""
    ids = torch.tensor([5, 1500, 4100, 30000, 70001, 100000, 151900, 151935])
    row = torch.full((VOCAB,), -20.0)
    row[ids] = ROW8
    row = row.to(torch.bfloat16)
    temp = 0.6
    logits = row.expand(256, VOCAB).contiguous().cuda()
    t = torch.full((256,), temp, device="cuda")
    samples = torch.cat([gumbel_sample(logits, t, seed_tensor(s, "cuda")) for s in range(80)]).cpu()
    assert torch.isin(samples, ids).all()
    as_category = (samples.unsqueeze(1) == ids).int().argmax(1)
    check_distribution(as_category, ROW8.to(torch.bfloat16).float(), temp, alt_factor=10.0)


@pytest.mark.gpu
@requires_cuda
def test_gpu_sampler_seam_and_torch_path_agree_in_distribution(monkeypatch):
    """Sampler on CUDA: the fused path is taken for temperature-only batches, and its
    samples and the torch path's (USE_FUSED_SAMPLING off) follow the same distribution."""
    import vllm_anatomy.model_executor.sampler as sampler_mod
    monkeypatch.setattr(sampler_mod, "USE_FUSED_SAMPLING", True)
    calls = []
    real = sampler_mod.fused_sample
    monkeypatch.setattr(sampler_mod, "fused_sample", lambda *a: calls.append(1) or real(*a))
    n, temp = 20480, 0.6
    torch.manual_seed(0)
    logits = ROW8.expand(n, 8).contiguous().to(torch.bfloat16).cuda()
    md = SamplingMetadata(temperature=torch.full((n,), temp, device="cuda"), all_greedy=False,
                          all_random=True, top_p=None, top_k=None, min_p=None, generators={},
                          max_num_logprobs=None)
    fused = sampler_mod.Sampler()(logits, md).sampled_token_ids
    assert calls == [1]
    monkeypatch.setattr(sampler_mod, "USE_FUSED_SAMPLING", False)
    torch_path = sampler_mod.Sampler()(logits, md).sampled_token_ids
    assert calls == [1]
    row = ROW8.to(torch.bfloat16).float()
    for samples in (fused, torch_path):
        check_distribution(samples, row, temp, alt_factor=10.0)
