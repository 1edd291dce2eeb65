"""BlockPool: every KV-cache block, the free queue and the prefix-cache map.

Mirrors vllm/v1/core/block_pool.py. The pool knows mechanics (allocate, free,
touch, cache, evict); *policy* (how many blocks a request needs, what a hit is)
lives in the KV-cache manager above it.

Teaching extra: with enable_kv_cache_events, every allocate / free / hit /
evict / cache / reset appends a small BlockPoolEvent, drained by take_events()
(vLLM's pool queues BlockStored/BlockRemoved/AllBlocksCleared events the same
way for external KV-aware routers).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

from vllm_anatomy.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from vllm_anatomy.core.request import Request


@dataclass
class BlockPoolEvent:
    """One block-level state change (plain data for the dashboard)."""
    # "allocate" | "free" | "hit" | "evict" | "cache" | "reset"
    kind: str
    block_ids: list[int]
    # Short hex of each block's hash, for "cache" and "evict".
    block_hashes: list[str] = field(default_factory=list)
    # Which request and which KVCacheManager call ("allocate_slots", "free",
    # "cache_blocks") caused it; None outside such a call (a reset).
    request_id: str | None = None
    call: str | None = None
    # "free" only: each block's ref_cnt after the call, and the end of the free
    # queue it joined ("front" | "tail"; None: still held by another request).
    ref_cnts: list[int] | None = None
    queue_ends: list[str | None] | None = None


@overload
def short_hash(block_hash: BlockHash) -> str: ...
@overload
def short_hash(block_hash: None) -> None: ...
def short_hash(block_hash: BlockHash | None) -> str | None:
    """The first 8 hex digits of a block hash (enough to tell blocks apart on screen); None for none."""
    return block_hash.hex()[:8] if block_hash is not None else None


class BlockPool:
    """All KV-cache blocks of one group.

    Args:
        num_gpu_blocks: number of blocks in the KV-cache tensor.
        enable_caching: whether full blocks are hashed and kept for prefix hits.
        enable_kv_cache_events: record BlockPoolEvents for take_events().
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool,
                 enable_kv_cache_events: bool = False) -> None:
        assert num_gpu_blocks >= 2, "need the null block plus at least one usable block"
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # block hash -> {block_id: block}. NOTE: one hash may map to several
        # blocks: two requests can compute the same block at the same time, and
        # we never merge them (block tables must stay append-only).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # NOTE: block 0 is the null block, a placeholder that never holds real
        # KV (vLLM pads skipped sliding-window blocks with it). It is popped
        # here and never freed; its ref_cnt is not maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[BlockPoolEvent] = []
        # (request id, KVCacheManager method) of the call in progress, stamped on
        # the events it causes; set by the KV manager only while events are on.
        self.event_context: tuple[str, str] | None = None

    def _record(self, kind: str, blocks: list[KVCacheBlock], hashes: list[str] | None = None,
                queue_ends: list[str | None] | None = None) -> None:
        if not blocks or not self.enable_kv_cache_events:
            return
        request_id, call = self.event_context or (None, None)
        self.kv_event_queue.append(BlockPoolEvent(
            kind, [block.block_id for block in blocks], hashes or [], request_id, call,
            ref_cnts=[block.ref_cnt for block in blocks] if queue_ends is not None else None, queue_ends=queue_ends))

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block whose content has this hash, or None (a prefix-cache miss)."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int) -> None:
        """Hash blocks[num_cached_blocks:num_full_blocks] and make them findable.

        NOTE: the hashes were already computed by the Request (block_hasher);
        caching only attaches them to the physical blocks.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        cached: list[KVCacheBlock] = []
        hashes: list[str] = []
        for i, blk in enumerate(new_full_blocks, start=num_cached_blocks):
            if blk.is_null:
                continue
            block_hash = request.block_hashes[i]
            blk.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[blk.block_id] = blk
            cached.append(blk)
            hashes.append(short_hash(block_hash))
        self._record("cache", cached, hashes)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take num_blocks from the front of the free queue (ref_cnt becomes 1).

        NOTE: a popped block may still carry the hash of what it held before:
        that cached content is now overwritten, so the hash must leave the map
        (eviction) or a later lookup would hit garbage.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        self._record("allocate", ret)
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop a block's hash from the prefix-cache map. True if it had one."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        blocks_by_id = self.cached_block_hash_to_block.get(block_hash)
        if blocks_by_id is None or block.block_id not in blocks_by_id:
            return False
        del blocks_by_id[block.block_id]
        if not blocks_by_id:
            del self.cached_block_hash_to_block[block_hash]
        self._record("evict", [block], [short_hash(block_hash)])
        block.reset_hash()
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks.

        NOTE: a hit block with ref_cnt 0 sits in the free queue (evictable);
        it must leave the queue before it is shared, or a later allocation
        could pop and overwrite it.
        """
        blocks = list(blocks)
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
        self._record("hit", blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 become free.

        Args:
            ordered_blocks: blocks in eviction priority (first = evicted first).

        NOTE: with prefix caching on, hashed blocks go to the *tail* (they stay
        cached, LRU order) and unhashed ones to the *front*: they can never be a
        prefix hit, so reusing them first keeps the cached ones alive longer.
        With caching off nothing is hashed and v0.27.1 appends every freed
        block to the tail, so the free queue is a plain FIFO (its comment
        gives GPU cache locality as the reason).
        """
        blocks_list = list(ordered_blocks)
        blocks_with_hash: list[KVCacheBlock] = []
        blocks_without_hash: list[KVCacheBlock] = []
        for block in blocks_list:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block.block_hash is None and self.enable_caching:
                    blocks_without_hash.append(block)
                else:
                    blocks_with_hash.append(block)
        self.free_block_queue.prepend_n(blocks_without_hash)
        self.free_block_queue.append_n(blocks_with_hash)
        if self.enable_kv_cache_events:
            front = {id(block) for block in blocks_without_hash}
            freed = [block for block in blocks_list if not block.is_null]
            self._record("free", freed, queue_ends=[None if block.ref_cnt else "front" if id(block) in front
                                                    else "tail" for block in freed])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no request holds a block."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # only the null block is "used"
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockPoolEvent("reset", []))
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 .. 1.0).

        NOTE: free blocks that still carry a cached hash count as free: they
        are reclaimable on demand. The null block is excluded from the total.
        """
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)

    def take_events(self) -> list[BlockPoolEvent]:
        """Return and clear the events recorded since the last call."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
