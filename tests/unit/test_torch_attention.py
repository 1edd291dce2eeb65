"""The torch reference paged attention equals dense causal attention.

For random mixed batches (prefill chunks with earlier context, decodes, fresh
prefills), K/V are written into a paged cache with shuffled blocks, the
backend reads them back through block_table, and the result must equal
PyTorch's scaled_dot_product_attention over the same sequences laid out
densely (an implementation that shares no code with ours).
"""
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import build_attn_metadata
from vllm_anatomy.attention.backends.torch_ref import TorchReferenceBackend, TorchReferenceImpl
from vllm_anatomy.attention.layer import Attention
from vllm_anatomy.attention.selector import get_attn_backend

HEAD_DIM = 8


def dense_causal_attention(q, k, v, context_len, scale):
    """q [q_len, nh, hd], k/v [seq_len, nkv, hd]: query j sees keys 0 .. context_len + j."""
    q_len, seq_len = q.shape[0], k.shape[0]
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=context_len)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)                                   # [q_len, nh, hd]


def run_paged_batch(requests, num_heads, num_kv_heads, block_size, num_padding=0, seed=0):
    """requests: [(context_len, query_len)]. Returns (paged output, dense output, kv_cache)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in requests) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    impl = TorchReferenceImpl(num_heads, HEAD_DIM, num_kv_heads, scale=HEAD_DIM ** -0.5)
    kv_cache = torch.zeros(TorchReferenceBackend.get_kv_cache_shape(
        num_blocks, block_size, num_kv_heads, HEAD_DIM))

    seqs = []   # per request: full K, V and the new queries
    for context_len, query_len in requests:
        seq_len = context_len + query_len
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        q = torch.randn(query_len, num_heads, HEAD_DIM, generator=gen)
        seqs.append((context_len, query_len, blocks, k, v, q))

    # An earlier step computed every request's context: write its K/V first.
    with_context = [s for s in seqs if s[0] > 0]
    if with_context:
        _, ctx_meta = build_attn_metadata([s[0] for s in with_context], [s[0] for s in with_context],
                                          [s[2] for s in with_context], block_size)
        impl.do_kv_cache_update(torch.cat([s[3][:s[0]] for s in with_context]),
                                torch.cat([s[4][:s[0]] for s in with_context]),
                                kv_cache, ctx_meta.slot_mapping)

    # This step: the new tokens of every request, plus padding tokens whose
    # (garbage) K/V must not land anywhere in the cache.
    num_tokens = sum(q for _, q in requests)
    _, meta = build_attn_metadata([s[1] for s in seqs], [s[0] + s[1] for s in seqs],
                                  [s[2] for s in seqs], block_size,
                                  num_padded_tokens=num_tokens + num_padding)
    garbage = torch.full((num_padding, num_kv_heads, HEAD_DIM), 1e4)
    new_k = torch.cat([s[3][s[0]:] for s in seqs] + [garbage])
    new_v = torch.cat([s[4][s[0]:] for s in seqs] + [garbage])
    query = torch.cat([s[5] for s in seqs] + [torch.full((num_padding, num_heads, HEAD_DIM), 1e4)])
    impl.do_kv_cache_update(new_k, new_v, kv_cache, meta.slot_mapping)
    out = impl.forward(query, kv_cache, meta, torch.empty_like(query))

    dense = torch.cat([dense_causal_attention(q, k, v, c, impl.scale) for c, _, _, k, v, q in seqs])
    return out, dense, kv_cache


@pytest.mark.parametrize("requests,block_size", [
    ([(0, 5)], 4),                               # one fresh prefill, partial last block
    ([(0, 16)], 16),                             # exactly one full block
    ([(16, 1)], 16),                             # decode that opens a new block
    ([(15, 1)], 16),                             # decode that fills the last slot of a block
    ([(7, 9), (30, 1), (0, 3), (12, 1)], 4),     # chunk with context + decodes + fresh prefill
    ([(33, 14), (1, 1), (5, 1)], 16),            # chunk crossing block boundaries
])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (4, 1)])
def test_matches_dense_causal_attention(requests, block_size, num_heads, num_kv_heads):
    out, dense, _ = run_paged_batch(requests, num_heads, num_kv_heads, block_size)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=5),
       block_size=st.sampled_from([1, 2, 4, 16]),
       heads=st.sampled_from([(1, 1), (4, 2), (3, 1), (8, 4)]),
       num_padding=st.integers(0, 3),
       seed=st.integers(0, 2 ** 16))
def test_random_mixed_batches(requests, block_size, heads, num_padding, seed):
    num_heads, num_kv_heads = heads
    out, dense, _ = run_paged_batch(requests, num_heads, num_kv_heads, block_size, num_padding, seed)
    num_tokens = dense.shape[0]
    torch.testing.assert_close(out[:num_tokens], dense, atol=1e-5, rtol=1e-5)
    assert torch.all(out[num_tokens:] == 0), "padding rows must stay zero"


def test_padding_slots_are_not_written():
    # Three padding tokens with slot -1: if -1 were used as an index it would
    # write the *last* slot of the cache (block num_blocks-1, offset block_size-1).
    out, dense, kv_cache = run_paged_batch([(3, 2), (0, 4)], 4, 2, block_size=4, num_padding=3)
    assert kv_cache.abs().max() < 1e3, "a padding token's K/V (1e4) reached the cache"
    assert torch.all(kv_cache[:, -1, -1] == 0)
    torch.testing.assert_close(out[:6], dense, atol=1e-5, rtol=1e-5)


def test_slot_layout_matches_block_table():
    """slot = block_table[req, pos // block_size] * block_size + pos % block_size."""
    impl = TorchReferenceImpl(2, HEAD_DIM, 1, scale=1.0)
    block_size, blocks = 4, [5, 2]
    kv_cache = torch.zeros(TorchReferenceBackend.get_kv_cache_shape(8, block_size, 1, HEAD_DIM))
    _, meta = build_attn_metadata([6], [6], [blocks], block_size)
    key = torch.arange(6.0)[:, None, None].expand(6, 1, HEAD_DIM)      # key of position p == p
    impl.do_kv_cache_update(key, -key, kv_cache, meta.slot_mapping)
    assert kv_cache[0, 5, :, 0, 0].tolist() == [0, 1, 2, 3]             # positions 0-3 -> block 5
    assert kv_cache[0, 2, :2, 0, 0].tolist() == [4, 5]                   # positions 4-5 -> block 2
    assert kv_cache[1, 2, :2, 0, 0].tolist() == [-4, -5]                 # values beside the keys
    assert kv_cache[:, [0, 1, 3, 4, 6, 7]].abs().sum() == 0             # other blocks untouched


def test_attention_layer_reshapes_and_writes_cache():
    layer = Attention(num_heads=4, head_size=HEAD_DIM, scale=HEAD_DIM ** -0.5, num_kv_heads=2,
                      attn_backend=get_attn_backend("torch"))
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4 * HEAD_DIM, generator=gen)
    k = torch.randn(5, 2 * HEAD_DIM, generator=gen)
    v = torch.randn(5, 2 * HEAD_DIM, generator=gen)
    kv_cache = torch.zeros(TorchReferenceBackend.get_kv_cache_shape(4, 4, 2, HEAD_DIM))
    _, meta = build_attn_metadata([5], [5], [[3, 1]], block_size=4)
    out = layer(q, k, v, kv_cache, meta)
    assert out.shape == (5, 4 * HEAD_DIM)
    dense = dense_causal_attention(q.view(5, 4, HEAD_DIM), k.view(5, 2, HEAD_DIM),
                                   v.view(5, 2, HEAD_DIM), 0, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out, dense.reshape(5, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_cache[0, 3], k[:4].view(4, 2, HEAD_DIM))
    # A dummy run (no metadata, no cache yet) returns zeros and touches nothing.
    assert torch.all(layer(q, k, v, None, None) == 0)


def test_selector():
    assert get_attn_backend("torch") is TorchReferenceBackend
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attn_backend("flash")
