"""KVCacheManager + FullAttentionManager: prefix hits, allocation, freeing (CPU, no model)."""
from __future__ import annotations

import copy
import json

import pytest

from vllm_anatomy.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm_anatomy.core.kv_cache_utils import get_request_block_hasher, make_block_hash_with_group_id, sha256
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.sampling_params import SamplingParams
from tests.unit.core_utils import new_kv_cache_manager

BS = 4


def make_manager(num_blocks: int = 11, enable_caching: bool = True, max_model_len: int = 40) -> KVCacheManager:
    return new_kv_cache_manager(num_blocks, BS, max_model_len, record_block_pool_events=True,
                                enable_caching=enable_caching, log_stats=True)


def make_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8), block_hasher=get_request_block_hasher(BS, sha256))


def admit(m: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> KVCacheBlocks | None:
    """What the scheduler's WAITING loop does: look up hits, allocate, advance."""
    hits, num_hits, _ = m.get_computed_blocks(req)
    n = num_new_tokens if num_new_tokens is not None else req.num_tokens - num_hits
    new_blocks = m.allocate_slots(req, n, num_hits, hits, full_sequence_must_fit=True)
    if new_blocks is not None:
        m.record_prefix_cache_stats(req, num_hits)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hits + n
    return new_blocks


def free_ids(m: KVCacheManager) -> list[int]:
    return m.snapshot()["free_queue"]


def test_miss_then_allocation_covers_the_prompt():
    m = make_manager()
    req = make_request("a", list(range(10)))
    hits, num_hits, _ = m.get_computed_blocks(req)
    assert num_hits == 0 and hits.get_block_ids() == ([],)
    new_blocks = admit(m, req)
    assert new_blocks.get_block_ids() == ([1, 2, 3],)            # cdiv(10, 4) blocks
    assert m.get_block_ids("a") == ([1, 2, 3],)
    # The two full blocks are cached right away; the partial one is not.
    blocks = m.get_blocks("a").blocks[0]
    assert [b.block_hash for b in blocks] == [*(make_block_hash_with_group_id(h, 0) for h in req.block_hashes), None]


def test_prefix_hit_shares_blocks_and_is_capped_at_num_tokens_minus_one():
    m = make_manager()
    a = make_request("a", list(range(8)))                        # exactly two full blocks
    admit(m, a)
    b = make_request("b", list(range(8)))                        # the same prompt
    hits, num_hits, _ = m.get_computed_blocks(b)
    # NOTE: max hit = num_tokens - 1 = 7 tokens -> only one whole block.
    assert num_hits == 4 and hits.get_block_ids() == ([1],)
    admit(m, b)
    assert m.get_block_ids("b") == ([1, 3],)
    assert m.block_pool.blocks[1].ref_cnt == 2 and m.block_pool.blocks[2].ref_cnt == 1
    assert b.num_computed_tokens == 8
    # One more prompt token and both blocks are hits.
    c = make_request("c", list(range(9)))
    _, num_hits, _ = m.get_computed_blocks(c)
    assert num_hits == 8


def test_free_reverse_order_tail_and_front_rule():
    m = make_manager(num_blocks=8)
    a = make_request("a", list(range(14)))                       # 3 full blocks + 2 tokens
    admit(m, a)
    assert m.get_block_ids("a") == ([1, 2, 3, 4],)
    assert free_ids(m) == [5, 6, 7]
    m.free(a)
    # Partial block 4 (unhashed) to the front; hashed 3, 2, 1 (reverse) to the tail.
    assert free_ids(m) == [4, 5, 6, 7, 3, 2, 1]
    assert m.get_block_ids("a") == ([],) and "a" not in m.coordinator.single_type_managers[0].num_cached_block
    # The freed chain is still a hit, and taking it removes the blocks from the queue.
    b = make_request("b", list(range(14)))
    admit(m, b)
    assert m.get_block_ids("b")[0][:3] == [1, 2, 3]
    assert free_ids(m) == [5, 6, 7]                               # 4 was reused for b's tail


def test_eviction_drops_the_hash_and_later_lookups_miss():
    m = make_manager(num_blocks=5)                               # 4 usable blocks
    a = make_request("a", list(range(8)))
    admit(m, a)
    m.free(a)                                                    # 1, 2 cached and free
    b = make_request("b", list(range(100, 116)))                 # needs all 4 blocks
    assert admit(m, b) is not None
    evicted = [e for e in m.take_block_pool_events() if e.kind == "evict"]
    assert sorted(i for e in evicted for i in e.block_ids) == [1, 2]
    m.free(b)
    _, num_hits, _ = m.get_computed_blocks(make_request("c", list(range(9))))
    assert num_hits == 0


def test_allocate_slots_returns_none_without_side_effects():
    m = make_manager(num_blocks=6)                               # 5 usable blocks
    a = make_request("a", list(range(8)))
    admit(m, a)
    m.free(a)                                                    # 1, 2 cached, free
    big = make_request("x", list(range(100, 108)))
    admit(m, big)                                                # holds 2 blocks
    m.take_block_pool_events()
    before = copy.deepcopy(m.snapshot())
    # A request that hits block 1 (free, evictable) but needs 5 blocks in total.
    b = make_request("b", list(range(8)) + list(range(200, 212)))
    hits, num_hits, _ = m.get_computed_blocks(b)
    assert num_hits == 8
    assert m.allocate_slots(b, b.num_tokens - num_hits, num_hits, hits) is None
    assert m.snapshot() == before                               # nothing touched
    assert m.take_block_pool_events() == []
    assert "b" not in m.coordinator.single_type_managers[0].req_to_blocks


def test_full_sequence_must_fit_gates_admission_not_just_the_chunk():
    m = make_manager(num_blocks=4)                               # 3 usable blocks
    req = make_request("a", list(range(16)))                     # needs 4 blocks in all
    assert m.allocate_slots(req, 4, full_sequence_must_fit=True) is None
    assert m.allocate_slots(req, 4).get_block_ids() == ([1],)   # a running chunk is fine


def test_hit_blocks_in_the_free_queue_count_as_allocations():
    m = make_manager(num_blocks=4)                               # 3 usable
    a = make_request("a", list(range(8)))
    admit(m, a)
    m.free(a)                                                    # free queue [3, 2, 1]
    b = make_request("b", list(range(8)) + [50, 51, 52, 53])     # hits 1, 2; needs 1 new
    hits, num_hits, _ = m.get_computed_blocks(b)
    assert m.coordinator.single_type_managers[0].get_num_blocks_to_allocate("b", b.num_tokens, list(hits.blocks[0]),
                                                                           num_hits, num_hits, b.num_tokens) == 3
    assert admit(m, b).get_block_ids() == ([3],)
    assert m.usage == 1.0


def test_lookahead_slots_are_allocated_but_never_cached():
    m = make_manager()
    req = make_request("a", list(range(8)))
    new_blocks = m.allocate_slots(req, 8, num_lookahead_tokens=4)
    assert len(new_blocks.blocks[0]) == 3
    assert m.coordinator.single_type_managers[0].num_cached_block["a"] == 2
    assert m.get_blocks("a").blocks[0][2].block_hash is None


def test_decode_grows_blocks_and_caches_newly_full_ones():
    m = make_manager()
    req = make_request("a", [1, 2, 3])
    admit(m, req)
    req.append_output_token_ids(4)                               # block 0 now full
    new_blocks = m.allocate_slots(req, 1)
    assert new_blocks.get_block_ids() == ([],)                   # slot 3 is in block 1 already
    assert m.get_blocks("a").blocks[0][0].block_hash == make_block_hash_with_group_id(req.block_hashes[0], 0)
    req.num_computed_tokens += 1
    req.append_output_token_ids(5)
    assert m.allocate_slots(req, 1).get_block_ids() == ([2],)    # slot 4 opens a new block


def test_decode_fast_path_caches_the_block_it_completed():
    """A decode whose slot is in a held block takes allocate_slots' fast path: no blocks, but the
    block its token completed is cached, under the allocate_slots call."""
    m = make_manager()
    req = make_request("a", [1, 2, 3])
    admit(m, req)
    m.take_block_pool_events()
    req.append_output_token_ids(4)
    assert m.allocate_slots(req, 1) is m.empty_kv_cache_blocks
    [event] = m.take_block_pool_events()
    assert (event.kind, event.request_id, event.call, event.block_ids) == ("cache", "a", "allocate_slots", [1])
    m.cache_blocks(req, 4)                                       # nothing left to cache: no event
    assert m.take_block_pool_events() == []


def test_block_hashes_of_appended_tokens_match_hashing_at_once():
    """Request skips the hasher until a block is full; the hashes are those of the whole list."""
    hasher = get_request_block_hasher(BS, sha256)
    one_by_one = Request("a", [1, 2, 3], SamplingParams(max_tokens=20), block_hasher=hasher)
    for token in range(4, 15):
        one_by_one.append_output_token_ids(token)
    one_by_one.append_output_token_ids([15, 16, 17])
    at_once = Request("b", list(range(1, 18)), SamplingParams(max_tokens=20), block_hasher=hasher)
    assert one_by_one.block_hashes == at_once.block_hashes and len(at_once.block_hashes) == 4


def test_caching_disabled_has_no_hits_and_no_hashes():
    m = make_manager(enable_caching=False)
    a = make_request("a", list(range(8)))
    admit(m, a)
    m.free(a)
    b = make_request("b", list(range(9)))
    assert m.get_computed_blocks(b)[1] == 0
    assert all(blk.block_hash is None for blk in m.block_pool.blocks)


def test_prefix_cache_stats_in_tokens_and_reset():
    m = make_manager()
    a = make_request("a", list(range(12)))
    admit(m, a)
    b = make_request("b", list(range(12)))
    admit(m, b)
    b.num_preemptions = 1
    m.record_prefix_cache_stats(b, 8)
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 24, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 12, 8)
    assert m.make_prefix_cache_stats().queries == 0              # make_ resets
    assert not m.reset_prefix_cache()                            # blocks in use
    m.free(a)
    m.free(b)
    assert m.reset_prefix_cache() and m.make_prefix_cache_stats().reset


