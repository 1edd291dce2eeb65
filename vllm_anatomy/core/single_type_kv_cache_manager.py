"""Per-request block lists for one KV-cache group: SingleTypeKVCacheManager.

Mirrors vllm/v1/core/single_type_kv_cache_manager.py (SingleTypeKVCacheManager
and FullAttentionManager). Simplified: only full attention (no sliding window,
chunked-local or Mamba managers, no null-block padding for skipped blocks), and
no KVCacheCoordinator in between: with a single group the KVCacheManager calls
this class directly.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from vllm_anatomy.core.block_pool import BlockPool
from vllm_anatomy.core.kv_cache_utils import BlockHash, KVCacheBlock

if TYPE_CHECKING:
    from vllm_anatomy.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


class SingleTypeKVCacheManager:
    """Which blocks each request holds, and how many of them are cached."""

    def __init__(self, block_size: int, block_pool: BlockPool, kv_cache_group_id: int = 0) -> None:
        self.block_size = block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        # request_id -> its blocks in token order (block i holds tokens
        # [i * block_size, (i + 1) * block_size)). This is the request's block table.
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # request_id -> how many of its leading blocks are already hashed and
        # cached, so cache_blocks() only hashes the newly full ones.
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock]) -> int:
        """How many free blocks the request needs to hold num_tokens tokens.

        NOTE: prefix-hit blocks with ref_cnt 0 are counted too: they sit in the
        free queue, and touching them takes them out of it, so they consume
        free blocks exactly like new allocations.
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

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """Add prefix-hit blocks to a request that holds no blocks yet."""
        if not new_computed_blocks:
            return
        # NOTE: hits are only looked up for requests with num_computed_tokens == 0,
        # i.e. holding no blocks, so the hits are the head of its block table.
        assert request_id not in self.req_to_blocks or not self.req_to_blocks[request_id]
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id].extend(new_computed_blocks)
        # They are already hashed: cache_blocks() must not hash them again.
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's blocks to cover num_tokens; returns only the new ones."""
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and cache the request's blocks that became full within num_tokens."""
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
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool, tail block first.

        NOTE: reverse order puts the chain's last block at the front of the
        eviction order: a later block can only be hit if every earlier one is,
        so it is the least valuable to keep.
        """
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(req_blocks))
        self.num_cached_block.pop(request_id, None)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full (causal) attention: every token needs every earlier token's KV."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: list[BlockHash], max_length: int,
                               block_pool: BlockPool, block_size: int) -> list[KVCacheBlock]:
        """The cached blocks for the longest prefix of block_hashes (at most max_length tokens).

        NOTE: stop at the first miss: hashes are chained, so once block i
        misses, no later block of this request can be a valid hit.
        """
        computed_blocks: list[KVCacheBlock] = []
        max_num_blocks = max_length // block_size
        for block_hash in block_hashes[:max_num_blocks]:
            cached_block = block_pool.get_cached_block(block_hash)
            if cached_block is None:
                break
            computed_blocks.append(cached_block)
        return computed_blocks
