"""Qwen3's q/k norm + RoPE + KV-cache write in one launch (kernels/fused_qk_norm_rope_kvcache.py) and its seam
(compilation/qk_norm_rope_kvcache_fusion.py).

The kernel must leave exactly what the unfused pair leaves (fused_qk_norm_rope, then
reshape_and_cache of the k and v it left in qkv): the same q/k in qkv, bit for bit, and
the same cache, padding slots (-1) unwritten. On CPU in Triton's interpreter, fp32 and
fp16 (bf16 arithmetic is wrong there); on a GPU bf16 too.

The seam: Qwen3's LlamaAttention with the Triton backend takes it only with both switches
on, on CUDA, for steps of at most 256 tokens; its Attention layer then launches no
reshape_and_cache, and the fused launch's kernel span names the cache write. On CPU the
device check is patched to run the seam interpreted.
"""
import contextlib

import pytest
import torch

from tests.kernel_tests.kernel_utils import DEVICE, ON_GPU, requires_cuda
from tests.kernel_tests.test_fused_layers import qk_norm_rope_inputs
from vllm_anatomy.attention.backends.abstract import AttentionMetadata
from vllm_anatomy.attention.backends.torch_ref import TorchReferenceBackend
from vllm_anatomy.attention.backends.triton_attn import TritonAttentionBackend
from vllm_anatomy.compilation import qk_norm_rope_kvcache_fusion as fusion
from vllm_anatomy.compilation.rope_kvcache_fusion import ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM
from vllm_anatomy.kernels.fused_qk_norm_rope_kvcache import (
    fused_qk_norm_rope_kvcache,
    fused_qk_norm_rope_kvcache_ref,
)
from vllm_anatomy.model_executor.models.llama import LlamaAttention

BLOCK_SIZE, NUM_BLOCKS = 16, 8


def random_slots(num_tokens, num_pad, gen, num_blocks=NUM_BLOCKS, device=DEVICE):
    """Distinct slots, slot 0 first (the edge of slot >= 0), ~20 % of the others -1, and -1 for
    the padding tail (a graph-sized batch)."""
    assert num_tokens + num_pad <= num_blocks * BLOCK_SIZE, "fewer slots than tokens"
    perm = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)
    slots = torch.cat([torch.zeros(1, dtype=torch.long), perm[perm != 0]])[:num_tokens + num_pad]
    drop = torch.rand(num_tokens + num_pad, generator=gen) < 0.2
    drop[0] = False
    slots[drop] = -1
    slots[num_tokens:] = -1
    return slots.to(device)


