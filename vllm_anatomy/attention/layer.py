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

The attention itself runs through unified_attention_with_output, as in vLLM:
it writes into an output buffer the layer allocated, and it is where a
piecewise CUDA-graph capture breaks (compilation/breakable_cudagraph.py): the
K/V write is captured with the rest of the layer, the attention runs eager.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_anatomy.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionMetadata
from vllm_anatomy.compilation.breakable_cudagraph import eager_break_during_capture


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
                attn_metadata: AttentionMetadata | None, kv_cache_updated: bool = False) -> torch.Tensor:
        """query [T, nh * hd], key/value [T, nkv * hd] -> [T, nh * hd].

        kv_cache_updated: key and value are already in the cache (the model ran
        compilation/qk_norm_rope_kvcache_fusion.py's fused kernel), so no
        do_kv_cache_update here; in vLLM the fusion pass removes this layer's
        unified_kv_cache_update op from the compiled graph instead."""
        num_tokens = query.shape[0]
        if attn_metadata is None or kv_cache is None or kv_cache.numel() == 0:
            # NOTE: a dummy/profiling run (the runner measuring peak memory
            # before the KV cache exists) has no metadata; vLLM then skips
            # attention and returns zeros of the right shape. So do we.
            return torch.zeros_like(query)
        query = query.view(num_tokens, self.num_heads, self.head_size)    # [T, nh, hd]
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)     # [T, nkv, hd]
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if not kv_cache_updated:
            self.impl.do_kv_cache_update(key, value, kv_cache, attn_metadata.slot_mapping,
                                         kernel_timer=attn_metadata.kernel_timer)
        output = torch.empty_like(query)                                   # [T, nh, hd]
        unified_attention_with_output(self.impl, query, key, value, kv_cache, output,
                                      attn_metadata=attn_metadata)
        return output.view(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_size={self.head_size}, "
                f"num_kv_heads={self.num_kv_heads}, scale={self.scale:.4g}, "
                f"backend={self.attn_backend.name}")


@eager_break_during_capture
def unified_attention_with_output(impl: AttentionImpl, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, *,
                                  attn_metadata: AttentionMetadata) -> None:
    """output [T, nh, hd] <- attention of query [T, nh, hd] over the cache (vLLM's custom op of this name).

    key / value [T, nkv, hd]: the step's new K/V (already in the cache), for a
    backend that reads fresh prefills' K/V from them (triton_attn.py).
    NOTE: rows of a padded batch past attn_metadata.num_actual_tokens come out
    zero: at a piecewise replay, query and output have the captured size while
    the step's metadata has the real token count. key and value, like query,
    were written by the graph piece before this op, so a replay finds this
    step's values at the captured addresses."""
    impl.forward(query, kv_cache, attn_metadata, output, key=key, value=value)
