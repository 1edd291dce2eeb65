"""SiluAndMul: the gated activation of a Llama MLP.

Mirrors vllm/model_executor/layers/activation.py (SiluAndMul.forward_native and
forward_cuda: on CUDA one Triton kernel, vllm_anatomy/kernels/silu_and_mul.py).
The MLP's gate and up projections are one packed matmul (`gate_up_proj`),
so the activation receives both halves side by side and splits them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_anatomy import envs


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:], shape [..., d]."""

    def __init__(self) -> None:
        super().__init__()
        self.pdl = envs.VLLM_ANATOMY_PDL          # CUDA: PDL launches (kernels/pdl.py), read once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: dispatch as vLLM's CustomOp does. On CUDA, silu + mul are two
        # kernels and a [T, d] intermediate; fusing such tiny elementwise
        # launches (with the norms and RoPE) cut a profiled decode step's GPU
        # time by about a third (bench/results/step_overhead_h200*.json), so
        # CUDA takes the one-launch Triton kernel.
        # Everywhere else (the CPU path, and the kernel's oracle) plain torch.
        if x.is_cuda:
            return self.forward_cuda(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: imported lazily: CPU runs never need the kernel module.
        from vllm_anatomy.kernels.silu_and_mul import silu_and_mul
        return silu_and_mul(x, pdl=self.pdl)       # new contiguous [..., d]
