"""Build the core's objects the way EngineCore does, for GPU-free tests.

The Scheduler and the KVCacheManager take vLLM's arguments (a KVCacheConfig,
the block size, the structured-output manager); these helpers fill them from a
VllmConfig and a block count.
"""
from __future__ import annotations

import torch

from vllm_anatomy.config import VllmConfig
from vllm_anatomy.core.kv_cache_manager import KVCacheManager
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm_anatomy.structured_output import StructuredOutputManager


def make_kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """One full-attention group, as EngineCore._initialize_kv_caches builds it."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])


def new_scheduler(config: VllmConfig, num_blocks: int, scheduler_cls: type[Scheduler] | None = None,
                  structured_output_manager: StructuredOutputManager | None = None,
                  record_block_pool_events: bool = False, include_finished_set: bool = True,
                  log_stats: bool = True) -> Scheduler:
    """A scheduler over num_blocks blocks (block 0 is the null block)."""
    config.cache_config.num_gpu_blocks = num_blocks
    cls = scheduler_cls or config.scheduler_config.get_scheduler_cls()
    scheduler = cls(config, make_kv_cache_config(num_blocks, config.cache_config.block_size),
                    structured_output_manager or StructuredOutputManager(config), config.cache_config.block_size,
                    include_finished_set=include_finished_set, log_stats=log_stats)
    scheduler.kv_cache_manager.block_pool.record_block_pool_events = record_block_pool_events
    return scheduler


def new_kv_cache_manager(num_blocks: int, block_size: int, max_model_len: int,
                         record_block_pool_events: bool = False, **kwargs) -> KVCacheManager:
    """A KVCacheManager over num_blocks blocks; kwargs: enable_caching, log_stats, enable_kv_cache_events, ..."""
    manager = KVCacheManager(make_kv_cache_config(num_blocks, block_size), max_model_len,
                             scheduler_block_size=block_size, hash_block_size=block_size, **kwargs)
    manager.block_pool.record_block_pool_events = record_block_pool_events
    return manager