def run_pair(num_tokens, num_heads, num_kv_heads, head_dim, dtype, is_neox, seed, num_pad=0,
             row_pad=0, rotary_dim=None, fns=(fused_qk_norm_rope_kvcache, fused_qk_norm_rope_kvcache_ref)):
    """(qkv and cache after the fused kernel, after the unfused pair, the cache before, slots).
    fns: (fused, unfused pair), called with fused_qk_norm_rope_kvcache's arguments."""
    qkv, q_weight, k_weight, rope, positions = qk_norm_rope_inputs(
        num_tokens + num_pad, num_heads, num_kv_heads, head_dim, dtype, is_neox, seed, rotary_dim)
    gen = torch.Generator().manual_seed(seed + 1)
    # qkv rows may be wider than its columns (a column slice of a bigger buffer)
    cols = slice(row_pad // 2, row_pad // 2 + qkv.shape[1])
    wide = torch.randn(qkv.shape[0], qkv.shape[1] + row_pad, generator=gen).to(dtype).to(DEVICE)
    wide[:, cols] = qkv
    # NOTE: at least one slot per token (the GPU case batches 256 + 5 tokens), plus a spare block
    num_blocks = max(NUM_BLOCKS, -(-(num_tokens + num_pad) // BLOCK_SIZE) + 1)
    slots = random_slots(num_tokens, num_pad, gen, num_blocks)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    before = cache.clone()
    outs = []
    for fn in fns:
        x = wide.clone()
        c = cache.clone()
        assert x[:, cols].is_contiguous() == (row_pad == 0)
        fn(x[:, cols], num_heads, num_kv_heads, num_kv_heads, head_dim, 1e-6, q_weight, k_weight,
           rope.cos_sin_cache, is_neox, positions, c[0], c[1], slots)
        outs.append((x, c))
    (qkv_f, cache_f), (qkv_u, cache_u) = outs
    return qkv_f, cache_f, qkv_u, cache_u, before, slots


def assert_same(num_tokens, *heads, head_dim, dtype=torch.float32, is_neox=True, seed=0, **kw):
    qkv_f, cache_f, qkv_u, cache_u, before, slots = run_pair(num_tokens, *heads, head_dim, dtype,
                                                             is_neox, seed, **kw)
    assert torch.equal(qkv_f, qkv_u), "q/k in qkv differ from fused_qk_norm_rope's"
    assert torch.equal(cache_f, cache_u), "the cache differs from reshape_and_cache's"
    written = (slots >= 0).sum().item()
    changed = (cache_f != before).flatten(3).any(-1).flatten(1).any(0).sum().item()   # slots written
    assert changed == written, (changed, written)


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("heads,head_dim", [((16, 8), 128), ((4, 1), 64), ((4, 2), 64)])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_matches_unfused_pair(num_tokens, heads, head_dim, is_neox):
    """fp32, GQA 16/8 (Qwen3-0.6B) 4/1 4/2, with padding tokens (slot -1) after the real ones."""
    assert_same(num_tokens, *heads, head_dim=head_dim, is_neox=is_neox, seed=num_tokens + head_dim, num_pad=3)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_strided_qkv_rows(is_neox):
    """qkv a column slice of a wider buffer: the columns around it stay as they were."""
    assert_same(9, 4, 2, head_dim=32, is_neox=is_neox, seed=4, row_pad=48)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_fp16(num_tokens):
    assert_same(num_tokens, 4, 2, head_dim=64, dtype=torch.float16, seed=num_tokens, num_pad=2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 256])
def test_bf16_qwen3_shape_gpu(num_tokens):
    assert_same(num_tokens, 16, 8, head_dim=128, dtype=torch.bfloat16, seed=num_tokens, num_pad=5)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_partial_rotary(is_neox):
    """rotary_dim < head_dim: the unrotated tail goes into the cache too."""
    assert_same(7, 4, 2, head_dim=64, is_neox=is_neox, seed=3, rotary_dim=32)


def test_only_padding_writes_no_slot():
    qkv_f, cache_f, qkv_u, _, before, _ = run_pair(4, 4, 2, 32, torch.float32, True, 5, num_pad=0)
    slots = torch.full((4,), -1, device=DEVICE)
    qkv, q_weight, k_weight, rope, positions = qk_norm_rope_inputs(4, 4, 2, 32, torch.float32, True, 5)
    cache = before.clone()
    fused_qk_norm_rope_kvcache(qkv, 4, 2, 2, 32, 1e-6, q_weight, k_weight, rope.cos_sin_cache, True,
                               positions, cache[0], cache[1], slots)
    assert torch.equal(cache, before)
    assert torch.equal(qkv, qkv_u), "padding tokens are still normalized and rotated in qkv"


def test_empty_batch():
    w = torch.ones(32, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 1, 32, device=DEVICE)
    fused_qk_norm_rope_kvcache(torch.empty(0, 4 * 32, device=DEVICE), 2, 1, 1, 32, 1e-6, w, w,
                               torch.zeros(8, 32, device=DEVICE), True,
                               torch.empty(0, dtype=torch.long, device=DEVICE), cache[0], cache[1],
                               torch.empty(0, dtype=torch.long, device=DEVICE))
    assert not cache.any()


# ---------------------------------------------------------------- the seam

CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "rms_norm_eps": 1e-6, "max_position_embeddings": 512}


class RecordingKernelTimer:
    """What a full trace's DeviceTimer is handed: the launches, in order, with their attributes."""

    def __init__(self):
        self.kernels: list[tuple[str, dict]] = []

    @contextlib.contextmanager
    def kernel(self, name, describe=None):
        yield
        self.kernels.append((name, describe() if describe else {}))


@pytest.fixture
def seam_on_cpu(monkeypatch):
    """Run the CUDA-only seam on CPU tensors (interpreted) and stop before attention itself:
    what the seam decides is the cache write; the q/k/v handed to attention are kept."""
    seen = []

    def no_attention(impl, query, key, value, kv_cache, output, *, attn_metadata):
        seen.append((query.clone(), key.clone(), value.clone()))
        output.zero_()

    if not ON_GPU:
        monkeypatch.setattr(fusion, "_on_device", lambda qkv: True)
        monkeypatch.setattr(LlamaAttention, "_use_fused_qk_norm_rope",
                            lambda self, qkv: self.enable_qk_norm_rope_fusion)
    monkeypatch.setattr("vllm_anatomy.attention.layer.unified_attention_with_output", no_attention)
    return seen


def qwen3_attention(backend=TritonAttentionBackend, seed=0):
    torch.manual_seed(seed)
    attn = LlamaAttention(CONFIG, backend, False, False, qk_norm=True).to(DEVICE)
    with torch.no_grad():
        for param in attn.parameters():      # (the layers allocate them uninitialized)
            param.normal_(0.0, 0.2)
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.normal_(1.0, 0.2)
    return attn


def one_prefill_metadata(num_tokens, timer):
    """A single request's first num_tokens tokens, its blocks a permutation of the cache's 24."""
    blocks = torch.randperm(24, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    pos = torch.arange(num_tokens)
    slots = (blocks[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).to(DEVICE)
    return AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=1, max_query_len=num_tokens, max_seq_len=num_tokens,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE),
        block_table=blocks[None].to(DEVICE), slot_mapping=slots, kernel_timer=timer), pos.to(DEVICE)


def run_layer(attn, num_tokens, fused: bool, seen):
    """(cache after the layer, the kernels it launched, q/k/v handed to attention)."""
    attn.fuse_qk_norm_rope_kvcache = fused
    timer = RecordingKernelTimer()
    md, positions = one_prefill_metadata(num_tokens, timer)
    cache = torch.zeros(2, 24, BLOCK_SIZE, 2, 16, device=DEVICE)
    hidden = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens)).to(DEVICE)
    with torch.no_grad():
        attn(positions, hidden, cache, md)
    return cache, timer.kernels, seen[-1], md.slot_mapping


