"""RoPE and the layer's KV-cache write in one launch, for models without q/k norm (Llama): the seam a model calls.

Mirrors vllm/compilation/passes/fusion/rope_kvcache_fusion.py: vLLM's
RopeKVCacheFusionPass finds `split -> rotary_embedding -> unified_kv_cache_update`
(RopeReshapeKVCachePattern, both RoPE styles) in the compiled graph of each layer
whose attention impl says fused_rope_kvcache_supported(), and puts the custom op
fused_rope_and_unified_kv_cache_update in its place; that op calls the impl's
do_rope_and_kv_cache_update, and the graph no longer holds the layer's
unified_kv_cache_update. The pass applies only to compile ranges of at most
pass_config.rope_kvcache_fusion_max_token_num (256) tokens: bigger batches (a
prefill, compute-bound) keep the two kernels. Its switch is
pass_config.fuse_rope_kvcache (there ROCm only); ours is
VLLM_ANATOMY_FUSE_ROPE_KVCACHE, off by default (see below).

We have no graph pass, so LlamaAttention asks here, per layer and step
(takes_fused_rope_kvcache_update), and tells its Attention layer that the write
is done (Attention.forward(..., kv_cache_updated=True)). Qwen3's q/k norm sibling,
which vLLM lets supersede this one: qk_norm_rope_kvcache_fusion.py.

NOTE: why the attention layer may skip its own write, and why the result is exact.
- The write is not dropped, it moved: the fused launch stores each token's rotated
  k and its v at slot_mapping[t] of this layer's cache, the slots
  do_kv_cache_update would have used (the same step's metadata), before
  attention runs (the same stream, launched first). So the cache attention reads
  holds what it would have held; padding tokens (slot -1) are written by neither.
- Bit for bit: the kernel (kernels/fused_rope_kvcache.py) rotates with
  rotary_embedding's rounding, op for op, and stores the rounded values both
  into qkv and into the cache, converted as reshape_and_cache converts them;
  v is copied unchanged. So q, k, v handed to attention and the cache are the
  unfused pair's (tests/kernel_tests/test_fused_rope_kvcache.py); greedy tokens
  cannot change.
- The threshold is on qkv.shape[0], a host int: under CUDA graphs the captured
  (padded) batch size, the same at capture and at every replay, so a graph
  always replays the path it was captured with.

Who takes it: a layer without q/k norm (Llama, Qwen2; built with the switch on),
CUDA tensors, the Triton backend, a step with a cache and metadata (not a dummy
run), at most 256 tokens. Never the CPU nor the torch backend. Qwen3 does not
(its q/k norm + RoPE (+ KV) fusion comes first; vLLM's pattern would also match
Qwen3 with that fusion off, after separate norms, which we do not fuse).

Off by default: the Qwen3 sibling, which also takes one reshape_and_cache launch
per layer away, gained 1.2-1.4 % tok/s on an H100; whether the same holds for
Llama's shapes (9 q / 3 KV heads of 64 in SmolLM2-135M) only a GPU A/B can say
(bench/throughput_ab.py with --a-env/--b-env VLLM_ANATOMY_FUSE_ROPE_KVCACHE=0/1).

Traces: at level full the fused launch is timed as GPU.kernel.fused_rope_kvcache,
whose attributes name the cache write it holds (vllm_anatomy.kv_cache_update =
"slot_mapping"); that layer then has no GPU.kernel.reshape_and_cache span.
"""
from __future__ import annotations

import torch

from vllm_anatomy import envs
from vllm_anatomy.attention.backends.abstract import AttentionMetadata
from vllm_anatomy.attention.layer import Attention

# vLLM's pass_config.rope_kvcache_fusion_max_token_num (this pass's and the q/k norm sibling's).
ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM = 256


def fuse_rope_kvcache_enabled() -> bool:
    """VLLM_ANATOMY_FUSE_ROPE_KVCACHE (default 0), read when the model is built."""
    return bool(envs.VLLM_ANATOMY_FUSE_ROPE_KVCACHE)


def fits_rope_kvcache_fusion(qkv: torch.Tensor, kv_cache: torch.Tensor | None,
                             attn_metadata: AttentionMetadata | None) -> bool:
    """A step either KV-cache fusion may take: a real forward (a cache and metadata, not a dummy
    run) of at most ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM tokens (vLLM's is_applicable_for_range)."""
    return (attn_metadata is not None and kv_cache is not None and kv_cache.numel() > 0
            and qkv.shape[0] <= ROPE_KVCACHE_FUSION_MAX_TOKEN_NUM)


def takes_fused_rope_kvcache_update(attn: Attention, qkv: torch.Tensor, kv_cache: torch.Tensor | None,
                                    attn_metadata: AttentionMetadata | None) -> bool:
    """Whether this layer's step goes through fused_rope_and_unified_kv_cache_update
    (the model's switch was checked when it was built)."""
    return (_on_device(qkv) and attn.impl.fused_rope_kvcache_supported()
            and fits_rope_kvcache_fusion(qkv, kv_cache, attn_metadata))


def fused_rope_and_unified_kv_cache_update(attn: Attention, qkv: torch.Tensor, positions: torch.Tensor,
                                           cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor,
                                           attn_metadata: AttentionMetadata) -> None:
    """vLLM's custom op of this name: RoPE in place on qkv's q and k columns, and K/V into the
    layer's cache at the step's slot_mapping, by the attention impl (do_rope_and_kv_cache_update).
    (vLLM hands query, key, value views of qkv; here qkv itself, as the q/k norm sibling does.)"""
    attn.impl.do_rope_and_kv_cache_update(qkv, positions, cos_sin_cache, is_neox, kv_cache,
                                          attn_metadata.slot_mapping, kernel_timer=attn_metadata.kernel_timer)


def _on_device(qkv: torch.Tensor) -> bool:
    # (a function of its own so that CPU tests can run the seam in Triton's interpreter)
    return qkv.is_cuda
