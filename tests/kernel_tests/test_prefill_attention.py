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
from vllm_anatomy.kernels.prefill_attention import (block_q_of, context_attention_fwd, host_descriptors,
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


@pytest.mark.parametrize("variant", [dict(pack_gqa=True), dict(tma="device"), dict(tma="host"),
                                     dict(warp_specialize=True), dict(fold_scale=True),
                                     dict(tma="host", fold_scale=True, warp_specialize=True),
                                     dict(tma="host", pack_gqa=True),
                                     dict(tma="host", block_m=16, block_n=32),
                                     dict(block_m=16, block_n=16), dict(block_m=32, block_n=16),
                                     dict(block_m=16, block_n=32, pack_gqa=True)],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_variants_match_reference(variant):
    """Every switch computes the same: GQA packing, TMA through device- or host-side
    descriptors, warp specialisation, the folded softmax scale, and tiles small enough
    that blocks span many key tiles with the diagonal inside tiles (BLOCK_N < BLOCK_M
    and > BLOCK_M)."""
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


HOLE_LENS = [37, 5, 62, 9, 45, 3]      # odd requests are holes: not handed over, their K/V poisoned


@pytest.mark.parametrize("variant", [dict(tma="host"), dict(tma="host", fold_scale=True),
                                     dict(tma="host", pack_gqa=True), dict(tma="host", block_m=32, block_n=16),
                                     dict(tma="device"), dict(tma="off")],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_reads_past_a_request_end_never_leak(variant):
    """Host descriptors span the whole step, so a request's last tiles read the rows after
    its end (the next request's, or padding). Here those rows are holes (requests not handed
    over) and padding whose K and V are NaN; the requests are back to back in a fused qkv
    tensor (row stride > a K row), GQA 4:1, no length a multiple of a tile. Any key past a
    query's position that got weight (a dropped causal mask), or a V row past the end that
    reached the dot (0 * NaN), turns that request's rows NaN; every row must equal the
    reference, and the holes must stay unwritten."""
    q, k, v, starts = make_prefills(HOLE_LENS, 8, 2, 64, torch.float32, seed=11, pad=7, kv_from_qkv=True)
    assert k.stride(0) > k.shape[1] * k.shape[2]                      # K/V are slices of the qkv rows
    chosen = [0, 2, 4]
    sub_starts, sub_lens = [starts[i] for i in chosen], [HOLE_LENS[i] for i in chosen]
    poisoned = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    for start, n in zip(sub_starts, sub_lens):
        poisoned[start:start + n] = False
    k[poisoned], v[poisoned] = float("nan"), float("nan")                 # holes and the 7 padding rows
    # The data is sensitive to a leak: the last request's last block sees the padding rows in
    # its final tile (45 tokens: a tile of 16 or 32 keys runs past its end).
    assert all(n % 16 for n in sub_lens)
    out = context_attention_fwd(q, k, v, torch.full_like(q, float("nan")), sub_starts, sub_lens, 0.125,
                                **variant)
    ref = prefill_attention_ref(q, k, v, sub_starts, sub_lens, 0.125, out=torch.full_like(q, float("nan")))
    assert not ref[~poisoned].isnan().any()
    check(out, ref, torch.float32)
    assert out[poisoned].isnan().all()


def test_reference_is_sensitive_to_keys_past_the_diagonal():
    """Guards the test above from passing vacuously: the same prefills with each query also
    seeing the rest of its tile (what a dropped mask would compute) differ from the causal
    result by far more than the tolerance."""
    lens = [37, 62]
    q, k, v, starts = make_prefills(lens, 4, 2, 64, torch.float32, seed=12, pad=0)
    causal = prefill_attention_ref(q, k, v, starts, lens, 0.125)
    # Non-causal within each request: what a kernel ignoring key_pos <= query_pos would give.
    leaked = torch.zeros_like(q)
    for start, n in zip(starts, lens):
        rows = slice(start, start + n)
        kk = k[rows].repeat_interleave(2, dim=1)
        vv = v[rows].repeat_interleave(2, dim=1)
        probs = (torch.einsum("qhd,khd->hqk", q[rows], kk) * 0.125).softmax(-1)
        leaked[rows] = torch.einsum("hqk,khd->qhd", probs, vv)
    assert (leaked - causal).abs().max() > 0.1


def test_host_descriptors_span_the_step_and_refuse_bad_rows():
    """host_descriptors: one descriptor per tensor over [tokens, heads * head_dim] with the
    token stride of the fused qkv rows; tiles of one head. Unaligned rows, a misaligned base
    and heads not side by side are refused with a clear error, before any launch."""
    q, k, v, starts = make_prefills([37, 20], 8, 2, 64, torch.float32, seed=4, pad=3, kv_from_qkv=True)
    q_desc, k_desc, v_desc = host_descriptors(q, k, v, block_m=32, block_n=16, load_q=True)
    row = (8 + 2 * 2) * 64
    assert list(k_desc.shape) == [60, 2 * 64] and list(k_desc.strides) == [row, 1]
    assert list(k_desc.block_shape) == [16, 64] and list(v_desc.block_shape) == [16, 64]
    assert list(q_desc.shape) == [60, 8 * 64] and list(q_desc.block_shape) == [32, 64]
    assert k_desc.base.data_ptr() == k.data_ptr() and v_desc.base.data_ptr() == v.data_ptr()
    assert host_descriptors(q, k, v, 32, 16, load_q=False)[0] is q     # pack_gqa: Q by pointers
    lens = [4]
    odd = torch.randn(4, 2 * 64 + 1, device=DEVICE)[:, :128].view(4, 2, 64)   # token stride 129 * 4 bytes
    with pytest.raises(ValueError, match="16-byte aligned K rows"):
        context_attention_fwd(q[:4, :2], odd, odd, torch.empty_like(q[:4, :2]), [0], lens, 0.1, tma="host")
    shifted = torch.randn(4 * 128 + 1, device=DEVICE)[1:].view(4, 2, 64)        # base 4 bytes off
    with pytest.raises(ValueError, match="16-byte aligned K rows"):
        context_attention_fwd(q[:4, :2], shifted, shifted, torch.empty_like(q[:4, :2]), [0], lens, 0.1,
                              tma="device")
    spread = torch.randn(4, 2, 128, device=DEVICE)[..., :64]                    # heads 128 apart
    with pytest.raises(ValueError, match="side by side"):
        context_attention_fwd(q[:4, :2], spread, spread, torch.empty_like(q[:4, :2]), [0], lens, 0.1, tma="host")
    # ... which the device-side descriptors (one head's rows each) and the pointer path take.
    for tma in ("device", "off"):
        out = context_attention_fwd(q[:4, :2], spread, spread, torch.full_like(q[:4, :2], float("nan")), [0],
                                    lens, 0.1, tma=tma)
        check(out, prefill_attention_ref(q[:4, :2], spread, spread, [0], lens, 0.1), torch.float32)
    with pytest.raises(ValueError, match="tma must be one of"):
        context_attention_fwd(q, k, v, torch.empty_like(q), starts, [37, 20], 0.1, tma="yes")
    with pytest.raises(ValueError, match="softmax_scale > 0"):
        context_attention_fwd(q, k, v, torch.empty_like(q), starts, [37, 20], -0.1, fold_scale=True)


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
