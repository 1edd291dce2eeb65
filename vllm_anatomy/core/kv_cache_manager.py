"""KVCacheManager: the scheduler's one door to the paged KV cache.

Mirrors vllm/v1/core/kv_cache_manager.py. The scheduler asks two questions:
"how much of this prompt is already cached?" (get_computed_blocks) and "give
this request room for n more tokens" (allocate_slots). Block objects never
leave this process: the scheduler turns them into block ids (KVCacheBlocks).

Simplified: one KV-cache group (full attention) and no KVCacheCoordinator;
no KV connector (external tokens), no watermark, no encoder tokens. A draft
model's slots ahead of the verified tokens are the lookahead (num_lookahead_tokens).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from vllm_anatomy.core.block_pool import BlockPool, BlockPoolEvent, short_hash
from vllm_anatomy.core.kv_cache_utils import KVCacheBlock, PrefixCacheStats
from vllm_anatomy.core.single_type_kv_cache_manager import FullAttentionManager

if TYPE_CHECKING:
    from vllm_anatomy.core.request import Request


@dataclass
class KVCacheBlocks:
    """An allocation result: blocks[group][i]. Hides KVCacheBlock internals from the scheduler."""
    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([*blk1, *blk2] for blk1, blk2 in zip(self.blocks, other.blocks)))

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> tuple[list[int], ...]: ...
    @overload
    def get_block_ids(self, allow_none: Literal[True]) -> tuple[list[int], ...] | None: ...
    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; None if allow_none and there are no blocks at all."""
        if allow_none and not any(self.blocks):
            return None
        return tuple([[blk.block_id for blk in group] for group in self.blocks])


# Pools up to this size are snapshotted whole every step (see KVCacheManager.snapshot).
SNAPSHOT_DENSE_MAX_BLOCKS = 4096
SNAPSHOT_FREE_QUEUE_HEAD = 256


