"""How a linear layer multiplies on a CPU: oneDNN on a weight prepacked once.

Mirrors vllm/model_executor/layers/utils.py (dispatch_cpu_unquantized_gemm), which
on a CPU vLLM calls from the process_weights_after_loading of
vllm/model_executor/layers/linear.py (UnquantizedLinearMethod) and of
vllm/model_executor/layers/vocab_parallel_embedding.py (UnquantizedEmbeddingMethod).

NOTE: what it replaces, and why it is faster. A layer's `gemm` is F.linear
(linear.py); after loading, on a CPU, dispatch_cpu_unquantized_gemm gives the
layer a `gemm` that runs oneDNN's matmul on a copy of its weight reordered once
into oneDNN's blocked layout. F.linear hands torch's row-major weight to MKL's
sgemm on every call; on the AMD cores of the 2-core machine that was 1.3-2.9x
slower per layer, most for the wide ones (gate_up, the 49,152-row lm_head),
and a step is three quarters matmuls. Same math, other order of the fp32
additions (outputs differ in the last bits; greedy tokens stay those of
transformers, tests/integration check them). vLLM does the same through its
own extension (ops.create_onednn_mm / onednn_mm); ours calls the oneDNN ops
torch ships (the ones Inductor's CPU backend uses). The cost: the prepacked
copy sits beside the weight, which stays for whatever else reads it (the tied
embedding's lookup, tests that compare loaded weights), so a CPU model holds
its matrices twice; vLLM frees a linear's plain weight (remove_weight=True)
and keeps the lm_head's. VLLM_ANATOMY_CPU_ONEDNN_GEMM=0 keeps F.linear.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from vllm_anatomy import envs

if TYPE_CHECKING:
    from vllm_anatomy.model_executor.layers.linear import LinearBase
    from vllm_anatomy.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

logger = logging.getLogger(__name__)


def dispatch_cpu_unquantized_gemm(layer: LinearBase | ParallelLMHead) -> bool:
    """Give `layer` a prepacked oneDNN `gemm(x, weight, bias)`; False (F.linear stays) when
    the layer is not on a CPU, its dtype is neither float32 nor bfloat16, torch has no
    oneDNN, the switch is off, or oneDNN refuses the weight."""
    weight = layer.weight.detach()
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available() or not envs.VLLM_ANATOMY_CPU_ONEDNN_GEMM):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)    # [out, in], oneDNN's layout
    except RuntimeError as e:
        logger.warning("oneDNN refused %s's weight %s, keeping F.linear: %s", type(layer).__name__,
                       tuple(weight.shape), e)
        return False

    def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x [..., in] -> [..., out]; `weight` is the same matrix as `packed`, in torch's layout
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    layer.gemm = gemm        # type: ignore[assignment]  # this layer's own, over the class's F.linear
    return True