@pytest.mark.parametrize("num_tokens", [5, 256, 257])
def test_seam_writes_the_same_cache_and_skips_reshape_and_cache(seam_on_cpu, num_tokens):
    """At most 256 tokens: one fused launch holds the write (its span says so), no
    reshape_and_cache; 257: fused_qk_norm_rope (untimed, as before) + reshape_and_cache.
    Either way the same cache and the same q/k/v as with the switch off."""
    attn = qwen3_attention()
    off = run_layer(attn, num_tokens, False, seam_on_cpu)
    on = run_layer(attn, num_tokens, True, seam_on_cpu)
    assert_same_write(on, off, num_tokens, "fused_qk_norm_rope_kvcache", ["fused_qk_norm_rope", "reshape_and_cache"])


def assert_same_write(on, off, num_tokens, kernel, fuses):
    """A layer's step with the fusion's switch on and off (run_layer's (cache, kernels, q/k/v handed to
    attention, slots) each): the same cache, every slot written, the same q/k/v; at most 256 tokens one
    `kernel` launch whose span names the cache write and what it `fuses`, else reshape_and_cache as off."""
    (cache_on, kernels_on, qkv_on, slots), (cache_off, kernels_off, qkv_off, _) = on, off
    assert [n for n, _ in kernels_off] == ["reshape_and_cache"]
    for a, b in zip(qkv_on, qkv_off):
        assert torch.equal(a, b)
    assert torch.equal(cache_on, cache_off)
    written = cache_on.ne(0).any(-1).any(-1).any(0).flatten()    # [num_blocks * block_size]: slots
    assert written.nonzero().flatten().tolist() == sorted(slots.tolist())
    if num_tokens <= ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM:
        ((name, attrs),) = kernels_on
        assert name == kernel
        assert attrs["vllm_anatomy.kv_cache_update"] == "slot_mapping"
        assert attrs["vllm_anatomy.fuses"] == fuses
        assert attrs["vllm_anatomy.num_tokens"] == num_tokens and attrs["vllm_anatomy.grid"][0] >= 1
    else:
        assert [n for n, _ in kernels_on] == ["reshape_and_cache"]


