"""Linear layers on a CPU multiply with oneDNN on a prepacked weight (layers/utils.py:
dispatch_cpu_unquantized_gemm): every linear and the lm_head get their own `gemm`, it
computes F.linear's result (to fp32 rounding), the default model's greedy tokens do not change,
and VLLM_ANATOMY_CPU_ONEDNN_GEMM=0 keeps F.linear."""
import pytest
import torch
import torch.nn.functional as F

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.model_executor.layers.linear import LinearBase
from vllm_anatomy.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm_anatomy.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "A paged KV cache splits every sequence into blocks of sixteen tokens, so that"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _run(model_dir: str) -> tuple[list[list[int]], list[LinearBase | ParallelLMHead]]:
    llm = LLM(model_dir, max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=32)
    try:
        model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
        layers = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], layers


def test_every_linear_and_the_lm_head_are_prepacked_and_tokens_stay(default_model_dir, monkeypatch):
    packed_tokens, layers = _run(default_model_dir)
    assert layers and all("gemm" in vars(m) for m in layers), [type(m).__name__ for m in layers
                                                             if "gemm" not in vars(m)]
    x = torch.randn(7, layers[0].weight.shape[1])
    out = layers[0].gemm(x, layers[0].weight, None)
    torch.testing.assert_close(out, F.linear(x, layers[0].weight), rtol=1e-5, atol=1e-4)

    monkeypatch.setenv("VLLM_ANATOMY_CPU_ONEDNN_GEMM", "0")
    plain_tokens, plain_layers = _run(default_model_dir)
    assert not any("gemm" in vars(m) for m in plain_layers)
    assert plain_tokens == packed_tokens
    assert len({t for seq in plain_tokens for t in seq}) > 12         # real text, not one token repeated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_layer_computes_f_linear(dtype):
    layer = LinearBase(96, 160, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96))
        layer.bias.copy_(torch.randn(160))
    x = torch.randn(2, 5, 96, dtype=dtype)                             # [..., in] of any rank
    expected = layer(x)                                                # F.linear, the class's gemm
    # NOTE: oneDNN's bf16 path needs avx512bw/vl/dq or avx_ne_convert; on a CPU without them it
    # refuses the weight and the layer keeps F.linear (same result), as the dispatch promises.
    packs = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert dispatch_cpu_unquantized_gemm(layer) == packs
    assert ("gemm" in vars(layer)) == packs
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(layer(x), expected, **tol)


def test_other_dtypes_keep_f_linear():
    layer = LinearBase(32, 64).to(torch.float16)
    assert not dispatch_cpu_unquantized_gemm(layer)
    assert "gemm" not in vars(layer)
