"""Linear layers that know how to load their own (packed) weights.

Mirrors vllm/model_executor/layers/linear.py. vLLM's names keep the word
"Parallel" because, with tensor parallelism, each GPU holds a slice of the
matrix. We run one shard (tp_size = 1), so "column parallel" just means
"a plain linear", but the weight_loader logic that *packs* several
checkpoint tensors into one matrix is the same and is the point here:

    checkpoint: q_proj [nh*hd, H], k_proj [nkv*hd, H], v_proj [nkv*hd, H]
    ours:       qkv_proj [(nh + 2*nkv) * hd, H]   -> one GEMM instead of three

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)`
attribute; the model's load_weights finds it with getattr and calls it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (casting dtype).

    Mirrors vllm/model_executor/model_loader/weight_utils.py::default_weight_loader.
    """
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs "
                         f"checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """y = x @ W.T (+ b), W: [output_size, input_size] (the checkpoint's layout)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # NOTE: torch.empty (no random init): load_weights overwrites every value,
        # and initialising 100M+ parameters first would cost seconds on a CPU.
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | int | None = None) -> None:
        assert loaded_shard_id is None, f"{type(self).__name__} is not packed"
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, input_size] -> [T, output_size]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}")


class ReplicatedLinear(LinearBase):
    """A plain linear (vLLM: every GPU holds the whole matrix)."""


class RowParallelLinear(LinearBase):
    """vLLM splits its *input* dim across GPUs (o_proj, down_proj); tp=1 here."""


class ColumnParallelLinear(LinearBase):
    """vLLM splits its *output* dim across GPUs; tp=1 here."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears with the same input, stacked on the output dim.

    Used for gate_proj + up_proj -> gate_up_proj (output_sizes = [I, I]).
    Checkpoint tensors arrive one at a time with shard_id 0, 1, ...
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | None = None) -> None:
        if loaded_shard_id is None:          # an already-packed checkpoint
            return default_weight_loader(param, loaded_weight)
        offset = sum(self.output_sizes[:loaded_shard_id])
        size = self.output_sizes[loaded_shard_id]
        # param: [sum(output_sizes), input_size]; write rows [offset, offset + size)
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix: output rows [q | k | v].

    q has total_num_heads * head_size rows, k and v total_num_kv_heads * head_size
    each (fewer under GQA). Checkpoint tensors arrive with shard_id "q", "k", "v".
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.q_size = total_num_heads * head_size
        self.kv_size = self.total_num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | None = None) -> None:
        if loaded_shard_id is None:          # an already-packed checkpoint
            return default_weight_loader(param, loaded_weight)
        offset, size = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[loaded_shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)
