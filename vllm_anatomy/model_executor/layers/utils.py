"""How a linear layer multiplies: on a CPU, oneDNN on a weight prepacked once; on CUDA,
F.linear, or (VLLM_ANATOMY_SKINNY_GEMM, on Hopper) a split-K Triton kernel for steps of few tokens.

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

On CUDA, dispatch_skinny_unquantized_gemm is the counterpart of what v0.27.1 does
only on ROCm (rocm_unquantized_gemm_impl: ops.wvSplitK / wvSplitKrc for few tokens,
behind VLLM_ROCM_USE_SKINNY_GEMM): a layer's `gemm` sends a matmul of at most
VLLM_ANATOMY_SKINNY_GEMM_MAX_M tokens (256) to vllm_anatomy/kernels/skinny_gemm.py
and larger ones to F.linear. Its NOTE says why split-K pays on decode shapes and why
its sum is deterministic. By default (VLLM_ANATOMY_SKINNY_GEMM=tuned) only where the
kernel's TUNED_CONFIGS holds a config row, i.e. where bench/skinny_gemm.py measured it
faster than cuBLAS on Hopper; =1 everywhere up to the limit, =0 never.
dispatch_unquantized_gemm (vLLM's name; vLLM's returns the platform's function, ours
sets the layer's) tries the CPU path, then the CUDA one.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

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


def dispatch_unquantized_gemm(layer: LinearBase | ParallelLMHead) -> bool:
    """Give `layer` its platform's `gemm` after loading (process_weights_after_loading):
    oneDNN on a CPU, the skinny kernel on CUDA with the switch on; False: F.linear stays."""
    return dispatch_cpu_unquantized_gemm(layer) or dispatch_skinny_unquantized_gemm(layer)


def _on_cuda(weight: torch.Tensor) -> bool:
    return weight.device.type == "cuda"


def _on_hopper(weight: torch.Tensor) -> bool:
    """sm_90 (H100/H200): where TUNED_CONFIGS' rows were measured."""
    return torch.cuda.get_device_capability(weight.device)[0] == 9


def dispatch_skinny_unquantized_gemm(layer: LinearBase | ParallelLMHead) -> bool:
    """Give `layer` a `gemm(x, weight, bias)` that runs skinny_gemm for at most
    VLLM_ANATOMY_SKINNY_GEMM_MAX_M tokens and F.linear above (and where the kernel's table
    measured cuBLAS faster: prefers_cublas; at "tuned", also where it has no row);
    False (F.linear stays) when the switch is off, the weight is not a CUDA bf16/fp16/fp32
    matrix, or at "tuned" no row of this weight's shape holds a config (or not on sm_90).

    NOTE: the choice reads only x's shape (host ints), never the data, so each CUDA graph
    captures one path and one config. The layer's weight is this rank's shard (column- and
    row-parallel alike: the kernel multiplies whatever it holds; a row-parallel layer's
    all-reduce comes after, in linear.py); the tied lm_head's is the embedding table.
    Each layer owns its tile counters (the split-K kernel's "serial" reduction leaves
    them zeroed), so no two launches in flight share one. fp32 weights (tests) multiply in
    full fp32, as F.linear does without TF32.
    NOTE: the host's cost. A Triton launch takes more host time than a cuBLAS call; CUDA
    graphs (every decode step, mixed steps in pieces) pay it once, at capture, but an eager
    step of at most VLLM_ANATOMY_SKINNY_GEMM_MAX_M tokens pays it per layer: what
    bench/throughput_ab.py's A/B of the switch has to show is the sum of both."""
    weight = layer.weight.detach()
    mode = envs.VLLM_ANATOMY_SKINNY_GEMM
    if (mode == "0" or not _on_cuda(weight) or weight.dim() != 2
            or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        return False
    # NOTE: imported here: a CPU run never needs the Triton kernel.
    from vllm_anatomy.kernels.skinny_gemm import new_counters, skinny_gemm, takes_skinny, tuned_buckets
    max_m = envs.VLLM_ANATOMY_SKINNY_GEMM_MAX_M
    tuned_only = mode == "tuned"
    # NOTE: "tuned" trusts only rows measured on Hopper (sm_90) for this weight's shape; a
    # weight without one keeps F.linear outright (no gemm, no counters).
    if tuned_only and (weight.dtype == torch.float32 or not tuned_buckets(*weight.shape)
                       or not _on_hopper(weight)):
        return False
    counters = new_counters(weight.shape[0], max_m, weight.device)
    pdl = envs.VLLM_ANATOMY_PDL          # PDL launches (kernels/pdl.py), read once like the rest

    def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x [..., in] -> [..., out]
        m, (n, k) = x.numel() // x.shape[-1], weight.shape
        if m <= max_m and x.dtype == weight.dtype and takes_skinny(m, n, k, x.dtype, tuned_only):
            return skinny_gemm(x, weight, bias, counters=counters, pdl=pdl)
        return F.linear(x, weight, bias)

    layer.gemm = gemm        # type: ignore[assignment]  # this layer's own, over the class's F.linear
    return True
