"""KVCacheCoordinator: the block pool and one single-type manager per KV-cache group.

Mirrors vllm/v1/core/kv_cache_coordinator.py (KVCacheCoordinator,
KVCacheCoordinatorNoPrefixCache, UnitaryKVCacheCoordinator,
get_kv_cache_coordinator). The KVCacheManager asks it; it asks each group's
manager and adds up (blocks to allocate) or zips (blocks held, hits) their answers.

With one group, as here, every answer is the one manager's. NOTE: vLLM's
HybridKVCacheCoordinator serves models whose layers need different block
tables (full attention beside sliding window or Mamba): a prefix hit must then
hold in every group, which it finds by shrinking the hit group by group until
they agree. Not implemented: every model here has one group.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm_anatomy.core.block_pool import BlockPool
from vllm_anatomy.core.kv_cache_utils import BlockHash, KVCacheBlock
from vllm_anatomy.core.single_type_kv_cache_manager import SingleTypeKVCacheManager, get_manager_for_kv_cache_spec
from vllm_anatomy.kv_cache_interface import KVCacheConfig

if TYPE_CHECKING:
    from vllm_anatomy.core.request import Request


class KVCacheCoordinator:
    """The block pool every group allocates from, and the groups' managers."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int,
                 use_eagle: bool, enable_caching: bool, enable_kv_cache_events: bool, dcp_world_size: int,
                 pcp_world_size: int, scheduler_block_size: int, hash_block_size: int,
                 metrics_collector: Any = None) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        assert scheduler_block_size % hash_block_size == 0 and all(
            scheduler_block_size % g.kv_cache_spec.block_size == 0 for g in kv_cache_config.kv_cache_groups)
        self.scheduler_block_size = scheduler_block_size
        self.block_pool = BlockPool(num_gpu_blocks=kv_cache_config.num_blocks, enable_caching=enable_caching,
                                    hash_block_size=hash_block_size, enable_kv_cache_events=enable_kv_cache_events,
                                    metrics_collector=metrics_collector)
        # Groups whose prefix hits drop their last block (an EAGLE drafter recomputes it).
        self.eagle_group_ids: set[int] = set(range(len(kv_cache_config.kv_cache_groups))) if use_eagle else set()
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                kv_cache_spec=group.kv_cache_spec, max_in_flight_tokens=max_in_flight_tokens,
                max_model_len=max_model_len, block_pool=self.block_pool, enable_caching=enable_caching,
                kv_cache_group_id=i, dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
                scheduler_block_size=scheduler_block_size)
            for i, group in enumerate(kv_cache_config.kv_cache_groups))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[Sequence[KVCacheBlock], ...], num_encoder_tokens: int,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False) -> int:
        """Free blocks the request needs, summed over the groups.
        (num_encoder_tokens: NOTE: cross-attention groups of encoder-decoder models; 0 here.)"""
        return sum(manager.get_num_blocks_to_allocate(
                       request_id, num_tokens, new_computed_blocks[i], total_computed_tokens,
                       num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=apply_admission_cap)
                   for i, manager in enumerate(self.single_type_managers))

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
                                     num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Give a newly admitted request its prefix hits (a running one has none: no-op)."""
        if any(request_id in manager.num_cached_block for manager in self.single_type_managers):
            assert all(len(blocks) == 0 for blocks in new_computed_blocks)
            return
        for i, manager in enumerate(self.single_type_managers):
            manager.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens,
                                              num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                            num_encoder_tokens: int = 0) -> tuple[list[KVCacheBlock], ...]:
        return tuple(manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
                     for manager in self.single_type_managers)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [manager.get_num_common_prefix_blocks(running_request_id) for manager in self.single_type_managers]

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(manager.req_to_blocks.get(request_id) or [] for manager in self.single_type_managers)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """(hit blocks per group, hit length in tokens, uncached shared-prefix tokens).
        NOTE: the third is how far a lagging sparse group (hybrid models) trails; 0 here."""
        raise NotImplementedError

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: no lookups, no hits, any number of groups."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int,
                 use_eagle: bool, enable_kv_cache_events: bool, dcp_world_size: int, pcp_world_size: int,
                 scheduler_block_size: int, hash_block_size: int, metrics_collector: Any = None) -> None:
        super().__init__(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, False,
                         enable_kv_cache_events, dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
                         scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
                         metrics_collector=metrics_collector)
        self.num_single_type_manager = len(self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_single_type_manager

    def find_longest_cache_hit(self, block_hashes: list[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        return tuple([] for _ in range(self.num_single_type_manager)), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV-cache group (every layer the same kind of attention): the usual case, and ours."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int,
                 use_eagle: bool, enable_caching: bool, enable_kv_cache_events: bool, dcp_world_size: int,
                 pcp_world_size: int, scheduler_block_size: int, hash_block_size: int,
                 metrics_collector: Any = None) -> None:
        super().__init__(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
                         enable_kv_cache_events, dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
                         scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
                         metrics_collector=metrics_collector)
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        assert not enable_caching or hash_block_size == self.block_size, \
            "UnitaryKVCacheCoordinator assumes hash_block_size == block_size"
        assert len(kv_cache_config.kv_cache_groups) == 1, "UnitaryKVCacheCoordinator assumes one KV cache group"
        self.single_type_managers[0].use_eagle = 0 in self.eagle_group_ids
        self._manager = self.single_type_managers[0]

    # NOTE: ours, not vLLM's: the three calls of allocate_slots' full path go
    # straight to the one manager (the base class loops over the groups with a
    # generator: a few microseconds a call, for ~1 request in block_size per
    # decode step). Same results.
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[Sequence[KVCacheBlock], ...], num_encoder_tokens: int,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False) -> int:
        return self._manager.get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks[0], total_computed_tokens, num_local_computed_tokens,
            num_tokens_main_model, apply_admission_cap)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                            num_encoder_tokens: int = 0) -> tuple[list[KVCacheBlock], ...]:
        return (self._manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model),)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._manager.cache_blocks(request, num_computed_tokens)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        hit_blocks, hit_length = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes=block_hashes, max_length=max_cache_hit_length, kv_cache_group_ids=[0],
            block_pool=self.block_pool, kv_cache_spec=self.kv_cache_spec,
            drop_eagle_block=0 in self.eagle_group_ids, alignment_tokens=self.block_size,
            dcp_world_size=self.dcp_world_size, pcp_world_size=self.pcp_world_size)
        return hit_blocks, hit_length, 0


def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int,
                             use_eagle: bool, enable_caching: bool, enable_kv_cache_events: bool,
                             dcp_world_size: int, pcp_world_size: int, scheduler_block_size: int,
                             hash_block_size: int, metrics_collector: Any = None) -> KVCacheCoordinator:
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_kv_cache_events,
            dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
            scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
            metrics_collector=metrics_collector)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, enable_caching,
            enable_kv_cache_events, dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
            scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
            metrics_collector=metrics_collector)
    raise NotImplementedError("Several KV cache groups (a hybrid model) need vLLM's HybridKVCacheCoordinator, "
                              "not implemented here")
