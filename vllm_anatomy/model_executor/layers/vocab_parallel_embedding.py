"""Token embedding and the LM head, split by vocabulary rows across the ranks.

Mirrors vllm/model_executor/layers/vocab_parallel_embedding.py. Rank r holds
rows [r * V/N, (r+1) * V/N) of the [V, H] table:

    VocabParallelEmbedding  ids outside this rank's rows look up nothing (zeros);
                            an all-reduce adds the N partial lookups, in which
                            exactly one rank contributed each token's row.
    ParallelLMHead          logits_r = hidden @ W_r.T is this rank's V/N
                            columns of the logits; the model all-gathers them.

Simplified: vLLM pads the vocabulary to a multiple of 64 per rank (and
handles LoRA's added tokens); we require V to divide by N (EngineArgs checks,
with every other divisibility, before anything starts).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_anatomy.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm_anatomy.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)
from vllm_anatomy.distributed.utils import divide
from vllm_anatomy.model_executor.layers.linear import default_weight_loader, narrow_weight, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] long -> [T, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any) -> None:
        rows = narrow_weight(loaded_weight, 0, self.vocab_start_index, self.num_embeddings_per_partition)
        default_weight_loader(param, rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # NOTE: a masked lookup. Ids of other ranks' rows are pointed at row 0
        # (any valid row) and their results zeroed, so that the all-reduce
        # adds exactly one real row per token: T x H floats cross the wire,
        # while gathering the table would move V x H.
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)   # [T]
        local_ids = (input_ids - self.vocab_start_index) * in_range                            # [T]
        output = F.embedding(local_ids, self.weight)                                           # [T, H]
        output.masked_fill_(~in_range.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(output)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings_per_partition}, embedding_dim={self.embedding_dim}, "
                f"vocab=[{self.vocab_start_index}, {self.vocab_end_index}), tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, hidden [N, H] -> this rank's logits [N, V / tp_size].

    It is an embedding table used backwards: logits = hidden @ weight.T.
    NOTE: forward() is deliberately not defined (as in vLLM): the logits are
    computed by the model's compute_logits, only for the rows that need them,
    and gathered there across the ranks.
    """

    # hidden @ weight.T; on a CPU, oneDNN on a prepacked copy (layers/utils.py), as LinearBase.gemm
    # (and, as there, the skinny split-K kernel on CUDA per VLLM_ANATOMY_SKINNY_GEMM).
    gemm = staticmethod(F.linear)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share the embedding's weight (tie_word_embeddings): one tensor, two uses
        (with N ranks, the same V/N rows on each rank)."""
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by compute_logits, not called")
