"""Whole models through the Triton backend equal the torch reference backend.

Each model is a transformers config (saved with save_pretrained) plus random
weights written as safetensors, loaded twice with get_model: backend "torch"
(the oracle) and backend "triton". Both run the same paged steps (shuffled
blocks; fresh prefills, a chunk continuing cached context, decodes in one
flat batch) and their logits at every position are compared.
"""
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.helpers import PagedSequences
from tests.kernel_tests.kernel_utils import DEVICE, rel_err, requires_cuda
from vllm_anatomy.config import ModelConfig
from vllm_anatomy.model_executor.loader import get_model


def write_random_checkpoint(path, config, dtype, seed, device="cpu"):
    """config.json via save_pretrained + random weights under transformers' names."""
    config.save_pretrained(path)
    with torch.device("meta"):
        names = dict(transformers.AutoModelForCausalLM.from_config(config).named_parameters())
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, p in names.items():   # tied lm_head is the embedding: listed once
        noise = torch.randn(p.shape, generator=gen, device=device)
        if p.dim() == 1:            # norm weights around 1
            w = 1 + 0.1 * noise
        elif "embed" in name:
            w = noise
        else:                       # 1.5 / sqrt(fan_in): peaked attention, stable depth
            w = noise * 1.5 / p.shape[1] ** 0.5
        weights[name] = w.to(dtype).cpu().contiguous()
    save_file(weights, str(path / "model.safetensors"))
    return json.loads((path / "config.json").read_text())


def load(path, hf_config, backend, dtype, device):
    return get_model(ModelConfig(model=str(path), dtype=dtype, max_model_len=1024, device=device,
                                 hf_config=dict(hf_config)), backend=backend)


def run_steps(model, steps, block_size, num_blocks):
    seqs = PagedSequences(model, num_blocks=num_blocks, block_size=block_size, seed=1)
    return torch.cat([torch.cat(seqs.step(chunks)) for chunks in steps])     # [all tokens, V]