def test_switches(monkeypatch):
    """Built on the q/k norm + RoPE fusion: on by default (measured on an H100), and with
    VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE=1, off with either switch at 0, never without
    q/k norm (Llama), never with the torch backend or CPU tensors."""
    monkeypatch.delenv("VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE", raising=False)
    assert qwen3_attention().fuse_qk_norm_rope_kvcache
    monkeypatch.setenv("VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE", "1")
    assert qwen3_attention().fuse_qk_norm_rope_kvcache
    assert not LlamaAttention(CONFIG, TritonAttentionBackend, False, False, qk_norm=False).fuse_qk_norm_rope_kvcache
    for name in ("VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE", "VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION"):
        with monkeypatch.context() as m:
            m.setenv(name, "0")
            assert not qwen3_attention().fuse_qk_norm_rope_kvcache
    md, _ = one_prefill_metadata(4, RecordingKernelTimer())
    qkv = torch.zeros(4, 8 * 16, device=DEVICE)
    cache = torch.zeros(2, 24, BLOCK_SIZE, 2, 16, device=DEVICE)
    attn = qwen3_attention()
    assert fusion.takes_fused_kvcache_update(attn.attn, qkv, cache, md) == ON_GPU   # CPU tensors: never
    monkeypatch.setattr(fusion, "_on_device", lambda qkv: True)
    assert fusion.takes_fused_kvcache_update(attn.attn, qkv, cache, md)
    assert not fusion.takes_fused_kvcache_update(qwen3_attention(TorchReferenceBackend).attn, qkv, cache, md)
    assert not fusion.takes_fused_kvcache_update(attn.attn, qkv, None, md)          # a dummy run
    assert not fusion.takes_fused_kvcache_update(attn.attn, qkv, cache, None)
    big = torch.zeros(ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM + 1, 8 * 16, device=DEVICE)
    assert not fusion.takes_fused_kvcache_update(attn.attn, big, cache, md)


@pytest.mark.parametrize("kv_cache_updated", [False, True])
def test_attention_writes_the_cache_unless_told(kv_cache_updated):
    """Attention.forward's do_kv_cache_update runs unless the model says K/V are in the cache
    (the torch backend: its attention reads K/V back from the cache, so the output shows it too)."""
    attn = qwen3_attention(TorchReferenceBackend).attn
    md, _ = one_prefill_metadata(3, RecordingKernelTimer())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, n * 16, generator=gen).to(DEVICE) for n in (4, 2, 2))
    cache = torch.zeros(2, 24, BLOCK_SIZE, 2, 16, device=DEVICE)
    attn(q, k, v, cache, md, kv_cache_updated=kv_cache_updated)
    assert bool(cache.any()) is not kv_cache_updated


def test_bench_kvcache_mode_smoke():
    """bench/fused_qk_norm_rope.py --mode kvcache's cases on CPU (interpreted, fp32, 2 tokens, a small
    cache): both paths run and leave the same qkv and cache (the GPU run times them)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import fused_qk_norm_rope as bench
    pair, fused, bit_equal = bench.make_kvcache_case(2, device=DEVICE, num_blocks=4, dtype=torch.float32)
    assert bit_equal
    pair()
    fused()
