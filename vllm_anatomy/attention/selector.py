"""Pick an attention backend by name.

Mirrors vllm/v1/attention/selector.py (get_attn_backend). vLLM chooses among
FLASH_ATTN, FLASHINFER, TRITON_ATTN, ... from the platform, dtype and head
size (see vllm/platforms/cuda.py); here the caller names the backend:
"torch" — the plain-torch reference (readable, the oracle);
"cpu" — the CPU fast path: the same contract in fewer, fused torch ops
        (PyTorch's CPU flash-attention kernel), see backends/cpu_attn.py;
"triton" — reshape_and_cache + unified_attention Triton kernels (GPU).
"""
from __future__ import annotations

import importlib

from vllm_anatomy.attention.backends.abstract import AttentionBackend
from vllm_anatomy.attention.backends.cpu_attn import CPUAttentionBackend
from vllm_anatomy.attention.backends.torch_ref import TorchReferenceBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchReferenceBackend.name: TorchReferenceBackend,
    CPUAttentionBackend.name: CPUAttentionBackend,
}
# NOTE: imported on first request, not here: importing Triton costs about a
# second, and the kernels' @triton.jit decorators fix at import time whether
# they compile for the GPU or run in the interpreter (TRITON_INTERPRET=1), so
# merely importing this selector must not import them.
_LAZY_BACKENDS: dict[str, tuple[str, str]] = {
    "triton": ("vllm_anatomy.attention.backends.triton_attn", "TritonAttentionBackend"),
}


def get_attn_backend(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS and name in _LAZY_BACKENDS:
        module, cls = _LAZY_BACKENDS[name]
        _BACKENDS[name] = getattr(importlib.import_module(module), cls)
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; "
                         f"available: {', '.join(sorted({*_BACKENDS, *_LAZY_BACKENDS}))}") from None
