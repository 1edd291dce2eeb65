"""KV-cache block metadata, the free-block queue and prefix-cache block hashing.

Mirrors vllm/v1/core/kv_cache_utils.py (KVCacheBlock, FreeKVCacheBlockQueue,
hash_block_tokens, generate_block_hash_extra_keys, init_none_hash,
get_request_block_hasher, the BlockHashWithGroupId helpers,
check_enough_kv_cache_memory) plus PrefixCacheStats from
vllm/v1/metrics/stats.py. Only bookkeeping lives here: a KVCacheBlock
describes a slice of the KV tensor on the device, it never holds any KV data itself.

Simplified: one KV-cache group (every key's group id is 0); only SHA-256
over pickle is offered (vLLM also has sha256_cbor and xxhash variants); the
only extra hash key is the cache salt (no LoRA, multimodal or prompt-embeds
keys: none of those inputs exist here).
"""
from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType, Protocol, TypeAlias, cast

from vllm_anatomy import envs
from vllm_anatomy.kv_cache_interface import KVCacheSpec

if TYPE_CHECKING:
    from vllm_anatomy.config import VllmConfig
    from vllm_anatomy.core.request import Request

# The bytes of one block's chained hash (32 bytes for SHA-256).
BlockHash = NewType("BlockHash", bytes)
# A block hash with its KV-cache group id appended (4 bytes, big-endian): the
# key of the prefix-cache map. NOTE: hybrid models cache the same tokens once
# per group (each group has its own blocks); with one group the id is always 0.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
# A block hash as KV cache events publish it: bytes, or (the default) a 64-bit int.
ExternalBlockHash: TypeAlias = bytes | int


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Append the group id to the hash (plain bytes: no tuple allocated per key)."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The block hash part of a key."""
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The KV-cache group id part of a key."""
    return int.from_bytes(key[-4:], "big", signed=False)


def maybe_convert_block_hash(hash_bytes: BlockHash) -> ExternalBlockHash:
    """A block hash as KV cache events carry it (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    if not envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return hash_bytes
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)


def sha256(input: Any) -> bytes:
    """vLLM's default prefix-caching hash: SHA-256 over the pickled object.

    NOTE: pickle of tuples of ints/str/bytes is deterministic, so every
    process computes the same hash for the same tokens (Python's built-in
    hash() is salted per process and could not be shared across processes).
    """
    return hashlib.sha256(pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# The "parent hash" of the first block of every request.
NONE_HASH: BlockHash


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Set NONE_HASH, the seed of every hash chain (EngineCore.__init__ calls this).

    NOTE: as in vLLM v0.27.1, the seed is 32 random bytes unless PYTHONHASHSEED
    is set (then it is hash_fn(PYTHONHASHSEED)), the same rule as Python's own
    hash(). Block hashes are only compared inside the engine core process that
    computed them, so a random seed costs nothing there, and it keeps one
    deployment's hashes from being predicted (or collided on purpose) by another.
    Set PYTHONHASHSEED to get the same hashes in every run, or to share them
    between processes (vLLM's advice for reproducible prefix-cache hashes).
    """
    global NONE_HASH
    hash_seed = os.getenv("PYTHONHASHSEED")
    NONE_HASH = BlockHash(os.urandom(32) if hash_seed is None else hash_fn(hash_seed))


# NOTE: vLLM leaves NONE_HASH unset until EngineCore starts; we set the SHA-256
# default at import so the pure core (and its tests) work on their own.
init_none_hash(sha256)


def hash_block_tokens(
    hash_fn: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block: (parent hash, this block's token ids, extra keys).

    NOTE: the parent hash makes the chain: two blocks with equal tokens but
    different prefixes get different hashes, so a hash hit on block i implies
    that blocks 0..i-1 match too.
    """
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    return BlockHash(hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys)))


