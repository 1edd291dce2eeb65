"""The attention-backend interface and the metadata every backend reads.

Mirrors vllm/v1/attention/backend.py (CommonAttentionMetadata, AttentionBackend,
AttentionImpl). One flat batch mixes prefill chunks and decodes; nothing here
knows about "phases" — a decode is just a sequence whose query_len is 1.

KV cache layout (one tensor per layer), as vLLM's FlashAttention backend:
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache[0] = keys, kv_cache[1] = values.
A token at position p of a request lives in slot
    slot = block_table[req, p // block_size] * block_size + p % block_size
i.e. kv_cache[:, slot // block_size, slot % block_size].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_anatomy.tracing.runner_tracer import NULL_KERNEL_TIMER

PAD_SLOT_ID = -1


@dataclass
class AttentionMetadata:
    num_actual_tokens: int          # T: real tokens (the rest of a padded batch is padding)
    num_reqs: int                   # R
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor   # [R + 1] int32, cumulative query lengths, starts at 0
    seq_lens: torch.Tensor          # [R] int32, context + query length of each request
    block_table: torch.Tensor       # [R, max_blocks_per_req] int32 physical block ids
    slot_mapping: torch.Tensor      # [T(+padding)] int64, -1 = padding (not written)
    # CPU copies of the small index tensors, for backends that loop on the host
    # (the torch reference backend). Never read by GPU kernels.
    query_start_loc_cpu: torch.Tensor | None = None
    # [R] the exact host copy of seq_lens, or None where only the device knows them
    # (the padded drafter batch's decode forwards). Read it through the seq_lens_cpu
    # property (which copies from the device when it is None), or read this field
    # directly where a device read must not happen.
    _seq_lens_cpu: torch.Tensor | None = None
    # [R] a host upper bound of seq_lens: exact wherever _seq_lens_cpu is set; in the
    # padded drafter batch's decode forwards (async scheduling) it assumes every draft
    # was accepted, since only the device knows how many were rejected.
    # NOTE: v0.27.1's wording: "precise for prefill rows and for all rows outside async
    # spec decode; optimistic for async-spec decode rows". Fit to size a buffer or to
    # count bytes for a trace; never to mask keys, where a row's exact length is needed.
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    # Each kernel launch runs inside `with kernel_timer.kernel(...)`: the
    # DeviceTimer when a full trace times launches (an eager step on a GPU;
    # never inside a CUDA graph), else a null timer whose `with` does nothing.
    kernel_timer: Any = field(default=NULL_KERNEL_TIMER)
    # The Triton backend's split of this step into fresh prefills and the rest
    # (((block_q, sdpa_min_len, min_len), PrefillSplit | None), prefill_split.py), computed
    # by the first layer that asks and reused by the others; None until then.
    prefill_split: Any = None
    # [R] int32 on the device, or None: the order in which the Triton backend's 2D kernel
    # runs a decode-only step's requests (longest context first; a view of the runner's
    # persistent buffer, so a captured graph replays it: attention/backends/decode_order.py).
    # Set by the model runner for decode-only steps only; it never changes a result.
    decode_seq_order: torch.Tensor | None = None

    @property
    def seq_lens_cpu(self) -> torch.Tensor:
        """seq_lens on the host: the exact copy, or (once, then kept) a copy from the device.

        NOTE: as v0.27.1's (deprecated) CommonAttentionMetadata.seq_lens_cpu:
        without a host copy this waits for the device (a sync on a GPU), so a
        backend that loops on the host reads the device once per forward, not
        once per layer; the runner and the drafter fill _seq_lens_cpu wherever
        the host knows the values, and then nothing waits."""
        if self._seq_lens_cpu is None:
            self._seq_lens_cpu = self.seq_lens.to("cpu")
        return self._seq_lens_cpu


class AttentionImpl:
    """One attention computation for one layer."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    def do_kv_cache_update(self, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kernel_timer: Any = NULL_KERNEL_TIMER) -> None:
        """Scatter new K/V ([T, num_kv_heads, head_dim]) into the paged cache (skip slot -1).

        kernel_timer: AttentionMetadata.kernel_timer, for backends that launch kernels."""
        raise NotImplementedError

    def fused_qk_norm_rope_kvcache_supported(self) -> bool:
        """Whether do_qk_norm_rope_kvcache_update exists here (vLLM's name; only the Triton backend's)."""
        return False

    def do_qk_norm_rope_kvcache_update(self, qkv: torch.Tensor, positions: torch.Tensor,
                                       q_weight: torch.Tensor, k_weight: torch.Tensor, rms_norm_eps: float,
                                       cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor,
                                       slot_mapping: torch.Tensor, kernel_timer: Any = NULL_KERNEL_TIMER) -> None:
        """Qwen3's q/k norm + RoPE in place on qkv [T, (nh + 2 nkv) * hd], and the step's K/V
        into kv_cache at slot_mapping: do_kv_cache_update's work, done ahead of forward
        (compilation/qk_norm_rope_kvcache_fusion.py)."""
        raise NotImplementedError

    def fused_rope_kvcache_supported(self) -> bool:
        """Whether do_rope_and_kv_cache_update exists here (vLLM's name; only the Triton backend's)."""
        return False

    def do_rope_and_kv_cache_update(self, qkv: torch.Tensor, positions: torch.Tensor,
                                    cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor,
                                    slot_mapping: torch.Tensor, kernel_timer: Any = NULL_KERNEL_TIMER) -> None:
        """RoPE in place on qkv's q and k columns [T, (nh + 2 nkv) * hd] (a model without q/k norm),
        and the step's K/V into kv_cache at slot_mapping: do_kv_cache_update's work, done ahead of
        forward (compilation/rope_kvcache_fusion.py)."""
        raise NotImplementedError

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                output: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, num_heads, head_dim] -> output [T, num_heads, head_dim], written in place
        (rows past attn_metadata.num_actual_tokens: zeros) and returned.

        Reads K/V from the cache (the new tokens were written there first); key /
        value [T, num_kv_heads, head_dim] are this step's new K/V (vLLM passes
        them too), which a backend may read instead for requests with no cached
        context (the Triton backend's prefill split)."""
        raise NotImplementedError


class AttentionBackend:
    name: str = "abstract"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)
