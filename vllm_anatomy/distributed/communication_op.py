"""The collectives a model layer calls, on the tensor-parallel group.

Mirrors vllm/distributed/communication_op.py: thin wrappers so that layer code
reads `tensor_model_parallel_all_reduce(x)` and never handles a group.
"""
from __future__ import annotations

import torch

from vllm_anatomy.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks (in place); every rank gets the sum."""
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the TP ranks' tensors along `dim`, in rank order; every rank gets it."""
    return get_tp_group().all_gather(input_, dim)
