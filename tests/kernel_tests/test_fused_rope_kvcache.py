"""Llama's RoPE + KV-cache write in one launch (kernels/fused_rope_kvcache.py) and its seam
(compilation/rope_kvcache_fusion.py).

The kernel must leave exactly what the unfused pair leaves (rotary_embedding, then
reshape_and_cache of the k it returned and qkv's v): the same q/k, bit for bit, and the same
cache, padding slots (-1) unwritten. On CPU in Triton's interpreter, fp32 and fp16; on a GPU
bf16 too.

The seam: a LlamaAttention without q/k norm, with the Triton backend, takes it only with
VLLM_ANATOMY_FUSE_ROPE_KVCACHE on (off by default), on CUDA, for steps of at most 256 tokens;
its Attention layer then launches no reshape_and_cache, and the fused launch's kernel span
names the cache write. On CPU the device checks are patched to run the seam interpreted, and
the unfused RoPE runs its Triton kernel (forward_cuda), as on a GPU.
"""
import pytest
import torch

from tests.kernel_tests.kernel_utils import DEVICE, ON_GPU, requires_cuda
from tests.kernel_tests.test_fused_qk_norm_rope_kvcache import (  # noqa: F401  (seam_on_cpu: a fixture)
    BLOCK_SIZE,
    RecordingKernelTimer,
    assert_same,
    assert_same_write,
    one_prefill_metadata,
    run_pair,
    seam_on_cpu,
)
from vllm_anatomy.attention.backends.torch_ref import TorchReferenceBackend
from vllm_anatomy.attention.backends.triton_attn import TritonAttentionBackend
from vllm_anatomy.compilation import rope_kvcache_fusion as fusion
from vllm_anatomy.kernels.fused_rope_kvcache import fused_rope_kvcache, fused_rope_kvcache_ref
from vllm_anatomy.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm_anatomy.model_executor.models.llama import LlamaAttention


def _without_norm(fn):
    """fn called with fused_qk_norm_rope_kvcache's arguments, less eps and the weights."""
    def call(qkv, nq, nk, nv, hd, eps, q_weight, k_weight, cos_sin_cache, is_neox, positions, kc, vc, slots):
        fn(qkv, nq, nk, nv, hd, cos_sin_cache, is_neox, positions, kc, vc, slots)
    return call


ROPE_FNS = (_without_norm(fused_rope_kvcache), _without_norm(fused_rope_kvcache_ref))


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((16, 8), 128), ((4, 1), 64)],
                         ids=["smollm2-9-3x64", "16-8x128", "4-1x64"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_matches_unfused_pair(num_tokens, heads, head_dim, is_neox):
    """fp32, GQA 9/3 at 64 (SmolLM2-135M), 16/8 at 128, 4/1, padding tokens (slot -1) after the real ones."""
    assert_same(num_tokens, *heads, head_dim=head_dim, is_neox=is_neox, seed=num_tokens + head_dim, num_pad=3,
                fns=ROPE_FNS)


def test_rotates_and_writes():
    """Not a no-op on either side: q and k change, v does not, and the cache holds the rotated k and v."""
    qkv_f, cache_f, _, _, before, slots = run_pair(5, 9, 3, 64, torch.float32, True, 1, fns=ROPE_FNS)
    qkv, *_ = run_pair(5, 9, 3, 64, torch.float32, True, 1, fns=(lambda *a: None,) * 2)
    q_size, kv_size = 9 * 64, 3 * 64
    assert not torch.equal(qkv_f[:, :q_size + kv_size], qkv[:, :q_size + kv_size])
    assert torch.equal(qkv_f[:, q_size + kv_size:], qkv[:, q_size + kv_size:])
    t = int((slots >= 0).nonzero()[0])
    slot = int(slots[t])
    k_row, v_row = (cache_f[i].flatten(0, 1)[slot].flatten() for i in (0, 1))
    assert torch.equal(k_row, qkv_f[t, q_size:q_size + kv_size]) and torch.equal(v_row, qkv[t, q_size + kv_size:])
    assert not torch.equal(cache_f, before)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_strided_qkv_rows(is_neox):
    assert_same(9, 9, 3, head_dim=64, is_neox=is_neox, seed=4, row_pad=48, fns=ROPE_FNS)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_fp16(num_tokens):
    assert_same(num_tokens, 9, 3, head_dim=64, dtype=torch.float16, seed=num_tokens, num_pad=2, fns=ROPE_FNS)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_partial_rotary(is_neox):
    """rotary_dim < head_dim: the unrotated tail unchanged in qkv and copied into the cache."""
    assert_same(7, 4, 2, head_dim=64, is_neox=is_neox, seed=3, rotary_dim=32, fns=ROPE_FNS)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 256])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((16, 8), 128)])
