"""prefill_attention (Triton) equals its torch reference and unified_attention on the same prefills.

Ragged varlen batches: several requests of different lengths, none a multiple
of the tiles, some of length 1; GQA ratios 1/2/4; head_dim 64/128. Rows of
tokens the kernel must not write (other requests', padding) start as NaN, so
a stray write or a missed row shows up. In the interpreter the kernel upcasts
to fp32 after its loads (kernel_utils' pattern), so bf16 results may differ
from the reference only in the final rounding.
"""
import pytest
import torch

from tests.kernel_tests.kernel_utils import (DEVICE, ON_GPU, assert_close_ulp, block_tables_for,
                                             rel_err)
from vllm_anatomy.kernels.prefill_attention import (block_q_of, context_attention_fwd,
                                                    prefill_attention_ref, prefill_work_list)
from vllm_anatomy.kernels.reshape_and_cache import reshape_and_cache_ref
from vllm_anatomy.kernels.unified_attention import unified_attention

RAGGED = [37, 1, 62, 45, 1, 19]        # query lengths of one step's fresh prefills


def make_prefills(lens, num_heads, num_kv_heads, head_dim, dtype, seed=0, pad=3, kv_from_qkv=False):
    """q/k/v of a step whose requests are the fresh prefills `lens` (+ `pad` padding tokens).

    kv_from_qkv: q, k and v are views into one [T, (nh + 2 nkv) * hd] tensor, as
    the model's qkv projection hands them over (token strides != head count * hd)."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lens) + pad
    # NOTE: scaled up so that softmax is peaked, not nearly uniform (a uniform
    # softmax forgives wrong masks and wrong keys).
    if kv_from_qkv:
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
        qkv[:, :num_heads * head_dim] *= 2.0
        qkv = qkv.to(dtype).to(DEVICE)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = v.view(num_tokens, num_kv_heads, head_dim)
    else:
        q = (2.0 * torch.randn(num_tokens, num_heads, head_dim, generator=gen)).to(dtype).to(DEVICE)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return q, k, v, starts


def check(out, ref, dtype):
    assert torch.equal(out.isnan(), ref.isnan()), "rows written that must not be, or missed"
    written = ~ref.isnan()
    o, r = out[written], ref[written]
    if dtype == torch.float32:
        torch.testing.assert_close(o, r, atol=2e-5, rtol=2e-5)
    elif not ON_GPU:
        assert_close_ulp(o, r, ulps=1)
    else:
        assert rel_err(o, r) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


def run(lens, num_heads, num_kv_heads, head_dim, dtype, seed=0, **config):
    q, k, v, starts = make_prefills(lens, num_heads, num_kv_heads, head_dim, dtype, seed=seed)
    scale = head_dim ** -0.5
    out = context_attention_fwd(q, k, v, torch.full_like(q, float("nan")), starts, lens, scale, **config)
    ref = prefill_attention_ref(q, k, v, starts, lens, scale, out=torch.full_like(q, float("nan")))
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_queries_per_kv,head_dim", [(1, 64), (2, 128), (4, 64)])
def test_ragged_batch_matches_reference(dtype, num_queries_per_kv, head_dim):
    out, ref = run(RAGGED, 2 * num_queries_per_kv, 2, head_dim, dtype, seed=head_dim + num_queries_per_kv)
    check(out, ref, dtype)


@pytest.mark.parametrize("variant", [dict(pack_gqa=True), dict(use_tma=True), dict(warp_specialize=True),
                                     dict(block_m=16, block_n=16), dict(block_m=32, block_n=16),
                                     dict(block_m=16, block_n=32, pack_gqa=True)],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_variants_match_reference(variant):
    """Every switch computes the same: GQA packing, TMA descriptors, warp
    specialisation, and tiles small enough that blocks span many key tiles with
    the diagonal inside tiles (BLOCK_N < BLOCK_M and > BLOCK_M)."""
    out, ref = run(RAGGED + [70], 8, 2, 64, torch.float32, seed=3, **variant)
    check(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qkv_views_and_pack_gqa_bf16(dtype):
    """K/V as strided views of one qkv tensor (what the model passes), packed GQA."""
    lens = [33, 1, 20]
    q, k, v, starts = make_prefills(lens, 8, 2, 128, dtype, seed=9, kv_from_qkv=True)
    assert k.stride(0) == (8 + 4) * 128
    out = context_attention_fwd(q, k, v, torch.full_like(q, float("nan")), starts, lens, 128 ** -0.5,
                                pack_gqa=True)
    ref = prefill_attention_ref(q, k, v, starts, lens, 128 ** -0.5, out=torch.full_like(q, float("nan")))
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_queries_per_kv,head_dim", [(2, 128), (4, 64)])
def test_matches_unified_attention(dtype, num_queries_per_kv, head_dim):
    """The same prefills through the paged cache (shuffled blocks, NaN in unused
    slots) and unified_attention: the two kernels agree."""
    lens, block_size = [37, 1, 50, 16], 16
    num_kv_heads = 2
    q, k, v, starts = make_prefills(lens, num_queries_per_kv * num_kv_heads, num_kv_heads, head_dim, dtype,
                                    seed=5, pad=0)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    block_table = block_tables_for(lens, block_size, num_blocks, max(-(-n // block_size) for n in lens) + 1,
                                   seed=5)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    for i, (start, n) in enumerate(zip(starts, lens)):
        slots = torch.tensor([int(block_table[i, p // block_size]) * block_size + p % block_size
                              for p in range(n)])
        reshape_and_cache_ref(k[start:start + n].cpu(), v[start:start + n].cpu(), cache[0], cache[1], slots)
    cache, block_table = cache.to(DEVICE), block_table.to(DEVICE)
    qsl = torch.tensor([0] + [s + n for s, n in zip(starts, lens)], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    unified = unified_attention(q, cache[0], cache[1], torch.full_like(q, float("nan")), qsl, max(lens),
                                seq_lens, max(lens), scale, block_table)
    prefill = context_attention_fwd(q, k, v, torch.full_like(q, float("nan")), starts, lens, scale)
    check(prefill, unified, dtype)
    check(prefill, prefill_attention_ref(q, k, v, starts, lens, scale), dtype)


def test_subset_of_requests_leaves_other_rows_alone():
    """The backend hands over only the fresh prefills of a mixed step: the rows
    of the other requests (here the 2nd and 4th) stay as they were."""
    lens = [20, 5, 31, 1, 9]
    q, k, v, starts = make_prefills(lens, 4, 2, 64, torch.float32, seed=2)
    chosen = [0, 2, 4]
    sub_starts, sub_lens = [starts[i] for i in chosen], [lens[i] for i in chosen]
    work_list = prefill_work_list(sub_starts, sub_lens, block_q=32).to(DEVICE)
    out = context_attention_fwd(q, k, v, torch.full_like(q, float("nan")), None, None, 0.125,
                                work_list=work_list)
    ref = prefill_attention_ref(q, k, v, sub_starts, sub_lens, 0.125, out=torch.full_like(q, float("nan")))
    check(out, ref, torch.float32)
    assert out[starts[1]:starts[1] + 5].isnan().all() and out[starts[3]].isnan().all()


def test_work_list_heaviest_first():
    work = prefill_work_list([0, 300, 310], [300, 10, 129], block_q=128).tolist()
    # request 0: blocks 0..2 (128, 256, 300 keys); request 1: one block of 10; request 2: 128, 129.
    assert work == [[0, 300, 2], [0, 300, 1], [310, 129, 1], [0, 300, 0], [310, 129, 0], [300, 10, 0]]
    assert prefill_work_list([], [], 64).shape == (0, 3)
    assert block_q_of(128, 4, pack_gqa=True) == 32 and block_q_of(128, 4, pack_gqa=False) == 128
    with pytest.raises(ValueError, match="divisible"):
        block_q_of(128, 3, pack_gqa=True)


def test_bad_input_is_refused_clearly():
    q, k, v, starts = make_prefills([4], 3, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        context_attention_fwd(q, k, v, torch.empty_like(q), starts, [4], 0.1)
    q, k, v, starts = make_prefills([4], 2, 2, 96, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        context_attention_fwd(q, k, v, torch.empty_like(q), starts, [4], 0.1)
    q, k, v, starts = make_prefills([4], 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="work_list"):
        context_attention_fwd(q, k, v, torch.empty_like(q), None, None, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sdpa_prefill_attention_matches_reference(dtype):
    """kernels/prefill_attention_sdpa.py (VLLM_ANATOMY_PREFILL_KERNEL=cudnn's long prompts; on
    a CPU whatever SDPA picks): on the model's qkv views, GQA 4:1, the requests it is handed
    equal the reference and every other row is left alone."""
    from vllm_anatomy.kernels.prefill_attention_sdpa import sdpa_prefill_attention, sdpa_takes
    if not sdpa_takes(dtype, 64, torch.device(DEVICE)):
        pytest.skip("cuDNN takes fp16/bf16 only (the backend never sends it fp32: sdpa_takes)")
    q, k, v, starts = make_prefills(RAGGED, 8, 2, 64, dtype, seed=5, kv_from_qkv=True)
    chosen = [0, 2, 3]                                   # 37, 62 and 45 tokens
    sub = [(starts[i], RAGGED[i]) for i in chosen]
    out = sdpa_prefill_attention(q, k, v, torch.full_like(q, float("nan")), sub, 0.125)
    ref = prefill_attention_ref(q, k, v, [s for s, _ in sub], [n for _, n in sub], 0.125,
                                out=torch.full_like(q, float("nan")))
    assert torch.equal(out.isnan(), ref.isnan()), "rows written that must not be, or missed"
    written = ~ref.isnan()
    if dtype == torch.float32:
        torch.testing.assert_close(out[written], ref[written], atol=2e-5, rtol=2e-5)
    else:                # SDPA multiplies in bf16, on a CPU as on a GPU: bf16's epsilon
        assert rel_err(out[written], ref[written]) < 1e-2
    with pytest.raises(ValueError, match="multiple"):
        sdpa_prefill_attention(q[:, :3], k, v, torch.empty_like(q[:, :3]), sub, 0.1)
