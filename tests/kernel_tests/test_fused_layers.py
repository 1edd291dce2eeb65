"""The fused layer kernels (RMSNorm(+residual), RoPE, SiLU*mul, Qwen3's q/k norm + RoPE) equal their torch references.

On CPU they run in Triton's interpreter (fp32 and fp16, where the interpreter
rounds exactly), on small shapes; on a GPU (marked `gpu`) the same cases run in
bf16 too, at the Qwen3-0.6B decode shape, and whole tiny models compare the
CUDA dispatch (forward_cuda, the kernels) with the torch path (forward_native).

Inputs are built the way the model hands them over: q and k are column slices
of one packed qkv output (row stride wider than the slice), the per-head norm
sees them as [T, heads, head_dim] views, and the MLP activation a column slice
of a wider tensor.
"""
import contextlib

import pytest
import torch
import transformers

from tests.kernel_tests.kernel_utils import DEVICE, assert_close_ulp, rel_err, requires_cuda, ulp
from tests.kernel_tests.test_triton_backend import load, make_steps, run_steps, write_random_checkpoint
from vllm_anatomy.kernels.fused_qk_norm_rope import fused_qk_norm_rope, fused_qk_norm_rope_ref
from vllm_anatomy.kernels.rms_norm import rms_norm, rms_norm_ref
from vllm_anatomy.kernels.rotary_embedding import rotary_embedding, rotary_embedding_ref
from vllm_anatomy.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from vllm_anatomy.model_executor.layers.activation import SiluAndMul
from vllm_anatomy.model_executor.layers.layernorm import RMSNorm
from vllm_anatomy.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm_anatomy.model_executor.models.llama import LlamaAttention

CPU_DTYPES = [torch.float32, torch.float16]      # bf16 is wrong in the interpreter
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def randn(gen, *shape, dtype, device, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)


def assert_matches(out, ref, ulps=3, fp32_ulps=8):
    """fp16/bf16: `ulps` ulps. A last-bit fp32 difference (sums in another
    order, GPU rsqrt/exp approximations) can round an intermediate the other
    way; a later product (the norm weight, silu * up) and its own rounding can
    make that up to ~3 ulps of the output. fp32: `fp32_ulps` fp32 ulps, plus
    atol 1e-6 for cancellations (RoPE's x1*cos - x2*sin; the GPU may fuse it
    into an fma)."""
    assert out.is_contiguous()
    assert_close_ulp(out, ref, ulps=fp32_ulps if ref.dtype == torch.float32 else ulps, atol=1e-6)


# ---------------------------------------------------------------- RMSNorm

def rms_case(num_tokens, hidden, dtype, residual, strided, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    width = 3 * hidden if strided else hidden
    x = randn(gen, num_tokens, width, dtype=dtype, device=device)[:, hidden:2 * hidden] \
        if strided else randn(gen, num_tokens, hidden, dtype=dtype, device=device)
    res = None
    if residual:
        res = randn(gen, num_tokens, width, dtype=dtype, device=device, scale=4.0)
        res = res[:, :hidden] if strided else res
    weight = randn(gen, hidden, dtype=dtype, device=device, scale=0.2) + 1
    x_before = x.clone()
    res_before = res.clone() if res is not None else None
    out = rms_norm(x, weight, 1e-6, res)
    ref = rms_norm_ref(x, weight, 1e-6, res)
    assert torch.equal(x, x_before), "x was written"
    if residual:
        assert torch.equal(res, res_before), "residual was written"
        (out, new_res), (ref, ref_res) = out, ref
        assert new_res.dtype == ref_res.dtype and new_res.is_contiguous()
        # The sum is one rounded add on both sides: bit-equal.
        assert torch.equal(new_res, ref_res)
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("strided", [False, True], ids=["contig", "slice"])
def test_rms_norm_hidden(dtype, num_tokens, residual, strided):
    rms_case(num_tokens, 96, dtype, residual, strided, seed=num_tokens)


def per_head_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed, device=DEVICE):
    """Qwen3's q/k norm: [T, heads, head_dim] views of the packed qkv output."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(gen, num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device, scale=3.0)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    for x, n in [(q, num_heads), (k, num_kv_heads)]:
        view = x.view(num_tokens, n, head_dim)
        assert num_tokens == 1 or not view.is_contiguous()
        weight = randn(gen, head_dim, dtype=dtype, device=device, scale=0.2) + 1
        out = rms_norm(view, weight, 1e-6)
        assert out.shape == (num_tokens, n, head_dim)
        assert_matches(out, rms_norm_ref(view, weight, 1e-6))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_per_head(dtype, num_tokens, head_dim):
    per_head_case(num_tokens, 4, 2, head_dim, dtype, seed=head_dim)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_rms_norm_ref_is_the_layer(dtype):
    """The reference is the torch layer, bit for bit (so the kernel tests test the layer)."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(64, generator=gen))
    norm = norm.to(dtype)
    x, res = randn(gen, 5, 64, dtype=dtype, device="cpu"), randn(gen, 5, 64, dtype=dtype, device="cpu")
    with torch.no_grad():
        assert torch.equal(norm(x), rms_norm_ref(x, norm.weight, 1e-5))
        for a, b in zip(norm(x, res), rms_norm_ref(x, norm.weight, 1e-5, res)):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- RoPE

