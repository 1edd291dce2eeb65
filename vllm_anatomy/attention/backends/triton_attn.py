"""The Triton attention backend: reshape_and_cache + unified_attention.

Mirrors vllm/v1/attention/backends/triton_attn.py (TritonAttentionBackend,
TritonAttentionImpl). Same contract as the torch reference backend
(torch_ref.py): do_kv_cache_update scatters the step's new K/V into the paged
cache, then forward reads K/V only from the cache. One kernel launch each,
whatever mix of prefill chunks and decodes the batch holds.

Simplified here: vLLM's Triton backend views the cache as
[num_blocks, num_kv_heads, block_size, 2 * head_size] and transposes it; we
keep abstract.py's [2, num_blocks, block_size, num_kv_heads, head_dim] (the
FlashAttention layout) for every backend, so kv_cache[0] / kv_cache[1] are the
key / value caches directly. No sliding window, softcap, alibi, sinks, fp8 or
split-KV (3D) decode kernel.

On a machine without CUDA the kernels run in Triton's interpreter: only when
TRITON_INTERPRET=1 was set before vllm_anatomy.kernels was imported (tests do
that in tests/kernels/conftest.py). It is slow; the CPU default stays "torch".
"""
from __future__ import annotations

import torch

from vllm_anatomy.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
)
from vllm_anatomy.kernels import reshape_and_cache as rc
from vllm_anatomy.kernels import unified_attention as ua
from vllm_anatomy.tracing.runner_tracer import NULL_KERNEL_TIMER


class TritonAttentionImpl(AttentionImpl):

    def do_kv_cache_update(self, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kernel_timer=NULL_KERNEL_TIMER) -> None:
        """key, value: [T, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, nkv, hd]."""
        key_cache, value_cache = kv_cache.unbind(0)        # views: [num_blocks, block_size, nkv, hd]
        with kernel_timer.kernel("reshape_and_cache", lambda: self._cache_launch_attrs(key)):
            rc.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                output: torch.Tensor) -> torch.Tensor:
        """query [T, num_heads, head_dim] -> output [T, num_heads, head_dim] (written in place)."""
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        # NOTE: rows past num_actual_tokens are padding (a CUDA-graph-sized
        # batch); the kernel never writes them. Zero them so that the output
        # equals the torch reference everywhere (a slice by a host int: no sync).
        output[num_actual_tokens:].zero_()
        with attn_metadata.kernel_timer.kernel("unified_attention",
                                               lambda: self._attention_launch_attrs(query, attn_metadata)):
            ua.unified_attention(
                q=query[:num_actual_tokens], key_cache=key_cache, value_cache=value_cache,
                out=output[:num_actual_tokens],
                cu_seqlens_q=attn_metadata.query_start_loc, max_seqlen_q=attn_metadata.max_query_len,
                seqused_k=attn_metadata.seq_lens, max_seqlen_k=attn_metadata.max_seq_len,
                softmax_scale=self.scale, block_table=attn_metadata.block_table)
        return output

    # The launch attributes a timed kernel's span carries, from host-side values only (no device read).
    def _cache_launch_attrs(self, key: torch.Tensor) -> dict:
        num_tokens = key.shape[0]
        return {"vllm_anatomy.grid": list(rc.launch_grid(num_tokens, self.num_kv_heads, self.head_dim)),
                "vllm_anatomy.num_tokens": num_tokens,
                # read K and V, write them into the cache, read the slots
                "vllm_anatomy.bytes": 4 * key.numel() * key.element_size() + 8 * num_tokens}

    def _attention_launch_attrs(self, query: torch.Tensor, attn_metadata: AttentionMetadata) -> dict:
        num_tokens = attn_metadata.num_actual_tokens
        item = query.element_size()
        seq_lens_cpu = attn_metadata.seq_lens_cpu
        num_keys = int(seq_lens_cpu.sum()) if seq_lens_cpu is not None else 0
        # Q read + O written, and every request's K and V read once (GQA packed).
        moved = (2 * num_tokens * self.num_heads * self.head_dim * item
                 + 2 * num_keys * self.num_kv_heads * self.head_dim * item)
        grid = ua.default_grid(num_tokens, attn_metadata.num_reqs, self.num_heads, self.num_kv_heads,
                               self.head_dim, attn_metadata.max_query_len)
        return {"vllm_anatomy.grid": list(grid), "vllm_anatomy.num_tokens": num_tokens,
                "vllm_anatomy.num_reqs": attn_metadata.num_reqs, "vllm_anatomy.bytes": moved}


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl
