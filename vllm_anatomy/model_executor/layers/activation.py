"""SiluAndMul: the gated activation of a Llama MLP.

Mirrors vllm/model_executor/layers/activation.py (SiluAndMul.forward_native).
The MLP's gate and up projections are one packed matmul (`gate_up_proj`),
so the activation receives both halves side by side and splits them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:], shape [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
