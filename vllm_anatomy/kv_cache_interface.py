"""What the KV cache is made of, as the KV-cache manager sees it: KVCacheSpec, KVCacheGroupSpec, KVCacheConfig.

Mirrors vllm/v1/kv_cache_interface.py. EngineCore builds one KVCacheConfig at
start-up (EngineCore._initialize_kv_caches) and hands it to the Scheduler,
whose KVCacheManager makes one block pool of `num_blocks` blocks and one
single-type manager per KV-cache group.

Simplified: one spec type, FullAttentionSpec (every layer of the models we
load is full causal attention), so there is always exactly one group. vLLM's
other specs (sliding window, chunked local, MLA, Mamba, cross attention) exist
for hybrid models, whose layers need different block tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from vllm_anatomy.config import VllmConfig


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


class KVCacheSpecKind(str, Enum):
    """What kind of attention a group's layers are (KV cache events carry it, so a
    router can tell which groups' blocks it indexes). Only FULL_ATTENTION occurs here."""
    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV-cache format of one layer."""
    # Tokens per block.
    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        """Bytes one sequence of max_model_len tokens needs in this layer."""
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    # NOTE: only read for its itemsize: the pure core (the scheduler) does not import torch.
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        # K and V, block_size tokens, every KV head.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full causal attention: every token keeps its KV for the whole sequence.

    NOTE: vLLM's FullAttentionSpec also carries sliding_window and
    attention_chunk_size, for hybrid models run without the hybrid allocator.
    """


@dataclass
class KVCacheTensor:
    """One KV-cache tensor the workers allocate: its size and the layers sharing it."""
    size: int
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table (here: all of them)."""
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    """The KV cache of the model: how many blocks, and the groups that use them."""
    num_blocks: int
    # How the workers lay out the tensors. NOTE: ours allocate their own
    # (Worker.initialize_from_config); the scheduler reads only the groups.
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]

    @property
    def has_mamba_layers(self) -> bool:
        # NOTE: vLLM schedules Mamba groups differently (block-aligned chunks); none here.
        return False


def get_kv_cache_spec_kind(kv_cache_spec: KVCacheSpec) -> KVCacheSpecKind:
    return KVCacheSpecKind.FULL_ATTENTION if isinstance(kv_cache_spec, FullAttentionSpec) else KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(kv_cache_spec: KVCacheSpec) -> int | None:
    """The group's window (None: full attention, the only kind here)."""
    return None