def generate_block_hash_extra_keys(request: Request, start_token_idx: int, end_token_idx: int,
                                   start_mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
    """Extra keys of the block [start_token_idx, end_token_idx), and the index of the
    first multimodal input the next block may hold.

    The only extra key here is the cache salt, on the first block: salting
    block 0 is enough, every later hash chains from it. NOTE: vLLM adds a
    LoRA name (every block), (multimodal input hash, its offset in the block)
    for each image the block covers, and prompt-embedding hashes; the
    multimodal index lets the hasher resume where the last block stopped.
    With none of those inputs here the index comes back unchanged.
    """
    if start_token_idx == 0 and request.cache_salt:
        return (request.cache_salt,), start_mm_idx
    return None, start_mm_idx


class RequestBlockHasher(Protocol):
    """What get_request_block_hasher returns: called with a request, it hashes its newly full blocks."""
    block_size: int

    def __call__(self, request: Request) -> list[BlockHash]: ...


def get_request_block_hasher(
    block_size: int, hash_fn: Callable[[Any], bytes]
) -> RequestBlockHasher:
    """The per-request callback that hashes every newly full block.

    Request.__init__ and Request.append_output_token_ids call it, so
    request.block_hashes always covers every full block of all_token_ids.
    Its `block_size` attribute tells the Request when the next block is full
    (until then it skips the call).
    """

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start_token_idx = len(request.block_hashes) * block_size
        num_tokens = request.num_tokens
        if start_token_idx + block_size > num_tokens:
            return []   # no block newly full: the common case, called once per sampled token
        prev_block_hash = request.block_hashes[-1] if request.block_hashes else None
        new_block_hashes: list[BlockHash] = []
        # NOTE: only full blocks are hashed: a partial block's content can still change.
        while start_token_idx + block_size <= num_tokens:
            end_token_idx = start_token_idx + block_size
            block_tokens = request.all_token_ids[start_token_idx:end_token_idx]
            extra_keys, _ = generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, 0)
            block_hash = hash_block_tokens(hash_fn, prev_block_hash, block_tokens, extra_keys)
            new_block_hashes.append(block_hash)
            prev_block_hash = block_hash
            start_token_idx = end_token_idx
        return new_block_hashes

    hasher = cast(RequestBlockHasher, request_block_hasher)
    hasher.block_size = block_size
    return hasher


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one KV-cache block (block_size token slots of every layer).

    NOTE: eq=False: blocks compare by identity (a field-wise __eq__ would walk
    the free list through prev/next).
    """
    block_id: int
    # How many requests hold this block. 0 => it sits in the free queue.
    ref_cnt: int = 0
    # The prefix-cache key (block hash + group id), set only while the block
    # is full and cached (see set_block_hash).
    _block_hash: BlockHashWithGroupId | None = None
    # Prefix tokens the hash covers. NOTE: vLLM's finer-grained hashing for
    # hybrid models can key a block at a boundary inside it; here it is always
    # the end of the block.
    _block_hash_num_tokens: int | None = None
    # Doubly linked free list; touched only by FreeKVCacheBlockQueue.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # The placeholder block 0 (never holds real KV).
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: BlockHashWithGroupId, num_tokens: int | None = None) -> None:
        """Key the block in the prefix cache (BlockPool.cache_full_blocks)."""
        # NOTE: a block is hashed once; re-hashing without reset_hash() would
        # leave a stale entry in BlockPool.cached_block_hash_to_block.
        assert self._block_hash is None and self._block_hash_num_tokens is None, \
            "The block already has a hash. This should not happen."
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        """Forget the hash (the block is evicted from the prefix cache)."""
        self._block_hash = None
        self._block_hash_num_tokens = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"_block_hash={self._block_hash!r}, _block_hash_num_tokens={self._block_hash_num_tokens}, "
                f"prev_free_block={prev_id}, next_free_block={next_id})")


class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list, in eviction order (front first).

    NOTE: hand-written rather than a deque because a prefix-cache hit must take
    a block out of the *middle* of the queue (remove) in O(1), and the links
    live in the blocks themselves so no Python objects are allocated per op.
    Two sentinel blocks (id -1) remove every "is the list empty?" branch.

    Eviction order: least recently freed at the front. Blocks of one request
    are freed in reverse (tail block first) by the caller, so the block covering
    the most tokens is evicted first — its hash is the least likely to be hit.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        # Initially every block is free, in block-id order.
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for prev, nxt in zip(chain, chain[1:]):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Pop the first (next to evict) free block."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        # NOTE: the two sentinels are never unlinked, so every link between them is a block.
        assert block is not None
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop the first n free blocks."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a prefix-cache hit)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the tail, keeping their order."""
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the front (reused first), keeping their order."""
        if not blocks:
            return
        first = self.fake_free_list_head.next_free_block
        assert first is not None
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self, limit: int | None = None) -> list[KVCacheBlock]:
        """Free blocks, front (next to evict) to tail; only the first `limit` if given."""
        ret: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail and (limit is None or len(ret) < limit):
            assert block is not None
            ret.append(block)
            block = block.next_free_block
        return ret

    def get_free_block_ids(self, limit: int | None = None) -> list[int]:
        """The ids of get_all_free_blocks(limit), in one walk (snapshots list them every step)."""
        num_ids = self.num_free_blocks if limit is None else min(limit, self.num_free_blocks)
        ids: list[int] = []
        # (Any: num_ids stops the walk before the tail, so every step is a block; no per-block check)
        block: Any = self.fake_free_list_head.next_free_block
        for _ in range(num_ids):
            ids.append(block.block_id)
            block = block.next_free_block
        return ids


def check_enough_kv_cache_memory(vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec],
                                 available_memory: int) -> None:
    """Refuse a KV cache that cannot hold one sequence of max_model_len tokens.

    NOTE: such a request could never be admitted (its blocks never fit), so
    the engine would wait for it forever: vLLM refuses the configuration at
    start-up (EngineCore._initialize_kv_caches), as here. available_memory:
    the bytes of the usable blocks (EngineCore passes the pool without its
    null block).
    """
    if not kv_cache_spec:
        return
    max_model_len = vllm_config.model_config.max_model_len
    if available_memory <= 0:
        raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                         "(on a CPU: the KV-cache space) when initializing the engine.")
    needed_memory = sum(spec.max_memory_usage_bytes(vllm_config) for spec in kv_cache_spec.values())
    if needed_memory > available_memory:
        bytes_per_token = sum(spec.page_size_bytes / spec.block_size for spec in kv_cache_spec.values())
        block_size = next(iter(kv_cache_spec.values())).block_size
        estimated_max_len = int(available_memory // bytes_per_token) // block_size * block_size
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"{needed_memory / 2**30:.4f} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({available_memory / 2**30:.4f} GiB). Based on the available memory, the estimated maximum "
            f"model length is {estimated_max_len}. Try increasing `gpu_memory_utilization` or decreasing "
            f"`max_model_len` when initializing the engine.")


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last make_prefix_cache_stats() (v1/metrics/stats.py).

    NOTE: queries and hits are counted in *tokens*, not requests, so the hit
    rate is the fraction of prompt tokens that were not recomputed. Resumed
    (preempted) requests go to separate counters: their hits are mostly their
    own freed blocks and would inflate the hit rate.
    """
    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits
