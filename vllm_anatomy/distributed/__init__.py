"""Tensor parallelism over torch.distributed (vLLM: vllm/distributed/), and KV cache events (kv_events.py).

NOTE: the tensor-parallel names load on first use (PEP 562), so that the pure
core, which imports distributed.kv_events, does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "tensor_model_parallel_all_gather": "communication_op", "tensor_model_parallel_all_reduce": "communication_op",
    "destroy_distributed_environment": "parallel_state", "destroy_model_parallel": "parallel_state",
    "get_tensor_model_parallel_rank": "parallel_state", "get_tensor_model_parallel_world_size": "parallel_state",
    "get_tp_group": "parallel_state", "get_world_group": "parallel_state",
    "init_distributed_environment": "parallel_state", "initialize_model_parallel": "parallel_state",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