def rope_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, is_neox, seed,
              rotary_dim=None, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    rotary_dim = rotary_dim or head_dim
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(gen, num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device, scale=2.0)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, 10000.0, is_neox).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device)
    qkv_before = qkv.clone()
    q_out, k_out = rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim, is_neox)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, rope.cos_sin_cache, head_dim, is_neox)
    assert torch.equal(qkv, qkv_before), "q/k were written"
    assert q_out.shape == (num_tokens, q_size) and k_out.shape == (num_tokens, kv_size)
    # NOTE: x1*cos - x2*sin cancels: on a GPU the compiler may fuse one product
    # into the subtraction (an FMA skips that product's rounding), so allow one
    # ulp of the *inputs'* magnitude on top of one ulp of the output.
    for out, ref, x in ((q_out, q_ref, q), (k_out, k_ref, k)):
        atol = 1e-6 if x.dtype == torch.float32 else float(ulp(x.abs().max().float(), x.dtype))
        assert_close_ulp(out, ref, ulps=1 if x.dtype != torch.float32 else 8, atol=atol)
    if rotary_dim == head_dim:      # the reference is the torch layer, bit for bit
        with torch.no_grad():
            for a, b in zip(rope.forward_native(positions, q, k), (q_ref, k_ref)):
                assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_embedding(dtype, num_tokens, head_dim, is_neox):
    rope_case(num_tokens, 4, 2, head_dim, dtype, is_neox, seed=num_tokens + head_dim)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 1), (3, 3)])
def test_rotary_embedding_head_counts(num_heads, num_kv_heads):
    """GQA 6:1 and MHA with a head count that is not a power of two."""
    rope_case(5, num_heads, num_kv_heads, 64, torch.float32, True, seed=num_heads)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_embedding_partial(is_neox):
    """rotary_dim < head_size: the dims past rotary_dim are copied through."""
    rope_case(7, 4, 2, 64, torch.float16, is_neox, seed=1, rotary_dim=32)


# ---------------------------------------------------------------- SiLU * mul

def silu_case(num_tokens, d, dtype, strided, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * d + (d if strided else 0)
    x = randn(gen, num_tokens, width, dtype=dtype, device=device, scale=3.0)
    x = x[:, d // 2:d // 2 + 2 * d] if strided else x
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, d)
    # NOTE: on a GPU tl.exp and fp32 division are approximate (ex2.approx,
    # div.full), torch's are not: up to ~1e-6 relative for |gate| ~ 15.
    assert_matches(out, silu_and_mul_ref(x), fp32_ulps=64)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("strided", [False, True], ids=["contig", "slice"])
def test_silu_and_mul(dtype, num_tokens, strided):
    silu_case(num_tokens, 80, dtype, strided, seed=num_tokens)


def test_silu_and_mul_wide():
    """d > 1024: several column blocks per row."""
    silu_case(3, 1100, torch.float32, True, seed=0)


# ---------------------------------------------------------------- q/k norm + RoPE, fused

def qk_norm_rope_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, is_neox, seed,
                        rotary_dim=None, device=DEVICE, max_position=4096):
    """A packed qkv output [T, (nh + 2 nkv) * hd], the two norm weights, a RoPE table, positions < 4k."""
    gen = torch.Generator().manual_seed(seed)
    qkv = randn(gen, num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype,
                device=device, scale=3.0)
    q_weight = randn(gen, head_dim, dtype=dtype, device=device, scale=0.2) + 1
    k_weight = randn(gen, head_dim, dtype=dtype, device=device, scale=0.2) + 1
    rope = RotaryEmbedding(head_dim, rotary_dim or head_dim, max_position, 1000000.0, is_neox).to(device)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(device)
    return qkv, q_weight, k_weight, rope, positions


