"""BlockPool, FreeKVCacheBlockQueue, KVCacheBlock and block hashing (CPU, no model)."""
from __future__ import annotations

import hashlib
import pickle

import pytest

from vllm_anatomy.core import kv_cache_utils
from vllm_anatomy.core.block_pool import BlockPool
from vllm_anatomy.core.kv_cache_utils import (FreeKVCacheBlockQueue, KVCacheBlock, PrefixCacheStats,
                                              get_request_block_hasher, hash_block_tokens, init_none_hash,
                                              sha256)
from vllm_anatomy.core.request import Request
from vllm_anatomy.sampling_params import SamplingParams


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def make_request(req_id: str, prompt: list[int], block_size: int = 4, cache_salt: str | None = None) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8), cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(block_size, sha256))


# ---- FreeKVCacheBlockQueue ---------------------------------------------------------------

def test_free_queue_starts_in_block_id_order_and_pops_from_front():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 2, 3, 4]
    assert q.popleft().block_id == 0
    assert [b.block_id for b in q.popleft_n(2)] == [1, 2]
    assert q.num_free_blocks == 2
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None


def test_free_queue_remove_append_prepend_keep_links_consistent():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])                      # from the middle, O(1)
    q.remove(blocks[0])                      # the first one
    q.remove(blocks[5])                      # the last one
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4]
    q.append(blocks[5])
    q.prepend_n([blocks[0], blocks[2]])      # order is kept at the front
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 2, 1, 3, 4, 5]
    assert q.num_free_blocks == 6
    # Walk backwards too: prev links must mirror next links.
    back, b = [], q.fake_free_list_tail.prev_free_block
    while b is not q.fake_free_list_head:
        back.append(b.block_id)
        b = b.prev_free_block
    assert back == [5, 4, 3, 1, 2, 0]


def test_free_queue_errors():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.popleft_n(3)
    q.popleft_n(2)
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])                  # not in the queue any more
    q.append_n([])
    q.prepend_n([])
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []


# ---- KVCacheBlock ------------------------------------------------------------------------

def test_block_hash_is_set_once_and_reset_on_eviction():
    blk = KVCacheBlock(3)
    assert blk.block_hash is None
    blk.block_hash = kv_cache_utils.BlockHash(b"x" * 32)
    with pytest.raises(AssertionError):
        blk.block_hash = kv_cache_utils.BlockHash(b"y" * 32)
    blk.reset_hash()
    assert blk.block_hash is None
    assert "block_id=3" in repr(blk)


# ---- BlockPool ---------------------------------------------------------------------------

def test_null_block_is_block_zero_and_never_free():
    pool = BlockPool(num_gpu_blocks=5, enable_caching=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0


def test_get_new_blocks_sets_ref_cnt_and_usage():
    pool = BlockPool(num_gpu_blocks=5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == pytest.approx(3 / 4)   # null block excluded
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [4]                      # the failed call took nothing


def test_free_blocks_hashed_to_tail_unhashed_to_front():
    pool = BlockPool(num_gpu_blocks=7, enable_caching=True)
    req = make_request("a", list(range(8)))           # two full blocks -> two hashes
    blocks = pool.get_new_blocks(3)                   # ids 1, 2, 3
    pool.cache_full_blocks(req, blocks, 0, 2, 4)      # 1 and 2 hashed, 3 not
    assert free_ids(pool) == [4, 5, 6]
    pool.free_blocks(reversed(blocks))                # as the manager does: tail first
    # Unhashed 3 goes to the front (reused first), hashed 2 then 1 to the tail.
    assert free_ids(pool) == [3, 4, 5, 6, 2, 1]
    assert all(b.ref_cnt == 0 for b in blocks)
    assert blocks[0].block_hash == req.block_hashes[0]   # freeing keeps the hash


def test_free_blocks_without_caching_all_go_to_the_tail():
    # v0.27.1: with prefix caching off every freed block is appended (a FIFO
    # free queue); only with caching on do unhashed blocks jump to the front.
    pool = BlockPool(num_gpu_blocks=7, enable_caching=False)
    blocks = pool.get_new_blocks(3)                   # ids 1, 2, 3
    assert free_ids(pool) == [4, 5, 6]
    pool.free_blocks(reversed(blocks))                # tail first, as the manager does
    assert free_ids(pool) == [4, 5, 6, 3, 2, 1]
    assert pool.get_new_blocks(1)[0].block_id == 4    # the oldest free block is reused first


def test_shared_block_is_freed_only_at_ref_cnt_zero_and_touch_removes_from_queue():
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True)
    req = make_request("a", list(range(4)))
    [blk] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1, 4)
    pool.touch([blk])                                 # a second request hits it
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in free_ids(pool)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and free_ids(pool)[-1] == blk.block_id
    pool.touch([blk])                                 # a hit on a free cached block
    assert blk.ref_cnt == 1 and blk.block_id not in free_ids(pool)
    assert pool.get_num_free_blocks() == 2


