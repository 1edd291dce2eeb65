"""KVCacheManager: the scheduler's one door to the paged KV cache.

Mirrors vllm/v1/core/kv_cache_manager.py. The scheduler asks two questions:
"how much of this prompt is already cached?" (get_computed_blocks) and "give
this request room for n more tokens" (allocate_slots). Block objects never
leave this process: the scheduler turns them into block ids (KVCacheBlocks).

Simplified: one KV-cache group (full attention) and no KVCacheCoordinator;
no KV connector (external tokens), no lookahead for spec decode in practice,
no watermark, no encoder tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
        return KVCacheBlocks(tuple([*a, *b] for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; None if allow_none and there are no blocks at all."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "Only one group is supported"
        return [blk.block_id for blk in self.blocks[0] if blk.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


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
        self.empty_kv_cache_blocks = KVCacheBlocks(((),))
        self._snapshotter: KVCacheSnapshotter | None = None    # built by the first snapshot()

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
        return KVCacheBlocks((computed_blocks,)), num_new_computed_tokens

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
        new_computed_block_list = list(new_computed_blocks.blocks[0]) if new_computed_blocks else ()
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
        self.manager.save_new_computed_blocks(request_id, new_computed_block_list)
        new_blocks = self.manager.allocate_new_blocks(request_id, num_tokens_need_slot)

        if self.enable_caching:
            # NOTE: cache the blocks that are full once this step's tokens are
            # computed. Hashing ahead of the forward pass is safe: any step that
            # could hit these blocks is scheduled, and runs, after this one. Capped at num_tokens so
            # lookahead slots (tokens not known yet) are never cached. With async
            # scheduling a lookup may come while this step is still in flight:
            # it is a later step, so the device runs it after this one's writes.
            self.manager.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return KVCacheBlocks((new_blocks,))

    def free(self, request: Request) -> None:
        """Free the request's blocks in reverse order (tail blocks evicted first)."""
        self._event_context(request, "free")
        self.manager.free(request.request_id)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks within its first num_computed_tokens tokens."""
        if self.enable_caching:
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
            self.prefix_cache_stats.reset = True
        return True

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks((list(self.manager.req_to_blocks.get(request_id, [])),))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def take_events(self) -> list[BlockPoolEvent]:
        """Block events recorded since the last call (needs enable_kv_cache_events)."""
        return self.block_pool.take_events()

    def snapshot(self) -> dict[str, Any]:
        """Plain, JSON-able view of the blocks, the free queue and the block tables.

        NOTE: a pool of up to SNAPSHOT_DENSE_MAX_BLOCKS blocks (every CPU run,
        the lessons) is listed whole, every step. A GPU-sized pool (70k blocks
        on an H200) would make that O(pool) work per step, slower than the step
        itself: such a snapshot is "sparse" — the blocks this step touched
        (allocate / free / hit / evict / cache events still pending), the first
        SNAPSHOT_FREE_QUEUE_HEAD of the free queue (the next to be taken) and
        the null block; block tables stay whole (ints, O(blocks in use)).
        Built incrementally by KVCacheSnapshotter: the same data as a rebuild
        from scratch, at the cost of what changed since the previous snapshot.
        """
        if self._snapshotter is None:
            self._snapshotter = KVCacheSnapshotter(self)
        return self._snapshotter.snapshot()


class KVCacheSnapshotter:
    """KVCacheManager.snapshot(), rebuilt only where the cache changed.

    A full rebuild lists every block id of every request (10k ids at batch
    256 with 40-block tables) and one row dict per listed block, every step.
    Between two snapshots only a few requests gain blocks and only a few
    blocks change, so this keeps both and redoes only those.

    NOTE: why the caches stay right.
    - Block-id lists: a request's block list only grows while it holds blocks
      (prefix hits, then new blocks, are appended); free pops the whole list
      and a re-admitted request starts a new one. So the ids cached for the
      *same list object* are a prefix of it: only the tail past them is new.
      (The cache holds the old list, so its identity cannot be reused.) A
      manager that edited lists in place (vLLM's sliding window swaps skipped
      blocks for the null block) would need an event for it.
    - Rows of `blocks` ({ref_cnt, hash, owners}): ref_cnt and hash change only
      in BlockPool calls that report the block to pool.touched_block_ids
      (allocate, hit, free, cache, evict, reset): those rows go stale. Owners
      change when a block-id list gains or loses the block: the list sync
      marks those rows stale itself. The null block's ref_cnt is not kept by
      events (free skips it): its row is rebuilt every time.
    - Owners are listed in req_to_blocks order, as a rebuild would: a request
      keeps its place in that dict until it is freed, which drops it from
      every block it held (making their rows stale).
    A row dict (and its owners list) is never edited once built, only
    replaced, so snapshots may share it; block-id lists are copied out.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.pool = pool = manager.block_pool
        self.dense = pool.num_gpu_blocks <= SNAPSHOT_DENSE_MAX_BLOCKS
        pool.track_touched_blocks()
        # request id -> (its live block list, the ids of that list so far).
        self.tables: dict[str, tuple[list[KVCacheBlock], list[int]]] = {}
        # block id -> the requests whose lists hold it (absent: none). Tuples of
        # str, not sets: 10k held blocks would be 10k objects for the GC to scan.
        self.holders: dict[int, tuple[str, ...]] = {}
        # block id -> its row: every block (dense), or those of the last
        # snapshot (sparse). `stale`: rows to rebuild before they are listed.
        self.rows: dict[int, dict[str, Any]] = {}
        self.stale: set[int] = set()
        self.order: dict[str, int] | None = None   # req_to_blocks position, per snapshot

    def snapshot(self) -> dict[str, Any]:
        pool, manager = self.pool, self.manager
        tables = self._sync_tables()
        self._refresh_rows()
        if self.dense:
            free = pool.free_block_queue.get_free_block_ids()
        else:
            free = pool.free_block_queue.get_free_block_ids(SNAPSHOT_FREE_QUEUE_HEAD)
            listed = {0, *free, *(i for ev in pool.kv_event_queue for i in ev.block_ids)}
            kept = self.rows
            self.rows = {i: kept.get(i) or self._make_row(i) for i in sorted(listed)}
        return {
            "num_gpu_blocks": pool.num_gpu_blocks,
            "block_size": manager.block_size,
            "enable_caching": manager.enable_caching,
            "usage": manager.usage,
            "num_free_blocks": pool.get_num_free_blocks(),
            "sparse": not self.dense,
            "blocks": list(self.rows.values()),
            "free_queue": free,
            "req_to_block_ids": tables,
            "num_cached_block": dict(manager.manager.num_cached_block),
        }

    # -- block-id lists ---------------------------------------------------------
    def _sync_tables(self) -> dict[str, list[int]]:
        """Bring each request's cached ids up to its block list; return copies."""
        live = self.manager.manager.req_to_blocks
        cache = self.tables
        tables = {}
        for req_id, blocks in live.items():
            entry = cache.get(req_id)
            if entry is None or entry[0] is not blocks or len(entry[1]) > len(blocks):
                entry = self._track(req_id, blocks)          # new, or freed and re-admitted
            elif len(entry[1]) < len(blocks):                # grew
                self._hold(req_id, entry[1], blocks[len(entry[1]):])
            tables[req_id] = list(entry[1])
        if len(cache) != len(live):                          # some were freed
            for req_id in cache.keys() - live.keys():
                self._release(req_id, cache.pop(req_id)[1])
        self.order = None
        return tables

    def _track(self, req_id: str, blocks: list[KVCacheBlock]) -> tuple[list[KVCacheBlock], list[int]]:
        old = self.tables.get(req_id)
        if old is not None:
            self._release(req_id, old[1])
        entry = self.tables[req_id] = (blocks, [])
        self._hold(req_id, entry[1], blocks)
        return entry

    def _hold(self, req_id: str, ids: list[int], new_blocks: list[KVCacheBlock]) -> None:
        new_ids = [blk.block_id for blk in new_blocks]
        ids.extend(new_ids)
        holders = self.holders
        for block_id in new_ids:
            holders[block_id] = holders.get(block_id, ()) + (req_id,)
        self.stale.update(new_ids)

    def _release(self, req_id: str, ids: list[int]) -> None:
        holders = self.holders
        for block_id in ids:
            others = holders.pop(block_id)
            if len(others) > 1:                              # a shared block: the others keep it
                holders[block_id] = tuple(r for r in others if r != req_id)
        self.stale.update(ids)

    # -- rows ---------------------------------------------------------------------
    def _refresh_rows(self) -> None:
        """Rebuild (dense) or forget (sparse: built again if listed) every stale row."""
        stale = self.stale | self.pool.take_touched_block_ids()
        stale.add(0)
        self.stale = set()
        rows = self.rows
        if not self.dense:
            for block_id in stale.intersection(rows):
                del rows[block_id]
        elif not rows:                                       # the first snapshot
            self.rows = {i: self._make_row(i) for i in range(self.pool.num_gpu_blocks)}
        else:
            for block_id in stale:
                rows[block_id] = self._make_row(block_id)

    def _make_row(self, block_id: int) -> dict[str, Any]:
        blk = self.pool.blocks[block_id]
        return {"block_id": block_id, "ref_cnt": blk.ref_cnt, "hash": short_hash(blk.block_hash),
                "owners": self._owners(block_id), "is_null": blk.is_null}

    def _owners(self, block_id: int) -> list[str]:
        holders = self.holders.get(block_id, ())
        if len(holders) < 2:
            return list(holders)
        if self.order is None:
            self.order = {req_id: i for i, req_id in enumerate(self.manager.manager.req_to_blocks)}
        return sorted(holders, key=self.order.__getitem__)