def unfused_layers(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, rope, positions,
                   eps=1e-6):
    """What LlamaAttention does without the fusion: split, q_norm, k_norm, rotary_emb
    (each layer's forward, so forward_cuda on CUDA tensors: the unfused kernels)."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    norms = []
    for w in (q_weight, k_weight):
        norm = RMSNorm(head_dim, eps=eps).to(device=qkv.device, dtype=w.dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
        norms.append(norm)
    with torch.no_grad():
        q = norms[0](q.view(num_tokens, num_heads, head_dim)).view(num_tokens, q_size)
        k = norms[1](k.view(num_tokens, num_kv_heads, head_dim)).view(num_tokens, kv_size)
        if rope.rotary_dim == head_dim:
            return rope(positions, q, k)
        # partial rotary: the layer builds none; the RoPE kernel / its reference handle it
        partial = rotary_embedding if qkv.is_cuda else rotary_embedding_ref
        return partial(positions, q, k, rope.cos_sin_cache, head_dim, rope.is_neox_style)


def fused_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, is_neox, seed,
               rotary_dim=None, device=DEVICE):
    """The kernel, in place on qkv, vs the unfused layers (torch on CPU; the unfused kernels on CUDA)."""
    qkv, q_weight, k_weight, rope, positions = qk_norm_rope_inputs(
        num_tokens, num_heads, num_kv_heads, head_dim, dtype, is_neox, seed, rotary_dim, device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q_ref, k_ref = unfused_layers(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight,
                                  rope, positions)
    v_before = qkv[:, q_size + kv_size:].clone()
    fused_qk_norm_rope(qkv, num_heads, num_kv_heads, num_kv_heads, head_dim, 1e-6, q_weight,
                       k_weight, rope.cos_sin_cache, is_neox, positions)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    assert torch.equal(v, v_before), "v was written"
    for out, ref in ((q, q_ref), (k, k_ref)):
        # NOTE: the fused kernel sums the squares in another order; the last
        # fp32 bit of rsqrt can then round a normalized value the other way
        # (one ulp of fp16/bf16), and RoPE's x1*cos - x2*sin carries that
        # ulp, of the *normalized* magnitude, into a cancelling sum.
        if ref.dtype == torch.float32:
            assert_close_ulp(out, ref, ulps=8, atol=1e-5)
        else:
            atol = 2 * float(ulp(ref.abs().max().float(), ref.dtype))
            assert_close_ulp(out, ref, ulps=2, atol=atol)
            # ... and rarely: almost every element is bit-equal.
            assert (out != ref).float().mean() < 0.02
    return qkv, (q_ref, k_ref)


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("heads,head_dim", [((16, 8), 128), ((16, 8), 64), ((4, 1), 64)])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_fused_qk_norm_rope(num_tokens, heads, head_dim, is_neox):
    """fp32 in the interpreter, GQA 16/8 (Qwen3-0.6B) and 4/1, head_dim 128 and 64, positions < 4k."""
    fused_case(num_tokens, *heads, head_dim, torch.float32, is_neox, seed=num_tokens + head_dim)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_fused_qk_norm_rope_fp16(num_tokens):
    fused_case(num_tokens, 4, 2, 64, torch.float16, True, seed=num_tokens)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_fused_qk_norm_rope_partial(is_neox):
    """rotary_dim < head_dim: the tail is normalized, not rotated."""
    fused_case(7, 4, 2, 64, torch.float32, is_neox, seed=3, rotary_dim=32)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_fused_qk_norm_rope_ref_is_the_layers(dtype):
    """The in-place reference is the unfused torch layers, bit for bit."""
    qkv, q_weight, k_weight, rope, positions = qk_norm_rope_inputs(9, 4, 2, 64, dtype, True, 0,
                                                                   device="cpu")
    q_ref, k_ref = unfused_layers(qkv, 4, 2, 64, q_weight, k_weight, rope, positions)
    fused_qk_norm_rope_ref(qkv, 4, 2, 2, 64, 1e-6, q_weight, k_weight, rope.cos_sin_cache, True,
                           positions)
    assert torch.equal(qkv[:, :256], q_ref) and torch.equal(qkv[:, 256:384], k_ref)


def test_fused_qk_norm_rope_strided_rows():
    """qkv rows wider than the q/k/v columns (a column slice of a bigger buffer): only q and k change."""
    qkv, q_weight, k_weight, rope, positions = qk_norm_rope_inputs(6, 4, 2, 32, torch.float32,
                                                                   True, 1)
    wide = torch.zeros(6, qkv.shape[1] + 40, device=DEVICE)
    wide[:, 8:8 + qkv.shape[1]] = qkv
    view = wide[:, 8:8 + qkv.shape[1]]
    expected = wide.clone()
    fused_qk_norm_rope_ref(expected[:, 8:8 + qkv.shape[1]], 4, 2, 2, 32, 1e-6, q_weight, k_weight,
                           rope.cos_sin_cache, True, positions)
    fused_qk_norm_rope(view, 4, 2, 2, 32, 1e-6, q_weight, k_weight, rope.cos_sin_cache, True,
                       positions)
    assert torch.equal(wide[:, :8], expected[:, :8]) and torch.equal(wide[:, -32:], expected[:, -32:])
    assert_close_ulp(wide, expected, ulps=8, atol=1e-5)


def test_attention_fuses_only_qk_norm_on_cuda(monkeypatch):
    """The seam: Qwen3's attention fuses on CUDA tensors only, and the env var turns it off."""
    from vllm_anatomy.attention.backends.torch_ref import TorchReferenceBackend
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 128}
    attn = LlamaAttention(config, TorchReferenceBackend, False, False, qk_norm=True)
    assert attn.enable_qk_norm_rope_fusion
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight.data.fill_(1.0)
    assert not attn._use_fused_qk_norm_rope(torch.zeros(2, 128))          # a CPU qkv
    assert not LlamaAttention(config, TorchReferenceBackend, False, False,
                              qk_norm=False).enable_qk_norm_rope_fusion
    monkeypatch.setenv("VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION", "0")
    assert not LlamaAttention(config, TorchReferenceBackend, False, False,
                              qk_norm=True).enable_qk_norm_rope_fusion