def test_bf16_gpu(num_tokens, heads, head_dim):
    assert_same(num_tokens, *heads, head_dim=head_dim, dtype=torch.bfloat16, seed=num_tokens, num_pad=5,
                fns=ROPE_FNS)


# ---------------------------------------------------------------- the seam

# SmolLM2-135M's attention: 9 q heads over 3 KV heads of 64.
CONFIG = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 100000.0}
NUM_BLOCKS = 24           # one_prefill_metadata's: 384 slots


@pytest.fixture
def llama_seam_on_cpu(seam_on_cpu, monkeypatch):  # noqa: F811  (the fixture imported above)
    """seam_on_cpu, plus this seam's device check, and the unfused RoPE through its kernel."""
    if not ON_GPU:
        monkeypatch.setattr(fusion, "_on_device", lambda qkv: True)
        monkeypatch.setattr(RotaryEmbedding, "forward", RotaryEmbedding.forward_cuda)
    return seam_on_cpu


def llama_attention(backend=TritonAttentionBackend, seed=0, fused=True):
    torch.manual_seed(seed)
    attn = LlamaAttention(CONFIG, backend, False, False, qk_norm=False).to(DEVICE)
    with torch.no_grad():
        for param in attn.parameters():      # (the layers allocate them uninitialized)
            param.normal_(0.0, 0.1)
    attn.fuse_rope_kvcache = fused
    return attn


def run_layer(attn, num_tokens, seen):
    """(cache after the layer, the kernels it launched, q/k/v handed to attention, slots)."""
    timer = RecordingKernelTimer()
    md, positions = one_prefill_metadata(num_tokens, timer)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 3, 64, device=DEVICE)
    hidden = torch.randn(num_tokens, 576, generator=torch.Generator().manual_seed(num_tokens)).to(DEVICE)
    with torch.no_grad():
        attn(positions, hidden, cache, md)
    return cache, timer.kernels, seen[-1], md.slot_mapping


@pytest.mark.parametrize("num_tokens", [5, fusion.ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM,
                                        fusion.ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM + 1])
def test_seam_writes_the_same_cache_and_skips_reshape_and_cache(llama_seam_on_cpu, num_tokens):
    """At most 256 tokens: one fused launch holds the write (its span says so), no reshape_and_cache;
    257: rotary_embedding + reshape_and_cache, as with the switch off. Either way the same cache and
    the same q/k/v as with the switch off."""
    attn = llama_attention()
    on = run_layer(attn, num_tokens, llama_seam_on_cpu)
    attn.fuse_rope_kvcache = False
    off = run_layer(attn, num_tokens, llama_seam_on_cpu)
    assert_same_write(on, off, num_tokens, "fused_rope_kvcache", ["rotary_embedding", "reshape_and_cache"])


def test_layer_skips_its_write_only_when_the_fused_launch_wrote(llama_seam_on_cpu, monkeypatch):
    """kv_cache_updated reaches the Attention layer True exactly when the fused launch ran."""
    from vllm_anatomy.attention.layer import Attention
    told = []
    real = Attention.forward
    monkeypatch.setattr(Attention, "forward", lambda self, *a: told.append(a[-1]) or real(self, *a))
    attn = llama_attention()
    for num_tokens in (3, fusion.ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM + 1):
        run_layer(attn, num_tokens, llama_seam_on_cpu)
    attn.fuse_rope_kvcache = False
    run_layer(attn, 3, llama_seam_on_cpu)
    assert told == [True, False, False]