def test_get_new_blocks_evicts_stale_hash():
    pool = BlockPool(num_gpu_blocks=3, enable_caching=True, enable_kv_cache_events=True)
    req = make_request("a", list(range(4)))
    [blk] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1, 4)
    h = req.block_hashes[0]
    assert pool.get_cached_block(h) is blk
    pool.free_blocks([blk])
    assert pool.get_cached_block(h) is blk            # still cached while free
    pool.take_events()
    got = pool.get_new_blocks(2)                      # 2 (unhashed) then 1 (cached)
    assert [b.block_id for b in got] == [2, 1]
    assert blk.block_hash is None and pool.get_cached_block(h) is None
    assert h not in pool.cached_block_hash_to_block
    kinds = [(e.kind, e.block_ids) for e in pool.take_events()]
    assert kinds == [("evict", [1]), ("allocate", [2, 1])]
    assert pool.take_events() == []                   # drained


def test_duplicate_hashes_are_kept_and_evicted_one_by_one():
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True)
    a, b = make_request("a", list(range(4))), make_request("b", list(range(4)))
    [blk_a] = pool.get_new_blocks(1)
    [blk_b] = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [blk_a], 0, 1, 4)
    pool.cache_full_blocks(b, [blk_b], 0, 1, 4)       # same content, computed twice
    h = a.block_hashes[0]
    assert set(pool.cached_block_hash_to_block[h]) == {blk_a.block_id, blk_b.block_id}
    pool.free_blocks([blk_a])
    pool.get_new_blocks(2)                            # pops 3, then blk_a (evicted)
    assert pool.get_cached_block(h) is blk_b          # the other copy is still found


def test_caching_disabled_never_evicts_or_records_hashes():
    pool = BlockPool(num_gpu_blocks=3, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 1]                   # unhashed: prepended in (reversed) free order
    assert pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache_only_when_all_blocks_free():
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, enable_kv_cache_events=True)
    req = make_request("a", list(range(4)))
    [blk] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1, 4)
    assert not pool.reset_prefix_cache()              # blk is in use
    assert pool.get_cached_block(req.block_hashes[0]) is blk
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache()
    assert blk.block_hash is None and pool.cached_block_hash_to_block == {}
    assert pool.take_events()[-1].kind == "reset"


def test_events_off_by_default():
    pool = BlockPool(num_gpu_blocks=3, enable_caching=True)
    pool.free_blocks(pool.get_new_blocks(2))
    assert pool.take_events() == []


# ---- hashing -----------------------------------------------------------------------------

def _independent_sha256(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def test_block_hash_equals_independent_recomputation():
    none_hash = kv_cache_utils.NONE_HASH
    assert isinstance(none_hash, bytes) and len(none_hash) == 32
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]    # two full blocks + one token
    req = make_request("a", prompt)
    h0 = _independent_sha256((none_hash, (11, 12, 13, 14), None))
    h1 = _independent_sha256((h0, (15, 16, 17, 18), None))
    assert req.block_hashes == [h0, h1]
    assert hash_block_tokens(sha256, None, [11, 12, 13, 14]) == h0


def test_hasher_only_hashes_full_blocks_and_follows_appended_tokens():
    req = make_request("a", [1, 2, 3, 4, 5, 6])
    assert len(req.block_hashes) == 1
    req.append_output_token_ids(7)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([8, 9])
    assert len(req.block_hashes) == 2
    again = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert again.block_hashes == req.block_hashes    # same tokens, same chain


def test_chained_hash_depends_on_prefix_and_salt_only_on_first_block():
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request("b", [9, 2, 3, 4, 5, 6, 7, 8])
    assert a.block_hashes[1] != b.block_hashes[1]    # same tokens, different parent
    salted = make_request("s", [1, 2, 3, 4, 5, 6, 7, 8], cache_salt="tenant-1")
    none_hash = kv_cache_utils.NONE_HASH
    expected0 = _independent_sha256((none_hash, (1, 2, 3, 4), ("cache_salt", "tenant-1")))
    assert salted.block_hashes[0] == expected0
    expected1 = _independent_sha256((expected0, (5, 6, 7, 8), None))
    assert salted.block_hashes[1] == expected1


def test_init_none_hash_is_random_unless_pythonhashseed(monkeypatch):
    # v0.27.1: os.urandom(32) without PYTHONHASHSEED, hash_fn(seed) with it.
    try:
        monkeypatch.setenv("PYTHONHASHSEED", "123")
        init_none_hash(sha256)
        assert kv_cache_utils.NONE_HASH == _independent_sha256("123")
        init_none_hash(sha256)
        assert kv_cache_utils.NONE_HASH == _independent_sha256("123")   # reproducible
        monkeypatch.delenv("PYTHONHASHSEED")
        init_none_hash(sha256)
        first = kv_cache_utils.NONE_HASH
        init_none_hash(sha256)
        assert len(first) == 32 and kv_cache_utils.NONE_HASH != first
        assert first != _independent_sha256("123")
    finally:
        monkeypatch.undo()
        init_none_hash(sha256)


def test_prefix_cache_stats_count_tokens_and_split_preempted():
    stats = PrefixCacheStats()
    stats.record(num_tokens=40, num_hits=32, preempted=False)
    stats.record(num_tokens=10, num_hits=0, preempted=False)
    stats.record(num_tokens=20, num_hits=16, preempted=True)
    assert (stats.requests, stats.queries, stats.hits) == (2, 50, 32)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 20, 16)
