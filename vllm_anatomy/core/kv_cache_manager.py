"""KVCacheManager: the scheduler's one door to the paged KV cache.

Mirrors vllm/v1/core/kv_cache_manager.py. The scheduler asks two questions:
"how much of this prompt is already cached?" (get_computed_blocks) and "give
this request room for n more tokens" (allocate_slots). Block objects never
leave this process: the scheduler turns them into block ids (KVCacheBlocks).
Below it, a KVCacheCoordinator (kv_cache_coordinator.py) owns the block pool
and one SingleTypeKVCacheManager per KV-cache group: one group here.

Simplified: no KV connector (external tokens), no encoder tokens, no
sliding-window block recycling; the watermark is kept. A draft model's slots
ahead of the verified tokens are the lookahead (num_lookahead_tokens).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

from vllm_anatomy.core.block_pool import BlockPoolEvent, short_hash
from vllm_anatomy.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm_anatomy.core.kv_cache_utils import KVCacheBlock, PrefixCacheStats
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.distributed.kv_events import BlockStored, KVCacheEvent
from vllm_anatomy.kv_cache_interface import KVCacheConfig, get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

_WAITING, _PREEMPTED = RequestStatus.WAITING, RequestStatus.PREEMPTED


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

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks not (yet) in the prefix cache (one group only)."""
        assert len(self.blocks) == 1, "Only one group is supported"
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in range(len(self.blocks))))


# Pools up to this size are snapshotted whole every step (see KVCacheManager.snapshot).
SNAPSHOT_DENSE_MAX_BLOCKS = 4096
SNAPSHOT_FREE_QUEUE_HEAD = 256