def test_switch(monkeypatch):
    """VLLM_ANATOMY_FUSE_ROPE_KVCACHE: off unset (only a GPU A/B can turn it on by default), on
    at 1/true, off at 0/false; read when the layer is built; never with q/k norm (Qwen3 has its
    own), the torch backend, CPU tensors, no cache or metadata (a dummy run), or > 256 tokens."""
    from vllm_anatomy import envs
    monkeypatch.delenv("VLLM_ANATOMY_FUSE_ROPE_KVCACHE", raising=False)
    assert envs.VLLM_ANATOMY_FUSE_ROPE_KVCACHE is False
    assert not LlamaAttention(CONFIG, TritonAttentionBackend, False, False, qk_norm=False).fuse_rope_kvcache
    for value, on in (("1", True), ("true", True), ("0", False), ("false", False), ("False", False)):
        monkeypatch.setenv("VLLM_ANATOMY_FUSE_ROPE_KVCACHE", value)
        assert envs.VLLM_ANATOMY_FUSE_ROPE_KVCACHE is on, value
        assert LlamaAttention(CONFIG, TritonAttentionBackend, False, False, qk_norm=False).fuse_rope_kvcache is on
    monkeypatch.setenv("VLLM_ANATOMY_FUSE_ROPE_KVCACHE", "on")     # a typo must not silently measure a side
    with pytest.raises(ValueError, match="VLLM_ANATOMY_FUSE_ROPE_KVCACHE"):
        envs.VLLM_ANATOMY_FUSE_ROPE_KVCACHE
    monkeypatch.setenv("VLLM_ANATOMY_FUSE_ROPE_KVCACHE", "1")
    assert not LlamaAttention(CONFIG, TritonAttentionBackend, False, False, qk_norm=True).fuse_rope_kvcache
    md, _ = one_prefill_metadata(4, RecordingKernelTimer())
    qkv = torch.zeros(4, 15 * 64, device=DEVICE)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 3, 64, device=DEVICE)
    attn = llama_attention()
    assert fusion.takes_fused_rope_kvcache_update(attn.attn, qkv, cache, md) == ON_GPU   # CPU tensors: never
    monkeypatch.setattr(fusion, "_on_device", lambda qkv: True)
    assert fusion.takes_fused_rope_kvcache_update(attn.attn, qkv, cache, md)
    assert not fusion.takes_fused_rope_kvcache_update(llama_attention(TorchReferenceBackend).attn, qkv, cache, md)
    assert not fusion.takes_fused_rope_kvcache_update(attn.attn, qkv, None, md)
    assert not fusion.takes_fused_rope_kvcache_update(attn.attn, qkv, cache, None)
    big = torch.zeros(fusion.ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM + 1, 15 * 64, device=DEVICE)
    assert not fusion.takes_fused_rope_kvcache_update(attn.attn, big, cache, md)


# ---------------------------------------------------------------- the engine (CPU, interpreted)


def _greedy(model_dir, backend, prompts, max_tokens):
    """Each request's (token ids, the sampled tokens' logprobs): the logprobs show a changed K/V
    even where the argmax does not move."""
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model_dir, device="cpu", dtype="float32", attention_backend=backend, max_model_len=256,
              num_gpu_blocks_override=64, max_num_batched_tokens=64, max_num_seqs=8)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                            o.outputs[0].logprobs)])
            for o in outs]


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="CPU engine on the interpreter; tests/gpu/test_fused_rope_kvcache_engine.py "
                                   "is its GPU twin")
def test_engine_greedy_switch_on_equals_off(tiny_smollm2_dir, monkeypatch):
    """The whole engine (interpreted Triton kernels, fp32): greedy tokens and their logprobs with
    VLLM_ANATOMY_FUSE_ROPE_KVCACHE=1 equal those with =0, bit for bit, and the tokens the torch
    backend's. The seam's device check is patched (CPU tensors) and its limit lowered to 16 tokens
    so that, under a 64-token budget, prefill steps keep reshape_and_cache and decode steps take
    the fused launch."""
    from tests.helpers import count_calls
    from vllm_anatomy.kernels import fused_rope_kvcache as frkv
    monkeypatch.setattr(fusion, "_on_device", lambda qkv: True)
    monkeypatch.setattr(fusion, "ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM", 16)
    calls = count_calls(monkeypatch, frkv, "fused_rope_kvcache")
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate([3, 40, 17, 25])]
    out = {}
    for switch in ("1", "0"):
        calls.update(fused=0, reshape_and_cache=0)
        monkeypatch.setenv("VLLM_ANATOMY_FUSE_ROPE_KVCACHE", switch)
        out[switch] = _greedy(tiny_smollm2_dir, "triton", prompts, 6)
        assert (calls["fused"] > 0) == (switch == "1") and calls["reshape_and_cache"] > 0, (switch, calls)
    assert out["1"] == out["0"]
    assert [t for t, _ in out["1"]] == [t for t, _ in _greedy(tiny_smollm2_dir, "torch", prompts, 6)]