def test_snapshot_is_plain_data_with_owners_and_short_hashes():
    m = make_manager()
    a = make_request("a", list(range(8)))
    admit(m, a)
    b = make_request("b", list(range(9)))
    admit(m, b)
    snap = m.snapshot()
    json.dumps(snap)
    blk1 = snap["blocks"][1]
    assert blk1["owners"] == ["a", "b"] and blk1["ref_cnt"] == 2
    assert blk1["hash"] == a.block_hashes[0].hex()[:8]
    assert snap["blocks"][0]["is_null"] and snap["blocks"][0]["owners"] == []
    assert snap["req_to_block_ids"] == {"a": [1, 2], "b": [1, 2, 3]}
    assert snap["free_queue"] == list(range(4, 11))
    assert snap["usage"] == pytest.approx(3 / 10)


def test_allocate_zero_tokens_is_an_error():
    m = make_manager()
    with pytest.raises(ValueError):
        m.allocate_slots(make_request("a", [1]), 0)


def test_snapshot_of_a_gpu_sized_pool_is_sparse_and_bounded():
    """Past SNAPSHOT_DENSE_MAX_BLOCKS a snapshot lists only what this step touched,
    the head of the free queue and the null block; block tables stay whole."""
    from vllm_anatomy.core import kv_cache_manager as kcm
    m = make_manager(num_blocks=kcm.SNAPSHOT_DENSE_MAX_BLOCKS + 1000, max_model_len=400)
    old = make_request("old", list(range(1, 41)))
    assert admit(m, old) is not None
    m.take_block_pool_events()                                   # an earlier step, already recorded
    new = make_request("new", list(range(100, 121)))
    assert admit(m, new) is not None
    snap = m.snapshot()
    assert snap["sparse"] is True
    listed = {b["block_id"]: b for b in snap["blocks"]}
    new_ids = snap["req_to_block_ids"]["new"]
    assert set(new_ids) <= set(listed)                # allocated this step: listed
    assert not set(snap["req_to_block_ids"]["old"]) & set(listed)   # untouched in-use blocks: not
    assert listed[0]["is_null"] and all(listed[i]["owners"] == ["new"] for i in new_ids)
    assert len(snap["free_queue"]) == kcm.SNAPSHOT_FREE_QUEUE_HEAD
    assert snap["free_queue"] == [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()][
        :kcm.SNAPSHOT_FREE_QUEUE_HEAD]
    assert len(snap["blocks"]) <= 1 + len(new_ids) + kcm.SNAPSHOT_FREE_QUEUE_HEAD
    assert snap["num_free_blocks"] == m.block_pool.get_num_free_blocks()
    # A teaching-sized pool is listed whole.
    small = make_manager()
    assert small.snapshot()["sparse"] is False and len(small.snapshot()["blocks"]) == 11
