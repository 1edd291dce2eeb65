"""Per-request block lists for one KV-cache group: SingleTypeKVCacheManager.

Mirrors vllm/v1/core/single_type_kv_cache_manager.py (SingleTypeKVCacheManager,
FullAttentionManager, get_manager_for_kv_cache_spec). The KVCacheCoordinator
(kv_cache_coordinator.py) holds one of these per KV-cache group.

Simplified: only full attention (no sliding-window, chunked-local, Mamba or
cross-attention managers: with those, vLLM frees blocks that fell out of the
window and pads the table with the null block), no copy-on-write of a hit that
ends inside a block (vLLM's fine-grained hashing), no KV connector.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_anatomy.core.block_pool import BlockPool
from vllm_anatomy.core.kv_cache_utils import BlockHash, KVCacheBlock
from vllm_anatomy.kv_cache_interface import FullAttentionSpec, KVCacheSpec

if TYPE_CHECKING:
    from vllm_anatomy.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


class SingleTypeKVCacheManager:
    """Which blocks each request holds in one group, and how many of them are cached.

    Args (vLLM's): kv_cache_spec, block_pool, enable_caching, kv_cache_group_id,
    scheduler_block_size; and, each only in its neutral value here:
    dcp_world_size / pcp_world_size (NOTE: decode / prefill context
    parallelism shard a block's tokens over ranks), needs_kv_cache_zeroing
    (NOTE: Mamba and mixed-precision caches zero new blocks),
    max_admission_blocks_per_request (NOTE: sliding-window groups recycle
    blocks, so admission reserves fewer).
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, scheduler_block_size: int, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, needs_kv_cache_zeroing: bool = False,
                 max_admission_blocks_per_request: int | None = None) -> None:
        assert dcp_world_size == 1 and pcp_world_size == 1, "context parallelism is not implemented here"
        assert not needs_kv_cache_zeroing and max_admission_blocks_per_request is None
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.scheduler_block_size = scheduler_block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        # NOTE: set by the coordinator; only hit rules that drop the last block
        # for an EAGLE drafter read it.
        self.use_eagle = False
        # request_id -> its blocks in token order (block i holds tokens
        # [i * block_size, (i + 1) * block_size)). This is the request's block table.
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # request_id -> how many of its leading blocks are already hashed and
        # cached, so cache_blocks() only hashes the newly full ones.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        """How many free blocks the request needs to hold num_tokens tokens.

        NOTE: prefix-hit blocks with ref_cnt 0 are counted too: they sit in the
        free queue, and touching them takes them out of it, so they consume
        free blocks exactly like new allocations. (total_computed_tokens,
        num_local_computed_tokens, num_tokens_main_model, apply_admission_cap:
        vLLM's window and spec-decode arithmetic; full attention reads none.)
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        # NOTE: .get, not [], so that asking (and being refused) leaves no trace.
        num_held_blocks = len(self.req_to_blocks.get(request_id, ()))
        num_new_blocks = max(num_required_blocks - len(new_computed_blocks) - num_held_blocks, 0)
        if not new_computed_blocks:          # every running request, every step: keep it cheap
            return num_new_blocks
        num_evictable_computed_blocks = sum(
            1 for blk in new_computed_blocks if blk.ref_cnt == 0 and not blk.is_null)
        return num_new_blocks + num_evictable_computed_blocks

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Add prefix-hit blocks to a request that holds no blocks yet.
        (num_external_computed_tokens: NOTE: a KV connector's tokens; always 0 here.)"""
        # NOTE: hits are only looked up for requests with num_computed_tokens == 0,
        # i.e. holding no blocks, so the hits are the head of its block table.
        req_blocks = self.req_to_blocks[request_id]
        assert not req_blocks
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            assert not new_computed_blocks, "Computed blocks should be empty when prefix caching is disabled"
        req_blocks.extend(new_computed_blocks)
        # They are already hashed: cache_blocks() must not hash them again.
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Grow the request's blocks to cover num_tokens; returns only the new ones.
        (num_tokens_main_model: num_tokens without the lookahead slots; NOTE: only
        Mamba groups treat the two differently.)"""
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int, retention_interval: int | None = None) -> None:
        """Hash and cache the request's blocks that became full within num_tokens.
        (retention_interval: NOTE: sparse caching of sliding-window / Mamba states; None here.)"""
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        # NOTE: a block can only be cached once its hash exists, i.e. once the
        # Request has seen all its tokens (capped by len(block_hashes)). Most
        # calls (a decode, twice a step with async scheduling) end here.
        if num_cached_blocks >= len(request.block_hashes):
            return
        num_full_blocks = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request.request_id],
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request's blocks and return them (the caller frees them, tail first)."""
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        return req_blocks

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool, tail block first.

        NOTE: reverse order puts the chain's last block at the front of the
        eviction order: a later block can only be hit if every earlier one is,
        so it is the least valuable to keep.
        """
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks of this request that every request holding blocks shares.
        NOTE: vLLM's cascade attention computes such a prefix once for the batch."""
        raise NotImplementedError

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: list[BlockHash], max_length: int, kv_cache_group_ids: list[int],
                               block_pool: BlockPool, kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The cached blocks (one list per group) of the longest cached prefix, and its length in tokens."""
        raise NotImplementedError

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free blocks no longer attended to. NOTE: a sliding window's early
        blocks; full attention attends to every token, so nothing is skipped."""
        return None

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def new_step_starts(self) -> None:
        return None


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full (causal) attention: every token needs every earlier token's KV."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: list[BlockHash], max_length: int, kv_cache_group_ids: list[int],
                               block_pool: BlockPool, kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """NOTE: stop at the first miss: hashes are chained, so once block i
        misses, no later block of this request can be a valid hit. An EAGLE
        drafter needs the last block's hidden states, so it drops the last hit."""
        assert isinstance(kv_cache_spec, FullAttentionSpec)
        block_size = kv_cache_spec.block_size
        computed_blocks: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for block_hash in block_hashes[:max_length // block_size]:
            cached_blocks = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached_blocks is None:
                break
            for computed, cached in zip(computed_blocks, cached_blocks):
                computed.append(cached)
        hit_length = len(computed_blocks[0]) * block_size if computed_blocks else 0
        if drop_eagle_block and hit_length > 0:
            hit_length -= block_size
        hit_length -= hit_length % alignment_tokens
        for computed in computed_blocks:
            del computed[cdiv(hit_length, block_size):]
        return computed_blocks, hit_length

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        num_common_blocks = 0
        num_requests = len(self.req_to_blocks)
        for block in self.req_to_blocks[running_request_id]:
            if block.ref_cnt != num_requests:
                break
            num_common_blocks += 1
        return num_common_blocks


# Which manager serves each spec type (vLLM: KVCacheSpecRegistry, filled by register_all_kvcache_specs).
spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
}


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, max_in_flight_tokens: int, max_model_len: int,
                                  **kwargs) -> SingleTypeKVCacheManager:
    """The manager for one group's spec. (max_in_flight_tokens, max_model_len:
    NOTE: vLLM sizes a sliding window's admission cap from them.)"""
    manager_class = spec_manager_map.get(type(kv_cache_spec))
    if manager_class is None:
        raise NotImplementedError(f"No KV-cache manager for {type(kv_cache_spec).__name__} here (full attention only)")
    return manager_class(kv_cache_spec, **kwargs)
