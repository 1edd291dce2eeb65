"""BlockPool, FreeKVCacheBlockQueue, KVCacheBlock and block hashing (CPU, no model)."""
from __future__ import annotations

import hashlib
import pickle

import pytest

from vllm_anatomy.core import kv_cache_utils
from vllm_anatomy.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm_anatomy.core.kv_cache_utils import (FreeKVCacheBlockQueue, KVCacheBlock, PrefixCacheStats,
                                              generate_block_hash_extra_keys, get_block_hash, get_group_id,
                                              get_request_block_hasher, hash_block_tokens, init_none_hash,
                                              make_block_hash_with_group_id, sha256)
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
    assert blk.block_hash is None and blk.block_hash_num_tokens is None
    key = make_block_hash_with_group_id(kv_cache_utils.BlockHash(b"x" * 32), 0)
    blk.set_block_hash(key, num_tokens=16)
    assert blk.block_hash == key and blk.block_hash_num_tokens == 16
    with pytest.raises(AssertionError):
        blk.set_block_hash(make_block_hash_with_group_id(kv_cache_utils.BlockHash(b"y" * 32), 0))
    blk.reset_hash()
    assert blk.block_hash is None and blk.block_hash_num_tokens is None
    assert "block_id=3" in repr(blk)


def test_block_hash_with_group_id_round_trips():
    h = kv_cache_utils.BlockHash(bytes(range(32)))
    key = make_block_hash_with_group_id(h, 258)
    assert key == h + b"\x00\x00\x01\x02" and len(key) == 36
    assert get_block_hash(key) == h and get_group_id(key) == 258
    assert make_block_hash_with_group_id(h, 0) != make_block_hash_with_group_id(h, 1)


# ---- BlockHashToBlockMap -----------------------------------------------------------------

def test_block_hash_map_keeps_duplicates_and_pops_by_block_id():
    m = BlockHashToBlockMap()
    key = make_block_hash_with_group_id(kv_cache_utils.BlockHash(b"k" * 32), 0)
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    assert m.get_one_block(key) is None and len(m) == 0
    m.insert(key, a)
    assert m.get_one_block(key) is a and m.contain(key, 1) and not m.contain(key, 2)
    m.insert(key, b)                                  # a second block with the same content
    assert len(m) == 1 and m.contain(key, 1) and m.contain(key, 2)
    assert m.pop(key, 3) is None                      # not cached under this key: nothing changes
    assert m.pop(key, 1) is a and m.get_one_block(key) is b
    assert m.pop(key, 1) is None
    assert m.pop(key, 2) is b and len(m) == 0 and m.get_one_block(key) is None


# ---- BlockPool ---------------------------------------------------------------------------

def new_pool(num_gpu_blocks: int, enable_caching: bool = True, kv_events: bool = False,
             block_pool_events: bool = False) -> BlockPool:
    pool = BlockPool(num_gpu_blocks, enable_caching, hash_block_size=4, enable_kv_cache_events=kv_events)
    pool.record_block_pool_events = block_pool_events
    return pool


def cached(pool: BlockPool, block_hash) -> KVCacheBlock | None:
    """The block a lookup finds for this request block hash (group 0), or None."""
    blocks = pool.get_cached_block(block_hash, [0])
    return blocks[0] if blocks is not None else None


def test_null_block_is_block_zero_and_never_free():
    pool = new_pool(5)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0


def test_get_new_blocks_sets_ref_cnt_and_usage():
    pool = new_pool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == pytest.approx(3 / 4)   # null block excluded
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [4]                      # the failed call took nothing


def test_free_blocks_hashed_to_tail_unhashed_to_front():
    pool = new_pool(7)
    req = make_request("a", list(range(8)))           # two full blocks -> two hashes
    blocks = pool.get_new_blocks(3)                   # ids 1, 2, 3
    pool.cache_full_blocks(req, blocks, 0, 2, 4, kv_cache_group_id=0)      # 1 and 2 hashed, 3 not
    assert free_ids(pool) == [4, 5, 6]
    pool.free_blocks(reversed(blocks))                # as the manager does: tail first
    # Unhashed 3 goes to the front (reused first), hashed 2 then 1 to the tail.
    assert free_ids(pool) == [3, 4, 5, 6, 2, 1]
    assert all(b.ref_cnt == 0 for b in blocks)
    # Freeing keeps the hash; the key is the request's block hash with group id 0.
    assert blocks[0].block_hash == make_block_hash_with_group_id(req.block_hashes[0], 0)
    assert blocks[1].block_hash_num_tokens == 8


