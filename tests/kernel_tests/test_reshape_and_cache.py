"""reshape_and_cache (Triton) writes exactly what its torch reference writes, and nothing else."""
import pytest
import torch

from tests.kernel_tests.kernel_utils import DEVICE, DTYPES, requires_cuda
from vllm_anatomy.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref


def run_case(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, seed,
             num_pad=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    num_heads = 2 * num_kv_heads
    # K and V as views into one fused qkv output, as the model hands them over:
    # row stride (q + k + v) * head_dim, not num_kv_heads * head_dim.
    qkv = torch.randn(num_tokens + num_pad, (num_heads + 2 * num_kv_heads) * head_dim,
                      generator=gen).to(dtype).to(device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, q_size:q_size + kv_size].view(-1, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size:].view(-1, num_kv_heads, head_dim)
    # Distinct random slots for the real tokens, -1 scattered among them and
    # for the padding tail (a CUDA-graph-sized batch).
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens + num_pad]
    slots[torch.rand(num_tokens + num_pad, generator=gen) < 0.2] = -1
    slots[num_tokens:] = -1
    slots = slots.to(device)
    # The cache starts full of random values: untouched slots must keep them.
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                        generator=gen).to(dtype).to(device)
    expected = cache.clone()
    reshape_and_cache_ref(key, value, expected[0], expected[1], slots)
    reshape_and_cache(key, value, cache[0], cache[1], slots)
    return cache, expected, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (3, 64), (8, 128), (2, 96)])
def test_matches_reference(dtype, num_kv_heads, head_dim):
    cache, expected, slots = run_case(num_tokens=37, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                      block_size=16, num_blocks=6, dtype=dtype, seed=head_dim,
                                      num_pad=5)
    assert (slots == -1).any()
    assert torch.equal(cache, expected)


def test_slot_minus_one_writes_nothing():
    """Only padding: the cache must be bit-for-bit unchanged."""
    key = torch.randn(8, 2, 64, device=DEVICE)
    cache = torch.randn(2, 3, 16, 2, 64, device=DEVICE)
    before = cache.clone()
    reshape_and_cache(key, key, cache[0], cache[1], torch.full((8,), -1, device=DEVICE))
    assert torch.equal(cache, before)


def test_slot_mapping_longer_than_tokens():
    """slot_mapping padded past T (the runner's persistent buffer): only T slots are read."""
    key = torch.randn(3, 1, 64, device=DEVICE)
    value = torch.randn(3, 1, 64, device=DEVICE)
    cache = torch.zeros(2, 2, 16, 1, 64, device=DEVICE)
    slots = torch.tensor([17, 0, 31, 5, 6, 7], device=DEVICE)     # 5, 6, 7: beyond T, ignored
    reshape_and_cache(key, value, cache[0], cache[1], slots)
    flat = cache.flatten(1, 2)                                    # [2, 32 slots, 1, 64]
    assert torch.equal(flat[0, [17, 0, 31]], key) and torch.equal(flat[1, [17, 0, 31]], value)
    assert flat[:, 5:8].abs().sum() == 0


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_large_gpu(dtype):
    cache, expected, _ = run_case(num_tokens=20000, num_kv_heads=8, head_dim=128, block_size=16,
                                  num_blocks=4000, dtype=dtype, seed=0, num_pad=300)
    assert torch.equal(cache, expected)
