"""Token embedding and the LM head.

Mirrors vllm/model_executor/layers/vocab_parallel_embedding.py. vLLM shards
the vocabulary across GPUs (and pads it to a multiple of 64); with one shard
and no padding both classes reduce to a lookup table and a matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_anatomy.model_executor.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] long -> [T, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, hidden [N, H] -> logits [N, V].

    It is an embedding table used backwards: logits = hidden @ weight.T.
    NOTE: forward() is deliberately not defined (as in vLLM): the logits are
    computed by the model's compute_logits, only for the rows that need them.
    """

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share the embedding's weight (tie_word_embeddings): one tensor, two uses."""
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by compute_logits, not called")
