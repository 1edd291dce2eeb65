"""fused_rope_kvcache: Llama's RoPE in place on qkv, and the step's K/V into the paged cache, in one launch.

Mirrors the fused op that v0.27.1's RopeKVCacheFusionPass (vllm/compilation/
passes/fusion/rope_kvcache_fusion.py, pass_config.fuse_rope_kvcache) puts in
place of `split -> rotary_embedding -> unified_kv_cache_update`:
fused_rope_and_unified_kv_cache_update, which calls the attention impl's
do_rope_and_kv_cache_update (there on ROCm only, AITER's triton_rope_and_cache,
for batches of at most rope_kvcache_fusion_max_token_num = 256 tokens). Here:
what rotary_embedding.py does, and then what reshape_and_cache.py does with its
result, so the results are those of the pair, bit for bit:

    qkv          q and k columns rotated in place (v untouched), the values
                 rotary_embedding returns (the same rounding, op for op);
    key_cache    row of slot_mapping[t] <- token t's rotated k;
    value_cache  row of slot_mapping[t] <- token t's v columns of qkv;
                 slot -1 (a padding token of a CUDA-graph-sized batch): no write.

The kernel is fused_qk_norm_rope_kvcache.py's with APPLY_NORM off (no norm
weights): the same grid, the same cache write, the same RoPE helper, which then
rotates the loaded values themselves. Memory layout: as there, without the
weights.

Differences from the unfused pair the caller sees: q and k stay column views of
qkv (rotary_embedding returns new contiguous tensors); attention and the cache
write read them strided, as they read Qwen3's after fused_qk_norm_rope.
"""
from __future__ import annotations

import torch

from vllm_anatomy.kernels.fused_qk_norm_rope_kvcache import launch_kvcache_kernel


def fused_rope_kvcache(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                       head_dim: int, cos_sin_cache: torch.Tensor, is_neox: bool,
                       position_ids: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, *, pdl: bool = False) -> None:
    """RoPE on the q and k heads of qkv [T, (nq + nk + nv) * head_dim] in place, then k and v of
    each token into key_cache/value_cache [num_blocks, block_size, nk, hd] at slot_mapping[:T]
    (-1 skipped).

    vLLM's do_rope_and_kv_cache_update, whose query/key/value are column views of one qkv
    here (passed as qkv itself, as do_qk_norm_rope_kvcache_update passes it).
    pdl: the VLLM_ANATOMY_PDL switch as the caller read it (kernels/pdl.py; same results).
    """
    launch_kvcache_kernel(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, 0.0, None, None,
                          cos_sin_cache, is_neox, position_ids, key_cache, value_cache, slot_mapping, pdl)


def fused_rope_kvcache_ref(qkv: torch.Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                           head_dim: int, cos_sin_cache: torch.Tensor, is_neox: bool,
                           position_ids: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
    """The unfused pair it replaces, as the layer and the backend launch them: rotary_embedding
    of qkv's q and k columns (its new tensors copied back into qkv), then reshape_and_cache of
    the rotated k and qkv's v."""
    from vllm_anatomy.kernels.reshape_and_cache import reshape_and_cache
    from vllm_anatomy.kernels.rotary_embedding import rotary_embedding
    num_tokens, q_size, kv_size = qkv.shape[0], num_heads_q * head_dim, num_heads_k * head_dim
    q, k, v = qkv.split([q_size, kv_size, num_heads_v * head_dim], dim=-1)
    q_out, k_out = rotary_embedding(position_ids, q, k, cos_sin_cache, head_dim, is_neox)
    reshape_and_cache(k_out.view(num_tokens, num_heads_k, head_dim), v.view(num_tokens, num_heads_v, head_dim),
                      key_cache, value_cache, slot_mapping)
    q.copy_(q_out)
    k.copy_(k_out)
