"""Linear layers split across the tensor-parallel ranks, each loading its own slice.

Mirrors vllm/model_executor/layers/linear.py. With N ranks (tp_size), a
Llama layer's matrices are cut the Megatron way, so that one layer costs two
all-reduces and nothing else:

    ColumnParallelLinear   W [out, in] split by rows (output features): rank r
                           holds W[r*out/N : (r+1)*out/N, :] and computes its
                           slice of y, no communication.
    RowParallelLinear      W split by columns (input features): rank r holds
                           W[:, r*in/N : (r+1)*in/N], multiplies its slice of
                           x, and the partial sums are all-reduced.

    attention: qkv_proj (column: each rank owns whole heads) -> attention on
               those heads (no communication: heads are independent) -> o_proj (row)
    mlp:       gate_up_proj (column) -> SiLU*mul (elementwise) -> down_proj (row)

With tp_size = 1 every class is a plain linear, and the weight_loader logic
that *packs* several checkpoint tensors into one matrix is the point:

    checkpoint: q_proj [nh*hd, H], k_proj [nkv*hd, H], v_proj [nkv*hd, H]
    ours:       qkv_proj [(nh + 2*nkv) * hd / N, H]   -> one GEMM instead of three

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)`
attribute; the model's load_weights finds it with getattr and calls it. A
`loaded_weight` is a tensor or, when the ranks share the work, a safetensors
slice (loader.py): narrow_weight() then reads only this rank's rows or columns
from the file.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm_anatomy.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm_anatomy.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)
from vllm_anatomy.distributed.utils import divide


def weight_shape(loaded_weight: Any) -> tuple[int, ...]:
    """The shape of a checkpoint tensor or of a safetensors slice (not yet read)."""
    if isinstance(loaded_weight, torch.Tensor):
        return tuple(loaded_weight.shape)
    return tuple(loaded_weight.get_shape())


def narrow_weight(loaded_weight: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """loaded_weight[start : start + size] along `dim`.

    NOTE: on a safetensors slice this reads only those bytes from the
    checkpoint (a rank of N reads ~1/N of each split matrix); on a tensor it is
    a view."""
    if isinstance(loaded_weight, torch.Tensor):
        return loaded_weight.narrow(dim, start, size)
    index = [slice(None)] * len(loaded_weight.get_shape())
    index[dim] = slice(start, start + size)
    return loaded_weight[tuple(index)]


def set_weight_loader(param: nn.Parameter, weight_loader: Callable[..., None]) -> None:
    """`param.weight_loader = weight_loader`, where load_weights looks for it
    (vLLM: set_weight_attrs(param, {"weight_loader": ...}))."""
    setattr(param, "weight_loader", weight_loader)


def default_weight_loader(param: torch.Tensor, loaded_weight: Any) -> None:
    """Copy a whole checkpoint tensor into a parameter of the same shape (casting dtype).

    Mirrors vllm/model_executor/model_loader/weight_utils.py::default_weight_loader.
    """
    if weight_shape(loaded_weight) != tuple(param.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs "
                         f"checkpoint {weight_shape(loaded_weight)}")
    if not isinstance(loaded_weight, torch.Tensor):
        loaded_weight = loaded_weight[:]          # read the slice whole (a replicated weight)
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """y = x @ W.T (+ b), W: [output_size, input_size] (the checkpoint's layout).

    This rank holds W's [output_size_per_partition, input_size_per_partition]
    part (the whole of it when tp_size = 1)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition, self.output_size_per_partition = self.partition_sizes()
        # NOTE: torch.empty (no random init): load_weights overwrites every value,
        # and initialising 100M+ parameters first would cost seconds on a CPU.
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, self.input_size_per_partition))
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.bias_size()))
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def partition_sizes(self) -> tuple[int, int]:
        """(input, output) features this rank holds."""
        return self.input_size, self.output_size

    def bias_size(self) -> int:
        return self.output_size_per_partition

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any,
                      loaded_shard_id: str | int | None = None) -> None:
        assert loaded_shard_id is None, f"{type(self).__name__} is not packed"
        default_weight_loader(param, loaded_weight)

    # x @ W.T (+ b). NOTE: on a CPU, loading swaps in oneDNN on a prepacked copy of
    # the weight (layers/utils.py: dispatch_cpu_unquantized_gemm, vLLM's name); on CUDA,
    # per VLLM_ANATOMY_SKINNY_GEMM, a split-K kernel for few tokens (same file).
    gemm = staticmethod(F.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, input_size_per_partition] -> [T, output_size_per_partition]
        return self.gemm(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size_per_partition}, out_features={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: y_r = x @ W_r.T, this rank's slice of y.

    NOTE: no gather (vLLM's gather_output=False, what every Llama layer uses):
    the next op consumes the slice as it is (attention on this rank's heads,
    SiLU*mul on this rank's features), and a RowParallelLinear closes the pair.
    """

    def partition_sizes(self) -> tuple[int, int]:
        return self.input_size, divide(self.output_size, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any,
                      loaded_shard_id: str | int | None = None) -> None:
        assert loaded_shard_id is None, f"{type(self).__name__} is not packed"
        size = param.shape[0]                               # rows of W (or of b) on this rank
        default_weight_loader(param, narrow_weight(loaded_weight, 0, self.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed by an all-reduce.

    x arrives already split (the column-parallel layer before produced only
    this rank's features): y = sum_r x_r @ W_r.T, one all-reduce of [T, H].
    NOTE: why the all-reduce comes *after* the matmul: each rank's product
    x_r @ W_r.T is a full-size [T, H] partial sum; summing those is the only
    exchange the pair (column, row) needs. Gathering x first would move the
    same bytes and then repeat the whole matmul on every rank.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        self.reduce_results = reduce_results
        super().__init__(input_size, output_size, bias)

    def partition_sizes(self) -> tuple[int, int]:
        return divide(self.input_size, self.tp_size), self.output_size

    def bias_size(self) -> int:
        return self.output_size                              # whole: added once, after the sum

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any,
                      loaded_shard_id: str | int | None = None) -> None:
        assert loaded_shard_id is None, f"{type(self).__name__} is not packed"
        if param is self.bias:
            return default_weight_loader(param, loaded_weight)
        size = self.input_size_per_partition                # columns of W on this rank
        default_weight_loader(param, narrow_weight(loaded_weight, 1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, input_size / N] -> [T, output_size]
        # NOTE: only rank 0 adds the bias: the all-reduce sums it once, not N times.
        bias = self.bias if self.tp_rank == 0 else None
        output = self.gemm(x, self.weight, bias)
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output)
        return output


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears with the same input, stacked on the output dim.

    Used for gate_proj + up_proj -> gate_up_proj (output_sizes = [I, I]); each
    rank holds [gate_r | up_r], I/N rows of each, so that SiLU(gate) * up
    pairs matching features on the same rank. Checkpoint tensors arrive one at
    a time with shard_id 0, 1, ...
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any,
                      loaded_shard_id: str | int | None = None) -> None:
        assert not isinstance(loaded_shard_id, str), "a merged layer's shards are numbered"
        if loaded_shard_id is None:          # an already-packed checkpoint
            if self.tp_size > 1:
                raise ValueError("a pre-packed gate_up_proj cannot be split across ranks here")
            return default_weight_loader(param, loaded_weight)
        tp_size = self.tp_size
        offset = sum(self.output_sizes[:loaded_shard_id]) // tp_size
        size = self.output_sizes[loaded_shard_id] // tp_size
        # param: [sum(output_sizes) / N, input_size]; rows [offset, offset + size)
        # take the checkpoint's rows [rank * size, (rank + 1) * size)
        shard = narrow_weight(loaded_weight, 0, self.tp_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; each rank holds whole heads: [q_r | k_r | v_r].

    Rank r holds query heads [r*nh/N, (r+1)*nh/N) and the KV heads they attend
    with (grouped-query attention: query head h uses KV head h // (nh / nkv)).
    NOTE: KV heads are *replicated* when N > total_num_kv_heads: a rank needs
    at least one KV head for its query heads, so each KV head is held by
    N / nkv ranks (num_kv_head_replicas), every copy loaded from the same
    checkpoint rows. The KV cache then stores that head on each of those
    ranks: the price of splitting the queries further than the keys.
    Checkpoint tensors arrive with shard_id "q", "k", "v".
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size              # this rank's
        self.kv_size = self.num_kv_heads * head_size
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any,
                      loaded_shard_id: str | int | None = None) -> None:
        assert not isinstance(loaded_shard_id, int), "the QKV layer's shards are named q, k, v"
        if loaded_shard_id is None:          # an already-packed checkpoint
            if self.tp_size > 1:
                raise ValueError("a pre-packed qkv_proj cannot be split across ranks here")
            return default_weight_loader(param, loaded_weight)
        # (offset in this rank's rows, rows, which copy of the checkpoint's heads)
        offset, size, shard_rank = {
            "q": (0, self.q_size, self.tp_rank),
            "k": (self.q_size, self.kv_size, self.tp_rank // self.num_kv_head_replicas),
            "v": (self.q_size + self.kv_size, self.kv_size, self.tp_rank // self.num_kv_head_replicas),
        }[loaded_shard_id]
        shard = narrow_weight(loaded_weight, 0, shard_rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)
