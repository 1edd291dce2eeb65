"""KVCacheSnapshotter: KVCacheManager.snapshot(), rebuilt only where the cache changed.

An optimisation for tracing at level full, behind the same interface: its
snapshot() returns exactly what the plain KVCacheManager.snapshot() returns
(tests/unit/test_snapshot_equivalence.py pins the two together), and the step
snapshot hands it to Scheduler.snapshot(kv_cache=...). A learner reads the plain
one, next to the manager; this file exists only because a step snapshot must
not cost more than the step.

A plain rebuild lists every block id of every request (10k ids at batch 256
with 40-block tables) and one row dict per listed block, every step. Between
two snapshots only a few requests gain blocks and only a few blocks change, so
this keeps both and redoes only those.

NOTE: how it learns which blocks changed without the pool tracking anything
for it. A block's row ({ref_cnt, hash, owners}) changes only in the BlockPool
methods that change a ref_cnt or a hash: get_new_blocks (allocate, and evict
the popped block's old hash), touch (prefix hits), free_blocks,
cache_full_blocks and reset_prefix_cache. The snapshotter wraps those five
methods *on this pool instance*, from outside, and notes the blocks each call
names; the pool's own code knows nothing of it. Not the pool's KV cache events:
they exist only with record_block_pool_events, and take_block_pool_events() hands them to
whoever asks first (the step snapshot drains them every step), so the blocks
they name could be gone before a snapshot reads them.

NOTE: why the caches stay right.
- Block-id lists: a request's block list only grows while it holds blocks
  (prefix hits, then new blocks, are appended); free pops the whole list
  and a re-admitted request starts a new one. So the ids cached for the
  *same list object* are a prefix of it: only the tail past them is new.
  (The cache holds the old list, so its identity cannot be reused.) A
  manager that edited lists in place (vLLM's sliding window swaps skipped
  blocks for the null block) would need a wrapper for it.
- Rows of `blocks`: ref_cnt and hash change only in the five wrapped calls:
  the blocks they name go stale. Owners change when a block-id list gains or
  loses the block: the list sync marks those rows stale itself. The null
  block's ref_cnt is not kept by the pool (free skips it): its row is
  rebuilt every time.
- Owners are listed in req_to_blocks order, as a rebuild would: a request
  keeps its place in that dict until it is freed, which drops it from
  every block it held (making their rows stale).
A row dict (and its owners list) is never edited once built, only
replaced, so snapshots may share it; block-id lists are copied out.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_anatomy.core import kv_cache_manager as kv_cache_manager_module
from vllm_anatomy.core.block_pool import BlockPool, short_hash
from vllm_anatomy.core.kv_cache_manager import KVCacheManager
from vllm_anatomy.core.kv_cache_utils import KVCacheBlock


class KVCacheSnapshotter:
    """Incremental snapshots of one KVCacheManager (create it before the
    manager's first allocation, or at any time: the first snapshot is whole)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.pool = pool = manager.block_pool
        # NOTE: read from the module at construction, so a test that lowers the
        # limit (monkeypatch) gets a sparse snapshotter and a sparse plain snapshot alike.
        self.dense = pool.num_gpu_blocks <= kv_cache_manager_module.SNAPSHOT_DENSE_MAX_BLOCKS
        # Blocks whose ref_cnt or hash changed since the last snapshot.
        self.touched_block_ids: set[int] = set()
        _watch_block_pool(pool, self.touched_block_ids.update)
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
        """The same dict as KVCacheManager.snapshot(), key for key."""
        pool, manager = self.pool, self.manager
        tables = self._sync_tables()
        self._refresh_rows()
        if self.dense:
            free = pool.free_block_queue.get_free_block_ids()
        else:
            free = pool.free_block_queue.get_free_block_ids(kv_cache_manager_module.SNAPSHOT_FREE_QUEUE_HEAD)
            listed = {0, *free, *(i for event in pool.block_pool_event_queue for i in event.block_ids)}
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
            "num_cached_block": dict(manager.coordinator.single_type_managers[0].num_cached_block),
        }

    # -- block-id lists ---------------------------------------------------------
    def _sync_tables(self) -> dict[str, list[int]]:
        """Bring each request's cached ids up to its block list; return copies."""
        live = self.manager.coordinator.single_type_managers[0].req_to_blocks
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

    def _hold(self, req_id: str, block_ids: list[int], new_blocks: list[KVCacheBlock]) -> None:
        new_ids = [blk.block_id for blk in new_blocks]
        block_ids.extend(new_ids)
        holders = self.holders
        for block_id in new_ids:
            holders[block_id] = holders.get(block_id, ()) + (req_id,)
        self.stale.update(new_ids)

    def _release(self, req_id: str, block_ids: list[int]) -> None:
        holders = self.holders
        for block_id in block_ids:
            others = holders.pop(block_id)
            if len(others) > 1:                              # a shared block: the others keep it
                holders[block_id] = tuple(holder for holder in others if holder != req_id)
        self.stale.update(block_ids)

    # -- rows ---------------------------------------------------------------------
    def _refresh_rows(self) -> None:
        """Rebuild (dense) or forget (sparse: built again if listed) every stale row."""
        stale = self.stale | self.touched_block_ids
        stale.add(0)
        self.stale = set()
        self.touched_block_ids.clear()
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
        block = self.pool.blocks[block_id]
        return {"block_id": block_id, "ref_cnt": block.ref_cnt, "hash": short_hash(block.block_hash),
                "owners": self._owners(block_id), "is_null": block.is_null}

    def _owners(self, block_id: int) -> list[str]:
        holders = self.holders.get(block_id, ())
        if len(holders) < 2:
            return list(holders)
        if self.order is None:
            self.order = {req_id: i for i, req_id in
                          enumerate(self.manager.coordinator.single_type_managers[0].req_to_blocks)}
        return sorted(holders, key=self.order.__getitem__)


