"""unified_attention (Triton) equals its torch reference and the torch backend (the oracle).

Every batch mixes fresh prefills, chunks continuing cached context and decodes;
lengths are not multiples of the block size; blocks are shuffled; unused cache
slots and the output hold NaN, so a read of a slot the kernel must not see, or
an element it fails to write, shows up.
"""
import pytest
import torch

from tests.helpers import build_attn_metadata
from tests.kernel_tests.kernel_utils import (DEVICE, DTYPES, ON_GPU, assert_close_ulp,
                                        block_tables_for, rel_err, requires_cuda)
from vllm_anatomy.attention.backends.torch_ref import TorchReferenceImpl
from vllm_anatomy.attention.selector import get_attn_backend
from vllm_anatomy.kernels.reshape_and_cache import reshape_and_cache_ref
from vllm_anatomy.kernels.unified_attention import unified_attention, unified_attention_ref

MIXED = [(0, 17), (35, 1), (20, 13), (0, 1), (47, 1), (16, 16)]   # (context_len, query_len)


def make_batch(requests, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0,
               device=DEVICE):
    """Random q and a paged cache holding every request's K/V; unused slots NaN."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in requests]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    width = max(-(-s // block_size) for s in seq_lens) + 2
    block_table = block_tables_for(seq_lens, block_size, num_blocks, width, seed)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                       dtype=dtype)
    for i, seq_len in enumerate(seq_lens):
        kv = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([int(block_table[i, p // block_size]) * block_size + p % block_size
                              for p in range(seq_len)])
        reshape_and_cache_ref(kv[0], kv[1], cache[0], cache[1], slots)
    num_tokens = sum(q for _, q in requests)
    # NOTE: scaled up so that softmax is peaked, not nearly uniform (a uniform
    # softmax forgives wrong masks and wrong keys).
    q = (2.0 * torch.randn(num_tokens, num_heads, head_dim, generator=gen)).to(dtype)
    qsl = torch.tensor([0] + [sum(q for _, q in requests[:i + 1]) for i in range(len(requests))],
                       dtype=torch.int32)
    return (q.to(device), cache.to(device), block_table.to(device), qsl.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


def run(requests, num_heads, num_kv_heads, head_dim, dtype, seed=0, device=DEVICE, **config):
    q, cache, block_table, qsl, seq_lens = make_batch(requests, num_heads, num_kv_heads,
                                                      head_dim, dtype, seed=seed, device=device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    unified_attention(q, cache[0], cache[1], out, qsl, max(ql for _, ql in requests), seq_lens,
                      int(seq_lens.max()), scale, block_table, **config)
    ref = unified_attention_ref(q, cache[0], cache[1], qsl, seq_lens, scale, block_table)
    return out, ref


def check(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    elif not ON_GPU:
        # The interpreter path computes in fp32 (bf16 arithmetic is wrong
        # there): only the final rounding may differ.
        assert_close_ulp(out, ref, ulps=1)
    else:
        # On the GPU the dots take bf16/fp16 operands (P is rounded to the
        # value dtype): errors of that dtype's epsilon, not of one rounding.
        assert not out.isnan().any()
        assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_queries_per_kv,head_dim", [(1, 64), (3, 128), (8, 64), (8, 128)])
def test_mixed_batch(dtype, num_queries_per_kv, head_dim):
    num_kv_heads = 2 if num_queries_per_kv < 8 else 1      # keeps the interpreter's grid small
    out, ref = run(MIXED, num_queries_per_kv * num_kv_heads, num_kv_heads, head_dim, dtype,
                   seed=head_dim + num_queries_per_kv)
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_blocks_many_tiles(dtype):
    """16-row programs and 16-key tiles: a prefill spans many q blocks, each many
    KV tiles, and the causal edge falls inside tiles and across block boundaries."""
    out, ref = run(MIXED + [(5, 40)], 6, 2, 64, dtype, seed=7, block_m=16, tile_size=16)
    check(out, ref, dtype)


@pytest.mark.parametrize("num_queries_per_kv", [1, 3, 8])
def test_decode_only(num_queries_per_kv):
    """Pure decode batch (the decode config: 16 rows, 2..16 of them real)."""
    requests = [(c, 1) for c in (0, 15, 16, 33, 70)]
    out, ref = run(requests, 2 * num_queries_per_kv, 2, 128, torch.float16, seed=11)
    check(out, ref, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_matches_torch_oracle(dtype):
    """The Triton backend and the torch backend, through the common interface,
    on a padded batch: same cache after the write, same output (padding rows zero)."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    seq_lens = [c + q for c, q in MIXED]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    block_table = block_tables_for(seq_lens, block_size, num_blocks,
                                   max(-(-s // block_size) for s in seq_lens), seed=5)
    caches, outs = [], []
    for backend in ("torch", "triton"):
        impl = get_attn_backend(backend).get_impl_cls()(num_heads, head_dim, num_kv_heads,
                                                         head_dim ** -0.5)
        assert isinstance(impl, TorchReferenceImpl) == (backend == "torch")
        cache = torch.zeros(get_attn_backend(backend).get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=DEVICE)
        # Step 1 writes every request's context; step 2 is the mixed batch + 3 padding tokens.
        ctx = [(c, i) for i, (c, _) in enumerate(MIXED) if c > 0]
        _, meta1 = build_attn_metadata([c for c, _ in ctx], [c for c, _ in ctx],
                                       [block_table[i].tolist() for _, i in ctx], block_size,
                                       device=DEVICE)
        _, meta2 = build_attn_metadata([q for _, q in MIXED], seq_lens, block_table.tolist(),
                                       block_size, num_padded_tokens=sum(q for _, q in MIXED) + 3,
                                       device=DEVICE)
        torch.manual_seed(5)
        k1 = torch.randn(meta1.num_actual_tokens, num_kv_heads, head_dim).to(dtype).to(DEVICE)
        v1 = torch.randn_like(k1)
        num_padded = meta2.slot_mapping.numel()
        k2 = torch.randn(num_padded, num_kv_heads, head_dim).to(dtype).to(DEVICE)
        v2 = torch.randn_like(k2)
        query = (2 * torch.randn(num_padded, num_heads, head_dim)).to(dtype).to(DEVICE)
        impl.do_kv_cache_update(k1, v1, cache, meta1.slot_mapping)
        impl.do_kv_cache_update(k2, v2, cache, meta2.slot_mapping)
        outs.append(impl.forward(query, cache, meta2, torch.empty_like(query)))
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    assert (outs[1][-3:] == 0).all()
    check(outs[1], outs[0], dtype)


def test_rejects_cpu_without_interpreter():
    """A clear error, not a driver crash, when CPU tensors meet a compiled kernel."""
    if not ON_GPU:
        pytest.skip("interpreter active: CPU tensors are the supported case here")
    from vllm_anatomy.kernels import unified_attention as mod
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        q = torch.zeros(1, 1, 64)
        mod.unified_attention(q, torch.zeros(1, 16, 1, 64), torch.zeros(1, 16, 1, 64), q,
                              torch.tensor([0, 1], dtype=torch.int32), 1,
                              torch.tensor([1], dtype=torch.int32), 1, 1.0,
                              torch.zeros(1, 1, dtype=torch.int32))


# -- GPU: the same checks at serving sizes ------------------------------------------------

@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (16, 8, 128), (32, 4, 128)])
def test_large_mixed_gpu(dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 3000, (64,), generator=gen).tolist()
    requests = [(c, 1) for c in ctx] + [(0, 1500), (900, 700), (4000, 333), (17, 2048)]
    out, ref = run(requests, num_heads, num_kv_heads, head_dim, dtype, seed=1, device="cuda")
    check(out, ref, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("config", [dict(), dict(block_m=16, tile_size=32),
                                    dict(block_m=64, tile_size=128, num_warps=4)], ids=str)
def test_configs_gpu(config):
    """Every block shape the benchmark may pick computes the same function."""
    requests = [(c, 1) for c in range(0, 2000, 97)] + [(0, 1000), (333, 517)]
    out, ref = run(requests, 16, 8, 128, torch.bfloat16, seed=2, device="cuda", **config)
    check(out, ref, torch.bfloat16)



# -- Split-KV ("3D") decode ------------------------------------------------------------------

def segm_buffers(num_tokens, num_heads, num_segments, head_dim, device=DEVICE):
    """The 3D kernel's fp32 buffers, NaN-filled: a partial it reads but no program wrote shows up."""
    shape = (num_tokens, num_heads, num_segments)
    pad = max(16, 1 << (head_dim - 1).bit_length())
    nan = lambda s: torch.full(s, float("nan"), dtype=torch.float32, device=device)  # noqa: E731
    return dict(num_par_softmax_segments=num_segments, softmax_segm_output=nan(shape + (pad,)),
                softmax_segm_max=nan(shape), softmax_segm_expsum=nan(shape))


def run_2d_3d(requests, num_heads, num_kv_heads, head_dim, dtype, num_segments, seed=0,
              device=DEVICE, max_seqlen_q=None, threshold=1 << 20, **config):
    """Outputs of the 3D path, of the 2D path and of the torch reference; and whether 3D ran."""
    q, cache, block_table, qsl, seq_lens = make_batch(requests, num_heads, num_kv_heads, head_dim,
                                                      dtype, seed=seed, device=device)
    scale = head_dim ** -0.5
    max_q = max_seqlen_q or max(ql for _, ql in requests)
    segm = segm_buffers(q.shape[0], num_heads, num_segments, head_dim, device)
    out3, out2 = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    unified_attention(q, cache[0], cache[1], out3, qsl, max_q, seq_lens, int(seq_lens.max()), scale,
                      block_table, seq_threshold_3D=threshold, **segm, **config)
    unified_attention(q, cache[0], cache[1], out2, qsl, max_q, seq_lens, int(seq_lens.max()), scale,
                      block_table)
    ref = unified_attention_ref(q, cache[0], cache[1], qsl, seq_lens, scale, block_table)
    ran_3d = not segm["softmax_segm_max"].isnan().all()
    return out3, out2, ref, ran_3d


# Decode contexts against 4 segments of 16-key tiles (64 keys per segment round):
# shorter than one tile, one segment, not a multiple of the tile, exactly
# segments x tile, longer than segments x tile (several tiles per segment).
DECODE_CONTEXTS = [0, 5, 15, 16, 37, 63, 64, 100, 200, 257]


@pytest.mark.parametrize("num_seqs", [1, 2, 5, len(DECODE_CONTEXTS)])
@pytest.mark.parametrize("num_queries_per_kv", [1, 3, 8])
def test_split_kv_decode(num_seqs, num_queries_per_kv):
    """3D equals the reference and the 2D kernel (fp32: to rounding) for decode batches
    of 1..N sequences, contexts around and beyond segments x tile, with GQA."""
    contexts = DECODE_CONTEXTS[-num_seqs:] if num_seqs < 3 else DECODE_CONTEXTS[:num_seqs]
    requests = [(c, 1) for c in contexts]
    num_kv_heads = 2 if num_queries_per_kv < 8 else 1
    out3, out2, ref, ran_3d = run_2d_3d(requests, num_queries_per_kv * num_kv_heads, num_kv_heads,
                                        64, torch.float32, num_segments=4, tile_size=16,
                                        seed=num_seqs + num_queries_per_kv)
    assert ran_3d
    torch.testing.assert_close(out3, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out3, out2, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_split_kv_decode_16_segments(dtype):
    """vLLM's 16 segments and the default 3D tile, 16-bit caches, head_dim 128."""
    requests = [(c, 1) for c in (3, 70, 300, 600)]
    out3, out2, ref, ran_3d = run_2d_3d(requests, 4, 2, 128, dtype, num_segments=16, seed=4)
    assert ran_3d
    check(out3, ref, dtype)
    check(out3, out2, dtype)


def test_split_kv_exact_for_prefill_chunks():
    """Nothing in the 3D kernel assumes one query token: forced onto a mixed batch (by
    claiming max_seqlen_q 1, which the rule reads), segments the causal edge hides
    from some rows (L = 0) merge to the exact result."""
    out3, _, ref, ran_3d = run_2d_3d(MIXED, 6, 2, 64, torch.float32, num_segments=4,
                                     max_seqlen_q=1, tile_size=16, seed=9)
    assert ran_3d
    torch.testing.assert_close(out3, ref, atol=2e-5, rtol=2e-5)


def test_split_kv_only_for_small_decode_batches():
    """vLLM's rule: a batch with a prefill, or more decodes than the threshold, runs 2D
    (the buffers stay untouched)."""
    _, _, _, ran_3d = run_2d_3d(MIXED, 4, 2, 64, torch.float32, num_segments=4)
    assert not ran_3d
    decodes = [(c, 1) for c in (5, 40, 70)]
    _, _, _, ran_3d = run_2d_3d(decodes, 4, 2, 64, torch.float32, num_segments=4, threshold=2)
    assert not ran_3d
    _, _, _, ran_3d = run_2d_3d(decodes, 4, 2, 64, torch.float32, num_segments=4, threshold=3)
    assert ran_3d


def padded_decode_batch(contexts, num_heads, num_kv_heads, head_dim, pad, seed):
    """make_batch of decodes, padded as a CUDA-graph-sized batch: `pad` padding requests
    (query_len 0, seq_len 0, block 0) and tokens in no request."""
    q, cache, block_table, qsl, seq_lens = make_batch([(c, 1) for c in contexts], num_heads, num_kv_heads,
                                                      head_dim, torch.float32, seed=seed)
    q = torch.cat([q, torch.randn(pad, num_heads, head_dim, device=q.device)])
    qsl = torch.cat([qsl, qsl[-1:].repeat(pad)])
    seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(pad)])
    block_table = torch.cat([block_table, block_table.new_zeros(pad, block_table.shape[1])])
    return q, cache, block_table, qsl, seq_lens


