"""The CPU attention backend (the fast path) equals the torch reference backend (the oracle).

Random mixed batches (prefill chunks with earlier context, decodes of different
lengths, fresh prefills, padding tokens) go through both backends' contract —
write the step's K/V into a paged cache with shuffled blocks, then attend
reading from it — in two steps (context first, then the new tokens); the
caches must be identical and the outputs equal to fp32 rounding.
"""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import build_attn_metadata
from vllm_anatomy.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionImpl
from vllm_anatomy.attention.backends.torch_ref import TorchReferenceBackend, TorchReferenceImpl
from vllm_anatomy.attention.selector import get_attn_backend

HEAD_DIM = 8


def run_both(requests, num_heads, num_kv_heads, block_size, num_padding=0, seed=0):
    """requests: [(context_len, query_len)] -> ((out, kv_cache) reference, (out, kv_cache) cpu)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in requests) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for context_len, query_len in requests:
        seq_len = context_len + query_len
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        seqs.append((context_len, query_len, blocks,
                     torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen),
                     torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen),
                     torch.randn(query_len, num_heads, HEAD_DIM, generator=gen)))
    steps = []
    with_context = [s for s in seqs if s[0] > 0]
    if with_context:      # an earlier step: each request's context, as one prefill each
        ctx = [s[0] for s in with_context]
        _, meta = build_attn_metadata(ctx, ctx, [s[2] for s in with_context], block_size)
        steps.append((torch.cat([s[5][:1].expand(s[0], -1, -1) for s in with_context]),
                      torch.cat([s[3][:s[0]] for s in with_context]),
                      torch.cat([s[4][:s[0]] for s in with_context]), meta))
    num_tokens = sum(q for _, q in requests)
    _, meta = build_attn_metadata([s[1] for s in seqs], [s[0] + s[1] for s in seqs],
                                  [s[2] for s in seqs], block_size,
                                  num_padded_tokens=num_tokens + num_padding)
    garbage = torch.full((num_padding, num_kv_heads, HEAD_DIM), 1e4)
    steps.append((torch.cat([s[5] for s in seqs] + [torch.full((num_padding, num_heads, HEAD_DIM), 1e4)]),
                  torch.cat([s[3][s[0]:] for s in seqs] + [garbage]),
                  torch.cat([s[4][s[0]:] for s in seqs] + [garbage]), meta))
    results = []
    for impl_cls, backend in ((TorchReferenceImpl, TorchReferenceBackend), (CPUAttentionImpl, CPUAttentionBackend)):
        impl = impl_cls(num_heads, HEAD_DIM, num_kv_heads, scale=HEAD_DIM ** -0.5)
        kv_cache = torch.zeros(backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, HEAD_DIM))
        for query, key, value, step_meta in steps:
            impl.do_kv_cache_update(key, value, kv_cache, step_meta.slot_mapping)
            out = impl.forward(query, kv_cache, step_meta, torch.empty_like(query))
        results.append((out, kv_cache))
    return results


@pytest.mark.parametrize("requests,block_size", [
    ([(0, 5)], 4),                               # one fresh prefill, partial last block
    ([(16, 1)], 16),                             # one decode (the single-stream step)
    ([(16, 1), (3, 1), (40, 1)], 16),            # decodes of different lengths: masked keys
    ([(7, 9), (30, 1), (0, 3), (12, 1)], 4),     # chunk with context + decodes + fresh prefill
    ([(33, 14), (1, 1), (5, 1)], 16),            # chunk crossing block boundaries
])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (4, 1)])
def test_matches_reference(requests, block_size, num_heads, num_kv_heads):
    (ref, ref_cache), (out, cache) = run_both(requests, num_heads, num_kv_heads, block_size)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=5),
       block_size=st.sampled_from([1, 2, 4, 16]),
       heads=st.sampled_from([(1, 1), (4, 2), (3, 1), (8, 4)]),
       num_padding=st.integers(0, 3),
       seed=st.integers(0, 2 ** 16))
def test_random_mixed_batches(requests, block_size, heads, num_padding, seed):
    (ref, ref_cache), (out, cache) = run_both(requests, *heads, block_size, num_padding, seed)
    assert torch.equal(cache, ref_cache), "the padding tokens' K/V (1e4) must not reach the cache"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[out.shape[0] - num_padding:] == 0), "padding rows must stay zero"


def test_selector():
    assert get_attn_backend("cpu") is CPUAttentionBackend


def test_engine_args_select_the_cpu_backend_on_cpu_only():
    from vllm_anatomy.engine.arg_utils import EngineArgs
    assert EngineArgs(attention_backend="cpu")._resolve_attention_backend("cpu") == "cpu"
    assert EngineArgs()._resolve_attention_backend("cpu") == "cpu"            # auto: each device's fast path
    assert EngineArgs()._resolve_attention_backend("cuda:0") == "triton"
    assert EngineArgs(attention_backend="torch")._resolve_attention_backend("cpu") == "torch"
    with pytest.raises(ValueError, match="runs on the CPU"):
        EngineArgs(attention_backend="cpu")._resolve_attention_backend("cuda:0")
    with pytest.raises(ValueError, match="auto, torch, cpu or triton"):
        EngineArgs(attention_backend="flash")._resolve_attention_backend("cpu")