def _watch_block_pool(pool: BlockPool, touched: Callable[[list[int]], None]) -> None:
    """Wrap the pool's five ref_cnt / hash mutators on this instance: each call
    reports the ids of the blocks it changed to `touched` (see the module NOTE)."""
    get_new_blocks, touch, free_blocks = pool.get_new_blocks, pool.touch, pool.free_blocks
    cache_full_blocks, reset_prefix_cache = pool.cache_full_blocks, pool.reset_prefix_cache

    @functools.wraps(get_new_blocks)
    def watched_get_new_blocks(num_blocks: int) -> list[KVCacheBlock]:
        blocks = get_new_blocks(num_blocks)        # evicted blocks are among these
        touched([block.block_id for block in blocks])
        return blocks

    @functools.wraps(touch)
    def watched_touch(blocks) -> None:
        blocks = list(blocks)                      # an iterable is read once
        touch(blocks)
        touched([block.block_id for block in blocks])

    @functools.wraps(free_blocks)
    def watched_free_blocks(ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        free_blocks(blocks)
        touched([block.block_id for block in blocks])

    @functools.wraps(cache_full_blocks)
    def watched_cache_full_blocks(request, blocks: list[KVCacheBlock], num_cached_blocks: int,
                                  num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                                  block_mask: list[bool] | None = None) -> None:
        cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                          block_mask)
        touched([block.block_id for block in blocks[num_cached_blocks:num_full_blocks]])

    @functools.wraps(reset_prefix_cache)
    def watched_reset_prefix_cache() -> bool:
        if not reset_prefix_cache():
            return False
        touched(list(range(pool.num_gpu_blocks)))
        return True

    for watched in (watched_get_new_blocks, watched_touch, watched_free_blocks, watched_cache_full_blocks,
                    watched_reset_prefix_cache):
        setattr(pool, watched.__name__, watched)      # (functools.wraps: the wrapped method's name)
