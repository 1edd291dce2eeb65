"""RMSNorm, with the fused "add residual, then normalize" variant.

Mirrors vllm/model_executor/layers/layernorm.py (RMSNorm.forward_native and
forward_cuda). vLLM fuses the residual add into the norm (one CUDA kernel,
`fused_add_rms_norm`); so do we on CUDA (vllm_anatomy/kernels/rms_norm.py, Triton), while
the CPU path is plain torch. The calling convention is the same either way:

    x = norm(x)                       # first layer: no residual yet
    x, residual = norm(x, residual)   # later: x + residual is normalized, and
                                      # the sum is handed back as the new residual
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_anatomy import envs


class RMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        # NOTE: torch.empty, not ones: every weight is overwritten by load_weights;
        # a norm left at its init value would hide a missing checkpoint tensor.
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.pdl = envs.VLLM_ANATOMY_PDL          # CUDA: PDL launches (kernels/pdl.py), read once

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # NOTE: dispatch as vLLM's CustomOp does (forward_cuda vs forward_native).
        # On CUDA the plain-torch norm is 9 tiny kernels (add, float, pow, mean,
        # add, rsqrt, mul, cast, mul); fusing them, RoPE and SiLU*mul cut a
        # profiled Qwen3-0.6B decode step's GPU time by about a third
        # (bench/results/step_overhead_h200*.json).
        # The Triton kernel does it in one launch with the same rounding steps.
        # Everywhere else the torch code below runs: it is the CPU path and the
        # oracle the kernel is tested against (bit-identical to transformers).
        if x.is_cuda:
            return self.forward_cuda(x, residual)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [..., hidden_size]
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        # NOTE: the mean of squares is taken in fp32 even for bf16 activations:
        # a sum of 576+ squares loses too much in bf16. The result is cast back
        # *before* multiplying by the weight, exactly as transformers does, so
        # that our bf16 numbers match theirs.
        x32 = x.float()
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        x = (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(orig_dtype)
        x = self.weight * x
        return x if residual is None else (x, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [T, hidden_size], or [T, heads, head_dim] strided (Qwen3's q/k norm
        # on a view of the qkv output: read in place, no copy). The results are
        # new contiguous tensors of x's shape; x and residual are not written.
        # NOTE: imported here, not at the top: the kernels pick compiled or
        # interpreted Triton at import, and CPU runs never need them.
        from vllm_anatomy.kernels.rms_norm import rms_norm
        return rms_norm(x, self.weight, self.variance_epsilon, residual, pdl=self.pdl)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