def test_cache_full_blocks_keys_by_group_id():
    pool = new_pool(4)
    req = make_request("a", list(range(4)))
    [blk] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1, 4, kv_cache_group_id=1)
    assert cached(pool, req.block_hashes[0]) is None                        # not in group 0
    assert pool.get_cached_block(req.block_hashes[0], [1]) == [blk]
    assert pool.get_cached_block(req.block_hashes[0], [0, 1]) is None       # a hit must hold in every group


def test_free_blocks_without_caching_all_go_to_the_tail():
    # v0.27.1: with prefix caching off every freed block is appended (a FIFO
    # free queue); only with caching on do unhashed blocks jump to the front.
    pool = new_pool(7, enable_caching=False)
    blocks = pool.get_new_blocks(3)                   # ids 1, 2, 3
    assert free_ids(pool) == [4, 5, 6]
    pool.free_blocks(reversed(blocks))                # tail first, as the manager does
    assert free_ids(pool) == [4, 5, 6, 3, 2, 1]
    assert pool.get_new_blocks(1)[0].block_id == 4    # the oldest free block is reused first


def test_shared_block_is_freed_only_at_ref_cnt_zero_and_touch_removes_from_queue():
    pool = new_pool(4)
    req = make_request("a", list(range(4)))
    [blk] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1, 4, kv_cache_group_id=0)
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
    pool = new_pool(3, block_pool_events=True)
    req = make_request("a", list(range(4)))
    [blk] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1, 4, kv_cache_group_id=0)
    h = req.block_hashes[0]
    assert cached(pool, h) is blk
    pool.free_blocks([blk])
    assert cached(pool, h) is blk                     # still cached while free
    pool.take_block_pool_events()
    got = pool.get_new_blocks(2)                      # 2 (unhashed) then 1 (cached)
    assert [b.block_id for b in got] == [2, 1]
    assert blk.block_hash is None and cached(pool, h) is None
    assert len(pool.cached_block_hash_to_block) == 0
    kinds = [(e.kind, e.block_ids) for e in pool.take_block_pool_events()]
    assert kinds == [("evict", [1]), ("allocate", [2, 1])]
    assert pool.take_block_pool_events() == []        # drained


def test_duplicate_hashes_are_kept_and_evicted_one_by_one():
    pool = new_pool(4)
    a, b = make_request("a", list(range(4))), make_request("b", list(range(4)))
    [blk_a] = pool.get_new_blocks(1)
    [blk_b] = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [blk_a], 0, 1, 4, kv_cache_group_id=0)
    pool.cache_full_blocks(b, [blk_b], 0, 1, 4, kv_cache_group_id=0)       # same content, computed twice
    key = make_block_hash_with_group_id(a.block_hashes[0], 0)
    assert pool.cached_block_hash_to_block.contain(key, blk_a.block_id)
    assert pool.cached_block_hash_to_block.contain(key, blk_b.block_id)
    pool.free_blocks([blk_a])
    pool.get_new_blocks(2)                            # pops 3, then blk_a (evicted)
    assert cached(pool, a.block_hashes[0]) is blk_b   # the other copy is still found


def test_caching_disabled_never_evicts_or_records_hashes():
    pool = new_pool(3, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 1]                   # unhashed: prepended in (reversed) free order
    assert len(pool.cached_block_hash_to_block) == 0


def test_reset_prefix_cache_only_when_all_blocks_free():
    pool = new_pool(4, block_pool_events=True)
    req = make_request("a", list(range(4)))
    [blk] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1, 4, kv_cache_group_id=0)
    assert not pool.reset_prefix_cache()              # blk is in use
    assert cached(pool, req.block_hashes[0]) is blk
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache()
    assert blk.block_hash is None and len(pool.cached_block_hash_to_block) == 0
    assert pool.take_block_pool_events()[-1].kind == "reset"


def test_events_off_by_default():
    pool = new_pool(3)
    pool.free_blocks(pool.get_new_blocks(2))
    assert pool.take_block_pool_events() == [] and pool.take_events() == []


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
    # v0.27.1: the salt is the block's only extra key, (salt,), as vLLM hashes it.
    expected0 = _independent_sha256((none_hash, (1, 2, 3, 4), ("tenant-1",)))
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


def test_extra_keys_are_the_salt_on_block_zero_and_pass_the_mm_index_through():
    salted = make_request("s", [1, 2, 3, 4, 5, 6, 7, 8], cache_salt="t")
    assert generate_block_hash_extra_keys(salted, 0, 4, 0) == (("t",), 0)
    assert generate_block_hash_extra_keys(salted, 4, 8, 3) == (None, 3)     # later blocks: no key
    plain = make_request("p", [1, 2, 3, 4])
    assert generate_block_hash_extra_keys(plain, 0, 4, 0) == (None, 0)