class KVCacheManager:
    """Prefix-cache lookups, slot allocation and freeing for every request.

    Args (vLLM's): kv_cache_config (blocks and groups), max_model_len,
    scheduler_block_size / hash_block_size (equal here: one group),
    max_in_flight_tokens (NOTE: sizes a sliding window's admission cap; unused
    by full attention), enable_caching, use_eagle (an EAGLE drafter: prefix hits
    drop their last block), log_stats, enable_kv_cache_events,
    dcp_world_size / pcp_world_size (1: no context parallelism),
    metrics_collector (None: no residency sampling), watermark (fraction of
    blocks kept free when admitting waiting or preempted requests).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None, enable_caching: bool = True,
                 use_eagle: bool = False, log_stats: bool = False, enable_kv_cache_events: bool = False,
                 dcp_world_size: int = 1, pcp_world_size: int = 1, metrics_collector: Any = None,
                 watermark: float = 0.0) -> None:
        self.max_model_len = max_model_len
        if max_in_flight_tokens is None:
            max_in_flight_tokens = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config=kv_cache_config, max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens, use_eagle=use_eagle, enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events, dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size, scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size, metrics_collector=metrics_collector)
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.kv_cache_config = kv_cache_config
        # Ours: the one group's manager, read directly on allocate_slots' fast path
        # (every running request, every step).
        self._full_attention_manager = self.coordinator.single_type_managers[0]
        # Teaching extra (one group): the tokens per block the snapshots report.
        self.block_size = scheduler_block_size
        # NOTE: admitting a request into the last free blocks only to preempt
        # it (or another) next step costs a recompute: the watermark keeps some
        # headroom when admitting. 0.0 (the default) turns it off.
        assert watermark >= 0.0, "watermark must be non-negative"
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        # Per group: (its kind, its window), stamped on the group's BlockStored events.
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(group.kv_cache_spec).value, get_kv_cache_spec_sliding_window(group.kv_cache_spec))
            for group in kv_cache_config.kv_cache_groups)
        # NOTE: shared by every call that returns no blocks (most running
        # requests, most steps: a decode fills its last block 1/block_size at a
        # time), as in vLLM; nested tuples keep it immutable.
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))

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

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether this request may read the prefix cache.
        NOTE: a request asking for prompt logprobs must compute every prompt
        token (its logits are the answer), so it skips the lookup."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one admission's lookup: num_tokens queried, num_hits hit (tokens)."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """The cached blocks of the request's longest cached prefix, its length in
        tokens, and shared_prefix_boundary.

        NOTE: shared_prefix_boundary marks, for hybrid (Mamba / sliding-window)
        models, a shared prefix that a sparse group has not cached yet, to be
        kept when it is; always 0 with one full-attention group.
        """
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        # NOTE: when the whole prompt is cached we must still recompute its last
        # token to get logits for the first output token, so a hit may cover at
        # most num_tokens - 1 tokens. Hits are whole blocks, so this can cost
        # recomputing one full block.
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks, num_new_computed_tokens, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length)
        shared_prefix_boundary = num_new_computed_tokens + num_uncached if num_uncached else 0
        return self.create_kv_cache_blocks(computed_blocks), num_new_computed_tokens, shared_prefix_boundary

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True) -> KVCacheBlocks | None:
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
            reserved_blocks: free blocks to leave to others (vLLM: in-flight
                prefills a KV connector's async load must not starve).
            has_scheduled_reqs: the watermark applies only when some request
                already runs this step (so an idle engine can always admit one).
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens:
                NOTE: a KV connector's tokens, P/D's deferred caching and
                cross-attention; none here (0 / False).

        Returns:
            The newly allocated blocks (not the prefix hits), or None.
            NOTE: None leaves everything untouched (no ref_cnt change, no
            allocation), so the scheduler can simply try something else.
        """
        if num_new_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0")
        # (the block-pool events' context is set only on the paths that can emit events)
        if new_computed_blocks is None and not (full_sequence_must_fit or reserved_blocks
                                                or num_external_computed_tokens):
            # NOTE: the fast path of a running request whose held blocks already
            # have a slot for every new token (a decode, most steps: it fills its
            # last block one token at a time). The full path below would find 0
            # blocks to allocate and only cache blocks; vLLM computes the same 0
            # through its coordinator, at batch 256 a tenth of schedule().
            # (Uncapped by max_model_len: the cap could only turn a miss into a hit
            # here, and the full path gets those right.)
            manager = self._full_attention_manager
            num_tokens_to_compute = request.num_computed_tokens + num_new_tokens
            if num_tokens_to_compute + num_lookahead_tokens <= \
                    len(manager.req_to_blocks.get(request.request_id, ())) * manager.block_size:
                # NOTE: cache_blocks caps at the request's block hashes, which
                # cover its known tokens only: the min() with num_tokens below
                # would change nothing. Most steps have no hash past the cached
                # blocks (the check cache_blocks starts with), so no call.
                if self.enable_caching and \
                        manager.num_cached_block.get(request.request_id, 0) < len(request.block_hashes):
                    self._event_context(request, "allocate_slots")
                    self.coordinator.cache_blocks(request, num_tokens_to_compute)
                return self.empty_kv_cache_blocks
        self._event_context(request, "allocate_slots")
        assert num_external_computed_tokens == 0 and not delay_cache_blocks and num_encoder_tokens == 0, \
            "KV connectors and encoder-decoder models are not implemented here"
        new_computed_block_list = (new_computed_blocks.blocks if new_computed_blocks is not None
                                   else self.empty_kv_cache_blocks.blocks)
        request_id = request.request_id
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_free_blocks = self.block_pool.get_num_free_blocks()
        # The watermark: only for admissions (waiting / preempted), only beside running requests.
        watermark_blocks = self.watermark_blocks \
            if has_scheduled_reqs and request.status in (_WAITING, _PREEMPTED) else 0

        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens + num_lookahead_tokens, self.max_model_len)
            if self.coordinator.get_num_blocks_to_allocate(
                    request_id, full_num_tokens, new_computed_block_list, num_encoder_tokens,
                    num_computed_tokens, num_computed_tokens, full_num_tokens,
                    apply_admission_cap=True) + watermark_blocks > num_free_blocks:
                return None

        num_tokens_main_model = num_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, new_computed_block_list, num_encoder_tokens,
            num_computed_tokens, num_computed_tokens, num_tokens_main_model)
        if num_blocks_to_allocate + watermark_blocks > num_free_blocks - reserved_blocks:
            return None

        # From here on we change state. Hits first: touching them takes them out
        # of the free queue before get_new_blocks could pop (and evict) them.
        # NOTE: most calls (a decode whose last block still has room) need
        # neither: hits come only at admission, and 0 blocks to allocate means
        # the held blocks already cover num_tokens_need_slot.
        if new_computed_block_list is not self.empty_kv_cache_blocks.blocks:
            self.coordinator.allocate_new_computed_blocks(request_id, new_computed_block_list,
                                                          num_computed_tokens, num_external_computed_tokens)
        new_blocks = self.coordinator.allocate_new_blocks(request_id, num_tokens_need_slot, num_tokens_main_model)

        if self.enable_caching:
            # NOTE: cache the blocks that are full once this step's tokens are
            # computed. Hashing ahead of the forward pass is safe: any step that
            # could hit these blocks is scheduled, and runs, after this one. Capped at num_tokens so
            # lookahead slots (tokens not known yet) are never cached. With async
            # scheduling a lookup may come while this step is still in flight:
            # it is a later step, so the device runs it after this one's writes.
            self.coordinator.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap the groups' blocks (the shared empty_kv_cache_blocks when there are none)."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def free(self, request: Request) -> None:
        """Free the request's blocks in reverse order (tail blocks evicted first)."""
        self._event_context(request, "free")
        self.coordinator.free(request.request_id)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free blocks outside the attention window (none for full attention)."""
        self.coordinator.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop these blocks from the prefix cache (vLLM: KV loads that failed)."""
        self.block_pool.evict_blocks(block_ids)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks within its first num_computed_tokens tokens."""
        # NOTE: AsyncScheduler calls this for every running request every step;
        # most have no block hash past their cached blocks, hence nothing to do.
        if self.enable_caching and \
                self._full_attention_manager.num_cached_block.get(request.request_id, 0) < len(request.block_hashes):
            self._event_context(request, "cache_blocks")
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def _event_context(self, request: Request, call: str) -> None:
        """Stamp the block-pool events of this call with its request and method (teaching
        extra: the dashboard answers "which request, which call" from them)."""
        if self.block_pool.record_block_pool_events:
            self.block_pool.event_context = (request.request_id, call)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes (only possible when no request holds blocks)."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks every request holding blocks shares.
        NOTE: vLLM's cascade attention reads it; kept for the same question here."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events since the last call, BlockStored ones labelled with their group's kind."""
        events = self.block_pool.take_events()
        for event in events:
            if isinstance(event, BlockStored) and event.group_idx is not None:
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = \
                    self.kv_cache_event_metadata[event.group_idx]
        return events

    def take_block_pool_events(self) -> list[BlockPoolEvent]:
        """The dashboard's block events since the last call (needs block_pool.record_block_pool_events)."""
        return self.block_pool.take_block_pool_events()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

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
            listed_ids = {0, *free_block_ids, *(i for event in pool.block_pool_event_queue for i in event.block_ids)}
            listed = [pool.blocks[i] for i in sorted(listed_ids)]
        manager = self.coordinator.single_type_managers[0]
        tables = {req_id: [blk.block_id for blk in blocks] for req_id, blocks in manager.req_to_blocks.items()}
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
            "num_cached_block": dict(manager.num_cached_block),
        }
