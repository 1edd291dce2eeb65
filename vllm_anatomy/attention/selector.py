"""Pick an attention backend by name.

Mirrors vllm/attention/selector.py (get_attn_backend). vLLM chooses among
FLASH_ATTN, FLASHINFER, TRITON_ATTN, ... from the platform, dtype and head
size (see vllm/platforms/cuda.py); here the caller names the backend:
"torch" — the plain-torch reference (CPU default, the oracle).
"""
from __future__ import annotations

from vllm_anatomy.attention.backends.abstract import AttentionBackend
from vllm_anatomy.attention.backends.torch_ref import TorchReferenceBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchReferenceBackend.name: TorchReferenceBackend,
}


def get_attn_backend(name: str) -> type[AttentionBackend]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; "
                         f"available: {', '.join(sorted(_BACKENDS))}") from None