def test_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    assert rms_norm(x, w, 1e-6).shape == (0, 64)
    assert silu_and_mul(x).shape == (0, 32)
    q, k = rotary_embedding(torch.empty(0, dtype=torch.long, device=DEVICE), x, x[:, :32],
                            torch.zeros(8, 32, device=DEVICE), 32)
    assert q.shape == (0, 64) and k.shape == (0, 32)
    qkv = torch.empty(0, 4 * 32, device=DEVICE)
    fused_qk_norm_rope(qkv, 2, 1, 1, 32, 1e-6, w[:32], w[:32], torch.zeros(8, 32, device=DEVICE),
                       True, torch.empty(0, dtype=torch.long, device=DEVICE))


def test_layers_dispatch_on_device():
    """CPU tensors take the torch path (no kernel module needed)."""
    assert RMSNorm.forward is not RMSNorm.forward_native       # dispatching, not patched
    x = torch.randn(3, 8)
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.fill_(1.0)
        assert torch.equal(norm(x), norm.forward_native(x))
    assert torch.equal(SiluAndMul()(x), SiluAndMul().forward_native(x))


# ---------------------------------------------------------------- whole models

@contextlib.contextmanager
def layer_path(kind: str):
    """Route RMSNorm / SiluAndMul / RotaryEmbedding through forward_<kind>.

    "native" is the torch path everywhere (Qwen3's fused q/k norm + RoPE off
    too); "cuda" the unfused kernels (the fusion off); "fused" the kernels with
    the fusion on, also for CPU tensors (interpreted)."""
    mp = pytest.MonkeyPatch()
    layer_kind = "native" if kind == "native" else "cuda"
    for cls in (RMSNorm, SiluAndMul, RotaryEmbedding):
        mp.setattr(cls, "forward", getattr(cls, f"forward_{layer_kind}"))
    mp.setattr(LlamaAttention, "_use_fused_qk_norm_rope",
               lambda self, qkv: kind == "fused" and self.qk_norm)
    try:
        yield
    finally:
        mp.undo()


TINY = {
    # GQA 2:1, head_dim 32, Llama-3 RoPE scaling
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}),
    # q/k norm, head_dim 64 != hidden / heads, GQA 4:1
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=96, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
        max_position_embeddings=1024, tie_word_embeddings=True),
}