def make_steps(vocab, lens, seed):
    """Four steps over four sequences: prefills, a chunk on cached context, decodes; the
    last step decodes only (few requests: the Triton backend's split-KV "3D" path)."""
    gen = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()     # noqa: E731
    a, b, c = lens
    return [
        [("a", tok(a)), ("b", tok(b // 2))],                     # fresh prefill, first chunk
        [("b", tok(b - b // 2)), ("a", tok(1)), ("c", tok(c))],  # chunk continuing b, decode, prefill
        [("a", tok(1)), ("b", tok(1)), ("c", tok(1)), ("d", tok(5))],
        [("a", tok(1)), ("b", tok(1)), ("c", tok(1)), ("d", tok(1))],
    ]


@pytest.mark.parametrize("prefill_kernel", ["0", "1", "cudnn"], ids=["unified", "prefill_split", "cudnn_split"])
def test_tiny_llama_interpreter(tmp_path, monkeypatch, prefill_kernel):
    """2 layers, 4 heads over 2 KV heads, head_dim 32, fp32: logits equal to 1e-4. With
    VLLM_ANATOMY_PREFILL_KERNEL=1, fresh prefills (a, b's first chunk, c, d) go through
    the prefill kernel, the rest through unified_attention; with =cudnn and a 20-token
    threshold, a (21 tokens) goes through SDPA instead (on a GPU only in bf16: fp32 stays
    with the prefill kernel)."""
    from vllm_anatomy.kernels import prefill_attention as pa
    from vllm_anatomy.kernels import prefill_attention_sdpa as pa_sdpa
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", prefill_kernel)
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN", "20")
    launches, sdpa_launches = [], []
    real, real_sdpa = pa.context_attention_fwd, pa_sdpa.sdpa_prefill_attention
    monkeypatch.setattr(pa, "context_attention_fwd", lambda *a, **k: launches.append(1) or real(*a, **k))
    monkeypatch.setattr(pa_sdpa, "sdpa_prefill_attention",
                        lambda *a, **k: sdpa_launches.append(a[4]) or real_sdpa(*a, **k))
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=160,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=True)
    hf_config = write_random_checkpoint(tmp_path, config, torch.float32, seed=0)
    steps = make_steps(96, (21, 37, 9), seed=0)
    ref = run_steps(load(tmp_path, hf_config, "torch", torch.float32, DEVICE), steps, 16, 24)
    out = run_steps(load(tmp_path, hf_config, "triton", torch.float32, DEVICE), steps, 16, 24)
    # steps 1-3 have fresh prefills: one launch per layer each
    assert len(launches) == (3 * 2 if prefill_kernel != "0" else 0)
    sdpa = prefill_kernel == "cudnn" and pa_sdpa.sdpa_takes(torch.float32, 32, torch.device(DEVICE))
    assert sdpa_launches == ([((0, 21),)] * 2 if sdpa else [])   # step 1's a, in each layer
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


SHAPES = {
    # SmolLM2-135M: 30 layers, 9 heads over 3 KV heads, head_dim 64.
    "smollm2": lambda: transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    # Qwen3-0.6B: 28 layers, 16 heads over 8 KV heads, head_dim 128, q/k-norm, tied.
    "qwen3-0.6b": lambda: transformers.Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
def test_real_shapes_bf16_gpu(shape, tmp_path):
    """All layers, random bf16 weights. The Triton backend's logits must be as
    close to an fp32 run of the same weights as the torch backend's bf16 logits
    are (bf16 itself sets the noise floor; the two bf16 runs differ only inside
    attention: fp32 einsum vs bf16 tensor-core dots)."""
    hf_config = write_random_checkpoint(tmp_path, SHAPES[shape](), torch.bfloat16, seed=0,
                                        device="cuda")
    steps = make_steps(hf_config["vocab_size"], (300, 250, 40), seed=1)
    logits = {}
    for backend, dtype in [("torch", torch.float32), ("torch", torch.bfloat16),
                           ("triton", torch.bfloat16)]:
        model = load(tmp_path, hf_config, backend, dtype, "cuda")
        logits[backend, dtype] = run_steps(model, steps, 16, 64).float()
        del model
    ref = logits["torch", torch.float32]
    err_torch = rel_err(logits["torch", torch.bfloat16], ref)
    err_triton = rel_err(logits["triton", torch.bfloat16], ref)
    err_between = rel_err(logits["triton", torch.bfloat16], logits["torch", torch.bfloat16])
    print(f"{shape}: rel err vs fp32: torch-bf16 {err_torch:.3e}, triton-bf16 {err_triton:.3e}; "
          f"triton vs torch bf16 {err_between:.3e}")
    assert err_triton <= 1.5 * err_torch + 2e-3
    assert err_between <= 3 * err_torch + 2e-3


@pytest.mark.parametrize("backend", ["triton", "torch", "triton+prefill", "triton+long_prefill"])
def test_warm_up_shapes_run_through_each_backend(tmp_path, backend, monkeypatch):
    """The start-up warm-up (run on CUDA before the first request, with either
    attention backend) drives every shape through the model without touching
    the KV cache (slot -1); with the prefill split on, its fresh dummy prefills
    launch (so compile) the prefill kernel."""
    launches = []
    # triton+long_prefill: a threshold of 48 tokens, which only WARM_UP_SHAPES' (1, 64)
    # and the added dummy prefill of exactly that length reach.
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", "0")
    if backend.startswith("triton+"):
        from vllm_anatomy.kernels import prefill_attention as pa
        monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2" if backend == "triton+prefill" else "48")
        backend = "triton"
        monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", "1")
        real = pa.context_attention_fwd
        monkeypatch.setattr(pa, "context_attention_fwd", lambda *a, **k: launches.append(1) or real(*a, **k))
    from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm_anatomy.worker.gpu_model_runner import GPUModelRunner
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    write_random_checkpoint(tmp_path, config, torch.float32, seed=0)
    vc = VllmConfig(ModelConfig(model=str(tmp_path), max_model_len=128, device=DEVICE, attention_backend=backend),
                    CacheConfig(block_size=16, num_gpu_blocks_override=12),
                    SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128))
    runner = GPUModelRunner(vc, DEVICE)
    runner.load_model()
    runner.initialize_kv_cache(12)
    with torch.inference_mode():
        runner._warm_up_shapes()
    assert all(not kv.any() for kv in runner.kv_caches), "warm-up wrote into the KV cache"
    assert bool(launches) == (os.environ.get("VLLM_ANATOMY_PREFILL_KERNEL") == "1")
    if os.environ.get("VLLM_ANATOMY_PREFILL_MIN_LEN") == "48":
        # (1, 64) of WARM_UP_SHAPES and the added (1, 48); (3, 21) and (2, 32) stay unsplit.
        assert len(launches) == 2, launches


# -- the split-KV ("3D") decode path: vLLM's threshold and buffers ----------------------------

def test_seq_threshold_3D():
    """MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads, snapped to the nearest CUDA-graph capture size."""
    from vllm_anatomy.attention.backends.triton_attn import get_seq_threshold_3D
    from vllm_anatomy.config import default_capture_sizes
    assert get_seq_threshold_3D(8) == 16 and get_seq_threshold_3D(12) == 10
    sizes = default_capture_sizes(512)
    assert get_seq_threshold_3D(8, sizes) == 16       # Qwen3-0.6B: already a capture size
    assert get_seq_threshold_3D(12, sizes) == 8       # 10 -> 8 (nearer than 16)
    assert get_seq_threshold_3D(3, sizes) == 40       # 42 -> 40
    assert get_seq_threshold_3D(256, sizes) == 0      # MIN_LAUNCH_GRID_SIZE_2D // 256: no 3D


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_decode_batch_split_kv(dtype):
    """A decode-only batch through the Triton backend (the 3D kernel: 3 requests <=
    threshold 64) equals the torch backend; every layer's impl shares one set of buffers."""
    from tests.helpers import build_attn_metadata
    from tests.kernel_tests.kernel_utils import block_tables_for
    from tests.kernel_tests.kernel_utils import forward_through_backends
    from tests.kernel_tests.test_unified_attention import check
    from vllm_anatomy.attention.backends import triton_attn
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    seq_lens = [3, 70, 290]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    block_table = block_tables_for(seq_lens, block_size, num_blocks,
                                   max(-(-s // block_size) for s in seq_lens), seed=3)
    _, meta_ctx = build_attn_metadata([s - 1 for s in seq_lens], [s - 1 for s in seq_lens],
                                      block_table.tolist(), block_size, device=DEVICE)
    _, meta = build_attn_metadata([1] * 3, seq_lens, block_table.tolist(), block_size, device=DEVICE)
    torch.manual_seed(3)
    k1 = torch.randn(meta_ctx.num_actual_tokens, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    v1, k2, v2 = torch.randn_like(k1), torch.randn(3, num_kv_heads, head_dim).to(dtype).to(DEVICE), None
    v2 = torch.randn_like(k2)
    query = (2 * torch.randn(3, num_heads, head_dim)).to(dtype).to(DEVICE)
    outs, impls = forward_through_backends(("torch", "triton"), (num_heads, head_dim, num_kv_heads),
                                           num_blocks, block_size, dtype,
                                           [(k1, v1, meta_ctx), (k2, v2, meta)], query)
    segm = triton_attn.softmax_segm_buffers(num_heads, num_kv_heads, head_dim, torch.device(DEVICE))
    assert segm.seq_threshold_3D == 64 and segm.num_par_softmax_segments == 16
    assert impls[1]._segm is segm                     # the same tensors for every layer and step
    attrs = impls[1]._attention_launch_attrs(query, meta)
    assert attrs["vllm_anatomy.grid"][-1] == segm.num_par_softmax_segments
    check(outs[1], outs[0], dtype)


# -- the unified_attention span's keys: host values only ---------------------------------------

def test_launch_attrs_count_keys_from_the_host_copy_or_its_upper_bound():
    """num_keys and bytes from the exact host copy; in the padded drafter batch's decode forwards
    (no exact copy: only the device knows the rejected drafts) from seq_lens_cpu_upper_bound,
    flagged as such; never by reading the device (a meta tensor cannot be read)."""
    from dataclasses import replace

    from tests.helpers import build_attn_metadata
    from vllm_anatomy.attention.backends.triton_attn import TritonAttentionImpl
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    seq_lens = [3, 70, 290]
    tables = [list(range(i * 19, i * 19 + 19)) for i in range(3)]
    _, meta = build_attn_metadata([1] * 3, seq_lens, tables, block_size)
    meta = replace(meta, seq_lens=torch.empty(3, dtype=torch.int32, device="meta"))
    impl = TritonAttentionImpl(num_heads, head_dim, num_kv_heads, scale=head_dim ** -0.5)
    query = torch.randn(3, num_heads, head_dim, dtype=torch.bfloat16)
    exact = impl._attention_launch_attrs(query, meta)
    assert exact["vllm_anatomy.num_keys"] == sum(seq_lens) == 363
    assert "vllm_anatomy.num_keys_upper_bound" not in exact
    # The drafter's k-th decode forward: the first pass's lengths + k, every draft counted as accepted.
    upper_bound = torch.tensor(seq_lens, dtype=torch.int32) + 2
    drafter = impl._attention_launch_attrs(query, replace(meta, _seq_lens_cpu=None,
                                                          seq_lens_cpu_upper_bound=upper_bound))
    assert drafter["vllm_anatomy.num_keys"] == 369 and drafter["vllm_anatomy.num_keys_upper_bound"] is True
    # Every extra key is K and V read once: 2 * num_kv_heads * head_dim * 2 bytes (bf16).
    assert drafter["vllm_anatomy.bytes"] - exact["vllm_anatomy.bytes"] == 6 * 2 * num_kv_heads * head_dim * 2
    assert exact["vllm_anatomy.bytes"] > 2 * 363 * num_kv_heads * head_dim * 2
