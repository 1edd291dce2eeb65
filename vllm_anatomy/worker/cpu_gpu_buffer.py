"""CpuGpuBuffer: a persistent input buffer, once on the host and once on the device.

Mirrors CpuGpuBuffer in vllm/v1/utils.py. The runner fills `.np` (a numpy
view of the pinned host tensor `.cpu`: numpy is the fast way to write small
arrays from Python) and `copy_to_gpu(n)` copies the first n values to `.gpu`,
the tensor the kernels read.

NOTE: the copy is non_blocking: from pinned memory it returns at once and
runs in stream order, so the host must not rewrite `.cpu` until the device
has read it (GPUModelRunner.synchronize_input_prep waits for that under
async scheduling). The same tensors every step: a CUDA graph replays on their
addresses (worker/cudagraph.py). On a CPU "gpu" is a second host tensor.
Simplified: no with_numpy=False (no bfloat16 buffers here).
"""
from __future__ import annotations

import torch


class CpuGpuBuffer:

    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> None:
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=pin_memory)
        self.gpu = torch.zeros_like(self.cpu, device=device)
        self.np = self.cpu.numpy()

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)

