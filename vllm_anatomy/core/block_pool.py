"""BlockPool: every KV-cache block, the free queue and the prefix-cache map.

Mirrors vllm/v1/core/block_pool.py (BlockHashToBlockMap, BlockPool). The pool
knows mechanics (allocate, free, touch, cache, evict); *policy* (how many
blocks a request needs, what a hit is) lives in the KV-cache manager above it.

Two event streams come from the same mutators:
- KV cache events (vLLM's, with enable_kv_cache_events): BlockStored when
  cache_full_blocks makes blocks findable, BlockRemoved when a cached block is
  evicted, AllBlocksCleared on reset; take_events() drains them and the
  scheduler publishes them (distributed/kv_events.py).
- Teaching extra (with record_block_pool_events): a BlockPoolEvent for every
  allocate / free / hit / evict / cache / reset, with the request and the
  KVCacheManager call that caused it; take_block_pool_events() drains them
  for the dashboard's step snapshots.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from vllm_anatomy.core.kv_cache_utils import (BlockHash, BlockHashWithGroupId, ExternalBlockHash,
                                              FreeKVCacheBlockQueue, KVCacheBlock,
                                              generate_block_hash_extra_keys, get_block_hash, get_group_id,
                                              make_block_hash_with_group_id, maybe_convert_block_hash)
from vllm_anatomy.distributed.kv_events import (MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored,
                                                KVCacheEvent)

if TYPE_CHECKING:
    from vllm_anatomy.core.request import Request

logger = logging.getLogger(__name__)


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
def short_hash(block_hash: bytes) -> str: ...
@overload
def short_hash(block_hash: None) -> None: ...
def short_hash(block_hash: bytes | None) -> str | None:
    """The first 8 hex digits of a block hash (enough to tell blocks apart on screen); None for none."""
    return block_hash.hex()[:8] if block_hash is not None else None


class BlockHashToBlockMap:
    """The prefix cache: hash key -> the cached block(s) holding those tokens.

    NOTE: one key may map to several blocks: two requests can compute the
    same block at the same time, and they are never merged (a block table
    must stay append-only, so a block id once handed out is kept). A key
    holds its one block directly and only becomes a {block_id: block} dict
    once a second block arrives: most keys have one block, and a dict per key
    would be one more object for the GC to scan.
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """Any block cached under the key (None: a miss)."""
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        """Whether this very block is cached under the key."""
        blocks = self._cache.get(key)
        if blocks is None:
            return False
        if isinstance(blocks, KVCacheBlock):
            return blocks.block_id == block_id
        return block_id in blocks

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Take the block out from under the key (None if it is not cached there)."""
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id != block_id:
                return None
            del self._cache[key]
            return blocks
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        return block

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """All KV-cache blocks.

    Args:
        num_gpu_blocks: number of blocks in the KV-cache tensor.
        enable_caching: whether full blocks are hashed and kept for prefix hits.
        hash_block_size: tokens per request block hash (Request.block_hashes).
            NOTE: vLLM's hybrid models may hash at a finer grain than a
            group's block size; here both are the one block_size.
        enable_kv_cache_events: queue KV cache events for take_events().
        metrics_collector: NOTE: vLLM's optional block-residency sampler
            (--kv-cache-metrics); not implemented here, must be None.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, metrics_collector: Any = None) -> None:
        assert isinstance(num_gpu_blocks, int) and num_gpu_blocks > 0
        assert metrics_collector is None, "KV-cache residency metrics are not implemented here"
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # NOTE: block 0 is the null block, a placeholder that never holds real
        # KV (vLLM pads skipped sliding-window blocks with it). It is popped
        # here and never freed; its ref_cnt is not maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.metrics_collector = metrics_collector
        # Teaching extra: the dashboard's block events (see the module docstring).
        self.record_block_pool_events = False
        self.block_pool_event_queue: list[BlockPoolEvent] = []
        # (request id, KVCacheManager method) of the call in progress, stamped on
        # the BlockPoolEvents it causes; set by the KV manager only while they are recorded.
        self.event_context: tuple[str, str] | None = None

    def _record(self, kind: str, blocks: Sequence[KVCacheBlock], hashes: list[str] | None = None,
                queue_ends: list[str | None] | None = None) -> None:
        if not blocks or not self.record_block_pool_events:
            return
        request_id, call = self.event_context or (None, None)
        self.block_pool_event_queue.append(BlockPoolEvent(
            kind, [block.block_id for block in blocks], hashes or [], request_id, call,
            ref_cnts=[block.ref_cnt for block in blocks] if queue_ends is not None else None, queue_ends=queue_ends))

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        """A cached block with this hash in each of the groups, or None if any group misses."""
        cached_blocks = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            cached_blocks.append(block)
        return cached_blocks

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: list[bool] | None = None) -> None:
        """Key blocks[num_cached_blocks:num_full_blocks] by their hashes: prefix hits from now on.

        NOTE: the hashes were already computed by the Request (block_hasher,
        on every appended token); caching only attaches them to the physical
        blocks. block_mask (vLLM: sliding-window groups keep only the blocks a
        hit can use) leaves the blocks it marks False uncached.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        # NOTE: vLLM resolves coarser group blocks from finer hashes; one block size here.
        assert block_size == self.hash_block_size
        assert len(request.block_hashes) >= num_full_blocks
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        assert block_mask is None or len(block_mask) == len(new_full_blocks)
        cached: list[KVCacheBlock] = []
        new_hashes: list[ExternalBlockHash] = []
        extra_keys_list: list[tuple[Any, ...] | None] = []
        for i, blk in enumerate(new_full_blocks):
            if blk.is_null or (block_mask is not None and not block_mask[i]):
                continue
            index = num_cached_blocks + i
            block_hash = request.block_hashes[index]
            key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
            blk.set_block_hash(key, num_tokens=(index + 1) * block_size)
            self.cached_block_hash_to_block.insert(key, blk)
            cached.append(blk)
            if self.enable_kv_cache_events:
                new_hashes.append(maybe_convert_block_hash(block_hash))
                extra_keys_list.append(generate_block_hash_extra_keys(
                    request, index * block_size, (index + 1) * block_size, 0)[0])
        self._record("cache", cached, [blk.block_hash.hex()[:8] for blk in cached if blk.block_hash is not None])
        if self.enable_kv_cache_events:
            parent_block_hash = (maybe_convert_block_hash(request.block_hashes[num_cached_blocks - 1])
                                 if num_cached_blocks > 0 else None)
            self.kv_event_queue.append(BlockStored(
                block_hashes=new_hashes, parent_block_hash=parent_block_hash,
                token_ids=list(request.all_token_ids[num_cached_blocks * block_size:num_full_blocks * block_size]),
                block_size=block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
                extra_keys=extra_keys_list or None, group_idx=kv_cache_group_id))

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
        """Drop a block's hash from the prefix cache (its memory is about to be
        rewritten). True if it had one."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        popped = self.cached_block_hash_to_block.pop(block_hash, block.block_id)
        block.reset_hash()
        if popped is None:
            return False
        self._record("evict", [block], [short_hash(block_hash)])
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved(
                block_hashes=[maybe_convert_block_hash(get_block_hash(block_hash))], medium=MEDIUM_GPU,
                group_idx=get_group_id(block_hash)))
        return True

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks.

        NOTE: a hit block with ref_cnt 0 sits in the free queue (evictable);
        it must leave the queue before it is shared, or a later allocation
        could pop and overwrite it.
        """
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
        if self.record_block_pool_events:
            front = {id(block) for block in blocks_without_hash}
            freed = [block for block in blocks_list if not block.is_null]
            self._record("free", freed, queue_ends=[None if block.ref_cnt else "front" if id(block) in front
                                                    else "tail" for block in freed])

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop these blocks' hashes from the prefix cache (blocks still held stay held).
        NOTE: vLLM's KV connectors call it for blocks whose KV failed to load."""
        for block_id in block_ids:
            assert block_id < len(self.blocks), f"Invalid block_id {block_id} >= {len(self.blocks)}"
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no request holds a block."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # only the null block is "used"
            logger.warning("Failed to reset prefix cache because some blocks (%d) are not freed yet",
                           num_used_blocks - 1)
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        if self.record_block_pool_events:
            self.block_pool_event_queue.append(BlockPoolEvent("reset", []))
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 .. 1.0).

        NOTE: free blocks that still carry a cached hash count as free: they
        are reclaimable on demand. The null block is excluded from the total.
        """
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the KV cache events queued since the last call."""
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def take_block_pool_events(self) -> list[BlockPoolEvent]:
        """Return and clear the dashboard's block events (teaching extra)."""
        events, self.block_pool_event_queue = self.block_pool_event_queue, []
        return events