class KVCacheManager:
    """Prefix-cache lookups, slot allocation and freeing for every request."""

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, log_stats: bool = False,
                 enable_kv_cache_events: bool = False) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, enable_kv_cache_events)
        # vLLM: coordinator.single_type_managers[0]; one group here.
        self.manager = FullAttentionManager(block_size, self.block_pool)
        # NOTE: shared by every call that returns no blocks (most running
        # requests, most steps: a decode fills its last block 1/block_size at a
        # time), as in vLLM; nested tuples keep it immutable.
        self.empty_kv_cache_blocks = KVCacheBlocks(((),))

    @property
    def usage(self) -> float:
        """KV-cache usage between 0.0 and 1.0."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the prefix-cache stats gathered so far and start new ones."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one admission's lookup: num_tokens queried, num_hits hit (tokens)."""
        if not self.log_stats or not self.enable_caching:
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The cached blocks of the request's longest cached prefix, and its length in tokens.

        Simplified: v0.27.1 also returns a third value, shared_prefix_boundary,
        used only by hybrid (Mamba / sliding-window) models.
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        # NOTE: when the whole prompt is cached we must still recompute its last
        # token to get logits for the first output token, so a hit may cover at
        # most num_tokens - 1 tokens. Hits are whole blocks, so this can cost
        # recomputing one full block.
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks = self.manager.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length, self.block_pool, self.block_size)
        num_new_computed_tokens = len(computed_blocks) * self.block_size
        return self.create_kv_cache_blocks(computed_blocks), num_new_computed_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False) -> KVCacheBlocks | None:
        """Make room for num_new_tokens more tokens; None if the pool cannot.

        Blocks layout:
            | < comp > | < new_comp > | < new > | < lookahead > |
                                      |  < to be computed >     |
                       |         < to be allocated >            |
        comp = request.num_computed_tokens, new_comp = num_new_computed_tokens
        (prefix hits found by get_computed_blocks), new = num_new_tokens.

        Args:
            full_sequence_must_fit: admission gate (the scheduler sets it for
                waiting requests): refuse unless the whole request, not just
                this chunk, fits in the free blocks. Without it a long chunked
                prompt could be admitted, grab blocks chunk by chunk, and force
                preemptions.

        Returns:
            The newly allocated blocks (not the prefix hits), or None.
            NOTE: None leaves everything untouched (no ref_cnt change, no
            allocation), so the scheduler can simply try something else.
        """
        if num_new_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0")
        self._event_context(request, "allocate_slots")
        if new_computed_blocks is None and not full_sequence_must_fit:
            # NOTE: the fast path of a running request whose held blocks already
            # have a slot for every new token (a decode, most steps: it fills its
            # last block one token at a time). The full path below would find 0
            # blocks to allocate and only cache blocks; vLLM computes the same 0
            # through its coordinator, at batch 256 a tenth of schedule().
            # (Uncapped by max_model_len: the cap could only turn a miss into a hit
            # here, and the full path gets those right.)
            num_tokens_to_compute = request.num_computed_tokens + num_new_tokens
            if num_tokens_to_compute + num_lookahead_tokens <= \
                    len(self.manager.req_to_blocks.get(request.request_id, ())) * self.block_size:
                # NOTE: cache_blocks caps at the request's block hashes, which
                # cover its known tokens only: the min() with num_tokens below
                # would change nothing. Most steps have no hash past the cached
                # blocks (the check cache_blocks starts with), so no call.
                if self.enable_caching and \
                        self.manager.num_cached_block.get(request.request_id, 0) < len(request.block_hashes):
                    self.manager.cache_blocks(request, num_tokens_to_compute)
                return self.empty_kv_cache_blocks
        new_computed_block_list = list(new_computed_blocks.blocks[0]) if new_computed_blocks else []
        request_id = request.request_id
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_free_blocks = self.block_pool.get_num_free_blocks()

        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens + num_lookahead_tokens, self.max_model_len)
            if self.manager.get_num_blocks_to_allocate(
                    request_id, full_num_tokens, new_computed_block_list) > num_free_blocks:
                return None

        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                                   self.max_model_len)
        num_blocks_to_allocate = self.manager.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, new_computed_block_list)
        if num_blocks_to_allocate > num_free_blocks:
            return None

        # From here on we change state. Hits first: touching them takes them out
        # of the free queue before get_new_blocks could pop (and evict) them.
        # NOTE: most calls (a decode whose last block still has room) need
        # neither: hits come only at admission, and 0 blocks to allocate means
        # the held blocks already cover num_tokens_need_slot.
        if new_computed_block_list:
            self.manager.save_new_computed_blocks(request_id, new_computed_block_list)
        new_blocks = (self.manager.allocate_new_blocks(request_id, num_tokens_need_slot)
                      if num_blocks_to_allocate > 0 else ())

        if self.enable_caching:
            # NOTE: cache the blocks that are full once this step's tokens are
            # computed. Hashing ahead of the forward pass is safe: any step that
            # could hit these blocks is scheduled, and runs, after this one. Capped at num_tokens so
            # lookahead slots (tokens not known yet) are never cached. With async
            # scheduling a lookup may come while this step is still in flight:
            # it is a later step, so the device runs it after this one's writes.
            self.manager.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    def create_kv_cache_blocks(self, blocks: Sequence[KVCacheBlock]) -> KVCacheBlocks:
        """Wrap one group's blocks (the shared empty_kv_cache_blocks when there are none)."""
        return KVCacheBlocks((blocks,)) if blocks else self.empty_kv_cache_blocks

    def free(self, request: Request) -> None:
        """Free the request's blocks in reverse order (tail blocks evicted first)."""
        self._event_context(request, "free")
        self.manager.free(request.request_id)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks within its first num_computed_tokens tokens."""
        # NOTE: AsyncScheduler calls this for every running request every step;
        # most have no block hash past their cached blocks, hence nothing to do.
        if self.enable_caching and \
                self.manager.num_cached_block.get(request.request_id, 0) < len(request.block_hashes):
            self._event_context(request, "cache_blocks")
            self.manager.cache_blocks(request, num_computed_tokens)

    def _event_context(self, request: Request, call: str) -> None:
        """Stamp the block-pool events of this call with its request and method (teaching
        extra: the dashboard answers "which request, which call" from them)."""
        if self.block_pool.enable_kv_cache_events:
            self.block_pool.event_context = (request.request_id, call)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes (only possible when no request holds blocks)."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(list(self.manager.req_to_blocks.get(request_id, [])))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def take_events(self) -> list[BlockPoolEvent]:
        """Block events recorded since the last call (needs enable_kv_cache_events)."""
        return self.block_pool.take_events()

    def snapshot(self) -> dict[str, Any]:
        """Plain, JSON-able view of the blocks, the free queue and the block tables.

        NOTE: a pool of up to SNAPSHOT_DENSE_MAX_BLOCKS blocks (every CPU run,
        the lessons) is listed whole. A GPU-sized pool (tens of thousands of
        blocks on an H200) would make that O(pool) work per step, more than the
        step itself (bench/results/tracing_breakdown_h200.json times the
        snapshot builders per step): such a snapshot is "sparse" — the blocks this step touched (allocate /
        free / hit / evict / cache events still pending), the first
        SNAPSHOT_FREE_QUEUE_HEAD of the free queue (the next to be taken) and
        the null block; block tables stay whole (ints, O(blocks in use)).
        Tracing at level full builds the same dict incrementally, at the cost
        of what changed since its previous snapshot
        (vllm_anatomy/tracing/kv_snapshotter.py).
        """
        pool = self.block_pool
        dense = pool.num_gpu_blocks <= SNAPSHOT_DENSE_MAX_BLOCKS
        free_block_ids = pool.free_block_queue.get_free_block_ids(None if dense else SNAPSHOT_FREE_QUEUE_HEAD)
        if dense:
            listed = pool.blocks
        else:
            listed_ids = {0, *free_block_ids, *(i for event in pool.kv_event_queue for i in event.block_ids)}
            listed = [pool.blocks[i] for i in sorted(listed_ids)]
        tables = {req_id: [blk.block_id for blk in blocks] for req_id, blocks in self.manager.req_to_blocks.items()}
        owners: defaultdict[int, list[str]] = defaultdict(list)
        for req_id, block_ids in tables.items():
            for block_id in block_ids:
                owners[block_id].append(req_id)
        return {
            "num_gpu_blocks": pool.num_gpu_blocks,
            "block_size": self.block_size,
            "enable_caching": self.enable_caching,
            "usage": self.usage,
            "num_free_blocks": pool.get_num_free_blocks(),
            "sparse": not dense,
            "blocks": [{"block_id": blk.block_id, "ref_cnt": blk.ref_cnt, "hash": short_hash(blk.block_hash),
                        "owners": owners.get(blk.block_id, []), "is_null": blk.is_null} for blk in listed],
            "free_queue": free_block_ids,
            "req_to_block_ids": tables,
            "num_cached_block": dict(self.manager.num_cached_block),
        }
