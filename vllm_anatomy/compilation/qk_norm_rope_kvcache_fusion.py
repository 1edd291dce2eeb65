"""Qwen3's q/k norm + RoPE and the layer's KV-cache write in one launch: the seam a model calls.

Mirrors vllm/compilation/passes/fusion/qk_norm_rope_kvcache_fusion.py: vLLM's
QkNormRopeKvCacheFusionPass finds `split -> q_norm -> k_norm -> rotary_embedding
-> unified_kv_cache_update` in the compiled graph of each layer whose attention
impl says fused_qk_norm_rope_kvcache_supported(), and puts the custom op
fused_qk_norm_rope_and_unified_kv_cache_update in its place; that op calls the
impl's do_qk_norm_rope_kvcache_update, and the graph no longer holds the layer's
unified_kv_cache_update, so attention finds K/V already in the cache. The pass
applies only to compile ranges of at most rope_kvcache_fusion_max_token_num (256)
tokens: bigger batches keep the unfused ops.

We have no graph pass, so LlamaAttention asks here, per layer and step
(takes_fused_kvcache_update), and tells its Attention layer that the write is
done (Attention.forward(..., kv_cache_updated=True): no do_kv_cache_update, so no
reshape_and_cache launch for that layer).

NOTE: who takes it, and why it is safe.
- Qwen3's qk-norm path on CUDA with the Triton backend only, with both switches on:
  VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION (the fused q/k norm + RoPE it builds on)
  and VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE (this one; on by default since an H100 A/B
  measured +1.2-1.4 % tok/s, bench/results/throughput_ab_fuse_kv_h100.json; bit-equal to
  the unfused pair, in the interpreter and compiled on that card),
  read when the model is built. vLLM enables its pass only on ROCm with AITER; ours
  is a Triton kernel, so it runs wherever our Triton backend does.
- Llama (SmolLM2, the lessons' default model) has no q/k norm: it keeps
  rotary_embedding + reshape_and_cache (and its traces their
  GPU.kernel.reshape_and_cache spans) unless VLLM_ANATOMY_FUSE_ROPE_KVCACHE is on
  (off by default): then vLLM's sibling for RoPE without the norm,
  rope_kvcache_fusion.py, does the same for its rotary_embedding.
- The CPU and the torch backend never take it (the torch backend does not support it).
- The threshold (rope_kvcache_fusion.py's: vLLM has one pass_config field for both
  passes) is on qkv.shape[0], a host int: under CUDA graphs the captured (padded)
  batch size, the same at capture and at every replay, so a graph always replays
  the path it was captured with. A step of more than 256 tokens (a prefill)
  runs fused_qk_norm_rope and then the backend's reshape_and_cache, as before.
- Traces: at level full the fused launch is timed as GPU.kernel.fused_qk_norm_rope_kvcache,
  whose attributes name the cache write it holds (vllm_anatomy.kv_cache_update =
  "slot_mapping"); that layer then has no GPU.kernel.reshape_and_cache span.
"""
from __future__ import annotations

import torch

from vllm_anatomy import envs
from vllm_anatomy.attention.backends.abstract import AttentionMetadata
from vllm_anatomy.attention.layer import Attention
from vllm_anatomy.compilation.rope_kvcache_fusion import fits_rope_kvcache_fusion


def fuse_qk_norm_rope_kvcache_enabled() -> bool:
    """VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE (default 1), read when the model is built."""
    return bool(envs.VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE)


def takes_fused_kvcache_update(attn: Attention, qkv: torch.Tensor, kv_cache: torch.Tensor | None,
                               attn_metadata: AttentionMetadata | None) -> bool:
    """Whether this layer's step goes through fused_qk_norm_rope_and_unified_kv_cache_update
    (the model's switches were checked when it was built)."""
    return (_on_device(qkv) and attn.impl.fused_qk_norm_rope_kvcache_supported()
            and fits_rope_kvcache_fusion(qkv, kv_cache, attn_metadata))


def fused_qk_norm_rope_and_unified_kv_cache_update(
        attn: Attention, qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
        k_weight: torch.Tensor, rms_norm_eps: float, cos_sin_cache: torch.Tensor, is_neox: bool,
        kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
    """vLLM's custom op of this name: q/k norm + RoPE in place on qkv, and K/V into the layer's
    cache at the step's slot_mapping, by the attention impl (do_qk_norm_rope_kvcache_update)."""
    attn.impl.do_qk_norm_rope_kvcache_update(qkv, positions, q_weight, k_weight, rms_norm_eps,
                                             cos_sin_cache, is_neox, kv_cache, attn_metadata.slot_mapping,
                                             kernel_timer=attn_metadata.kernel_timer)


def _on_device(qkv: torch.Tensor) -> bool:
    # (a function of its own so that CPU tests can run the seam in Triton's interpreter)
    return qkv.is_cuda
