"""What every kernel wrapper checks before it launches."""
from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel) -> bool:
    """True when Triton's interpreter runs `kernel` (TRITON_INTERPRET=1 at import)."""
    return isinstance(kernel, InterpretedFunction)


def check_launchable(tensor: torch.Tensor, kernel) -> None:
    """A Triton kernel runs on CUDA tensors, or on CPU tensors in the interpreter."""
    if tensor.device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                           "vllm_anatomy.kernels is first imported")
