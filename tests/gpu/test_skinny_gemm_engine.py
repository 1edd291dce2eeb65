"""The whole engine on the GPU with VLLM_ANATOMY_SKINNY_GEMM=1 (kernels/skinny_gemm.py behind
model_executor/layers/utils.py: dispatch_skinny_unquantized_gemm): every linear layer and the
tied lm_head take the split-K kernel for steps of few tokens and F.linear above the threshold;
fp32 greedy tokens equal those with the switch off and transformers'; in bf16 at Qwen3-0.6B's
shape (3 layers) CUDA-graph runs equal eager runs and repeat bit for bit.

    python -m pytest -q -m gpu tests/gpu/test_skinny_gemm_engine.py
"""
import types

import pytest
import torch

from tests.gpu.conftest import NUM_BLOCKS, generate_greedy_and_close
from tests.gpu.test_fused_qk_norm_rope_engine import tiny_qwen3_dir  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LENS = [3, 17, 40, 90, 1, 33, 64, 120, 7]     # chunks of 128 tokens, then decode batches of <= 9
MAX_TOKENS = 16


def _prompts(vocab: int):
    return [[(7 * i + 3 * j) % (vocab - 10) + 5 for j in range(n)] for i, n in enumerate(LENS)]


def _tokens(model_dir, dtype, enforce_eager=False, max_tokens=MAX_TOKENS):
    from vllm_anatomy import LLM
    from vllm_anatomy.model_executor.layers.linear import LinearBase
    from vllm_anatomy.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    llm = LLM(model_dir, device="cuda", dtype=dtype, max_model_len=512, num_gpu_blocks_override=NUM_BLOCKS,
              max_num_batched_tokens=128, max_num_seqs=16, enforce_eager=enforce_eager)
    own_gemm: set = set()

    def read_gemms(llm):
        model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
        # (layer class, has its own gemm) over every linear layer and the lm_head
        own_gemm.update((type(m).__name__, "gemm" in vars(m)) for m in model.modules()
                        if isinstance(m, (LinearBase, ParallelLMHead)))
    vocab = llm.llm_engine.vllm_config.model_config.hf_config["vocab_size"]
    return generate_greedy_and_close(llm, _prompts(vocab), max_tokens, before=read_gemms), own_gemm


def test_switch_matches_cublas_and_transformers(tiny_qwen3_dir, monkeypatch):  # noqa: F811
    import transformers

    from vllm_anatomy.kernels import skinny_gemm as sg
    from vllm_anatomy.model_executor.layers import utils as layer_utils
    skinny_m, linear_m = [], []
    real_skinny, real_linear = sg.skinny_gemm, torch.nn.functional.linear

    def skinny(x, weight, bias=None, **kw):
        skinny_m.append(x.shape[0])
        return real_skinny(x, weight, bias, **kw)

    def linear(x, weight, bias=None):
        linear_m.append(x.shape[0])
        return real_linear(x, weight, bias)
    monkeypatch.setattr(sg, "skinny_gemm", skinny)
    monkeypatch.setattr(layer_utils, "F", types.SimpleNamespace(linear=linear))
    monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM", "1")
    monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM_MAX_M", "64")
    on, own_gemm = _tokens(tiny_qwen3_dir, "float32")
    assert own_gemm == {("QKVParallelLinear", True), ("RowParallelLinear", True),
                        ("MergedColumnParallelLinear", True), ("ParallelLMHead", True)}
    assert skinny_m and max(skinny_m) <= 64, "no launch (graph capture included) took the kernel"
    assert linear_m and min(linear_m) > 64, "the 128-token chunks must keep F.linear"
    monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM", "0")
    skinny_m.clear()
    off, own_gemm = _tokens(tiny_qwen3_dir, "float32")
    assert not skinny_m and not any(has for _, has in own_gemm)
    assert on == off
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for prompt, ours in zip(_prompts(512), on):
            ids = torch.tensor([prompt], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS)
            want = out[0, len(prompt):].tolist()
            assert want and ours[:len(want)] == want


def test_qwen3_shape_bf16_graphs_match_eager_and_repeat(qwen3_shape_dir, monkeypatch):
    """Real decode shapes (hidden 1024, qkv 4096, gate_up 6144, the 151,936-row lm_head), bf16:
    the default configs compile and capture; graphs equal eager; a second run is identical."""
    monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM", "1")
    graphs, own_gemm = _tokens(qwen3_shape_dir, "bfloat16", max_tokens=40)
    assert all(has for _, has in own_gemm)
    eager, _ = _tokens(qwen3_shape_dir, "bfloat16", enforce_eager=True, max_tokens=40)
    again, _ = _tokens(qwen3_shape_dir, "bfloat16", max_tokens=40)
    assert graphs == eager == again
    assert len({t for seq in graphs for t in seq}) > 8              # not one token repeated