@pytest.mark.parametrize("arch,kind", [("llama", "cuda"), ("qwen3", "cuda"), ("qwen3", "fused")])
def test_tiny_model_cuda_path(arch, kind, tmp_path):
    """The layers' CUDA dispatch (the kernels; interpreted on CPU), unfused and
    with Qwen3's fused q/k norm + RoPE, gives the torch path's logits (fp32,
    two paged steps incl. a chunk and decodes)."""
    hf_config = write_random_checkpoint(tmp_path, TINY[arch](), torch.float32, seed=1)
    model = load(tmp_path, hf_config, "torch", torch.float32, DEVICE)
    steps = make_steps(96, (13, 9, 4), seed=2)[:2]
    with layer_path("native"):
        ref = run_steps(model, steps, 16, 8)
    with layer_path(kind):
        out = run_steps(model, steps, 16, 8)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- GPU

# Qwen3-0.6B's decode shape: batch 256, hidden 1024, 16 / 8 heads of 128, MLP 3072.
GPU_TOKENS = [1, 37, 256]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("strided", [False, True], ids=["contig", "slice"])
def test_rms_norm_hidden_gpu(dtype, num_tokens, residual, strided):
    rms_case(num_tokens, 1024, dtype, residual, strided, seed=num_tokens, device="cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
@pytest.mark.parametrize("heads,head_dim", [((16, 8), 128), ((9, 3), 64)])
def test_rms_norm_per_head_gpu(dtype, num_tokens, heads, head_dim):
    per_head_case(num_tokens, *heads, head_dim, dtype, seed=num_tokens, device="cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
@pytest.mark.parametrize("heads,head_dim", [((16, 8), 128), ((9, 3), 64)])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_embedding_gpu(dtype, num_tokens, heads, head_dim, is_neox):
    rope_case(num_tokens, *heads, head_dim, dtype, is_neox, seed=num_tokens, device="cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_rotary_embedding_partial_gpu(dtype):
    rope_case(37, 16, 8, 128, dtype, True, seed=0, rotary_dim=64, device="cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", GPU_TOKENS)
@pytest.mark.parametrize("d", [3072, 1536, 80])
def test_silu_and_mul_gpu(dtype, num_tokens, d):
    silu_case(num_tokens, d, dtype, True, seed=num_tokens, device="cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", GPU_TOKENS + [4096])
@pytest.mark.parametrize("heads,head_dim", [((16, 8), 128), ((9, 3), 64)])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_fused_qk_norm_rope_gpu(dtype, num_tokens, heads, head_dim, is_neox):
    """The fused kernel vs the unfused CUDA path (q_norm, k_norm, rotary kernels)."""
    fused_case(num_tokens, *heads, head_dim, dtype, is_neox, seed=num_tokens, device="cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_fused_qk_norm_rope_partial_gpu(dtype):
    fused_case(37, 16, 8, 128, dtype, True, seed=0, rotary_dim=64, device="cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("arch", list(TINY))
def test_tiny_model_gpu(arch, tmp_path):
    """The layers on CUDA (kernels; for Qwen3 unfused and fused) vs the torch
    path on CUDA, same weights. fp32: equal to 1e-4. bf16: the kernel paths must
    be as close to the fp32 logits as the torch bf16 path is (all round the same
    intermediates)."""
    hf_config = write_random_checkpoint(tmp_path, TINY[arch](), torch.float32, seed=1)
    steps = make_steps(96, (40, 23, 9), seed=2)
    kinds = ("native", "cuda", "fused") if arch == "qwen3" else ("native", "cuda")
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load(tmp_path, hf_config, "torch", dtype, "cuda")
        for kind in kinds:
            with layer_path(kind):
                logits[kind, dtype] = run_steps(model, steps, 16, 16).float()
    ref = logits["native", torch.float32]
    err_torch = rel_err(logits["native", torch.bfloat16], ref)
    for kind in kinds[1:]:
        torch.testing.assert_close(logits[kind, torch.float32], ref, atol=1e-4, rtol=1e-4)
        err_fused = rel_err(logits[kind, torch.bfloat16], ref)
        err_between = rel_err(logits[kind, torch.bfloat16], logits["native", torch.bfloat16])
        print(f"{arch} {kind}: rel err vs fp32: torch-bf16 {err_torch:.3e}, kernels-bf16 "
              f"{err_fused:.3e}; between {err_between:.3e}")
        assert err_fused <= 1.5 * err_torch + 2e-3
        assert err_between <= 3 * err_torch + 2e-3
