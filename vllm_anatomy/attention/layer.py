"""The Attention layer a model calls: write K/V into the paged cache, then attend.

Mirrors vllm/model_executor/layers/attention/attention.py (Attention) and the
custom ops behind it (unified_kv_cache_update, unified_attention_with_output).
The model hands over flat [T, heads * head_dim] projections;
this layer reshapes them to [T, heads, head_dim], lets the backend scatter
the new K/V into the cache at `slot_mapping` (do_kv_cache_update), and then
runs the backend's attention, which reads K/V back *from the cache*.

NOTE: vLLM V1 finds the layer's kv_cache and the step's attn_metadata through
a global "forward context" (set_forward_context / bind_kv_cache), so model
code never passes them around. We pass them as arguments instead: the data
flow from the runner to this layer is then visible in every signature.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_anatomy.attention.backends.abstract import AttentionBackend, AttentionMetadata


class Attention(nn.Module):

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 attn_backend: type[AttentionBackend], prefix: str = "") -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_name = prefix
        self.attn_backend = attn_backend
        self.impl = attn_backend.get_impl_cls()(num_heads, head_size, num_kv_heads, scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor | None,
                attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        """query [T, nh * hd], key/value [T, nkv * hd] -> [T, nh * hd]."""
        num_tokens = query.shape[0]
        if attn_metadata is None or kv_cache is None or kv_cache.numel() == 0:
            # NOTE: a dummy/profiling run (the runner measuring peak memory
            # before the KV cache exists) has no metadata; vLLM then skips
            # attention and returns zeros of the right shape. So do we.
            return torch.zeros_like(query)
        query = query.view(num_tokens, self.num_heads, self.head_size)    # [T, nh, hd]
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)     # [T, nkv, hd]
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        self.impl.do_kv_cache_update(key, value, kv_cache, attn_metadata.slot_mapping,
                                     kernel_timer=attn_metadata.kernel_timer)
        output = self.impl.forward(query, kv_cache, attn_metadata)        # [T, nh, hd]
        return output.view(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_size={self.head_size}, "
                f"num_kv_heads={self.num_kv_heads}, scale={self.scale:.4g}, "
                f"backend={self.attn_backend.name}")
