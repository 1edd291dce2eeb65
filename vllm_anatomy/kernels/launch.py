"""What every kernel wrapper checks before it launches.

NOTE: Triton compiles one variant of a kernel per *specialization* of its
integer arguments: == 1, divisible by 16, or neither. A size that changes
every step (num_tokens, num_seqs, num_reqs, ...) would then need three
variants of each config, and whichever the warm-up did not happen to hit is
compiled in the middle of serving (the first run of the 256-sequence
workload on a fresh H200 ran at ~16k tok/s, the next at ~22.7k). So every
kernel lists those arguments in `do_not_specialize`: one variant, compiled at
warm-up. Strides stay specialized (divisibility by 16 lets loads vectorize).
"""
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