def test_split_kv_graph_padding():
    """A decode batch padded to a CUDA-graph size: padding requests with query_len 0 and
    seq_len 0, padding tokens in no request. 3D leaves their rows alone, as 2D does."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    q, cache, block_table, qsl, seq_lens = padded_decode_batch((9, 40, 130), num_heads, num_kv_heads,
                                                               head_dim, pad=2, seed=2)
    scale = head_dim ** -0.5
    outs = []
    for segm in (segm_buffers(q.shape[0], num_heads, 4, head_dim), {}):
        out = torch.full_like(q, float("nan"))
        unified_attention(q, cache[0], cache[1], out, qsl, 1, seq_lens, 130, scale, block_table,
                          seq_threshold_3D=8, tile_size=16, **segm)
        outs.append(out)
    ref = unified_attention_ref(q[:3], cache[0], cache[1], qsl[:4], seq_lens[:3], scale, block_table[:3])
    torch.testing.assert_close(outs[0][:3], ref, atol=2e-5, rtol=2e-5)
    assert outs[0][3:].isnan().all() and outs[1][3:].isnan().all()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (16, 8, 128), (32, 4, 128)])
@pytest.mark.parametrize("num_seqs", [1, 4, 16])
def test_split_kv_decode_gpu(dtype, num_heads, num_kv_heads, head_dim, num_seqs):
    """3D at serving sizes: contexts up to 8k, uneven; against the reference and 2D."""
    gen = torch.Generator().manual_seed(num_seqs)
    ctx = torch.randint(0, 8192, (num_seqs,), generator=gen).tolist()
    ctx[0] = 8191 if num_seqs > 1 else 5000
    out3, out2, ref, ran_3d = run_2d_3d([(c, 1) for c in ctx], num_heads, num_kv_heads, head_dim,
                                        dtype, num_segments=16, seed=num_seqs, device="cuda")
    assert ran_3d
    check(out3, ref, dtype)
    assert rel_err(out3, out2) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_segments,tile_size", [(8, 16), (16, 32), (32, 64), (16, 64)], ids=str)
def test_split_kv_configs_gpu(num_segments, tile_size):
    """Every (segments, tile) the decode sweep of bench/kernel_bench.py times computes the same function."""
    requests = [(c, 1) for c in (0, 15, 100, 1023, 2047, 4000, 8191)]
    out3, _, ref, ran_3d = run_2d_3d(requests, 16, 8, 128, torch.bfloat16, num_segments=num_segments,
                                     seed=3, device="cuda", tile_size=tile_size)
    assert ran_3d
    check(out3, ref, torch.bfloat16)
