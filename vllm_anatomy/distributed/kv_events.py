"""KV cache events: which blocks entered and left the prefix cache, published over ZMQ.

Mirrors vllm/distributed/kv_events.py. The block pool queues a BlockStored
when cache_full_blocks makes blocks findable, a BlockRemoved when a cached
block is evicted (reused for other tokens), an AllBlocksCleared on
reset_prefix_cache. Once per step the scheduler takes them
(KVCacheManager.take_events) and hands one KVEventBatch to its publisher.

Who reads them: a KV-aware router (llm-d, Dynamo, vLLM's router) keeps, per
engine, the set of block hashes it holds, and sends a request to the engine
that already has the longest prefix of it cached. The hashes are the ones the
engine computed (hash_block_tokens chained from NONE_HASH), so the router
needs the same PYTHONHASHSEED to compute a prompt's hashes itself, or reads
the token ids each BlockStored carries.

Wire format (ZmqEventPublisher, vLLM's): a PUB socket sends each batch as
three frames (topic, 8-byte big-endian sequence number, msgpack of the
KVEventBatch); events are tagged unions (msgspec tag=True: ["BlockStored", ...]).
An optional ROUTER socket replays buffered batches from a sequence number.

Our dashboard's own block events (allocate / free / hit / evict / cache /
reset, core/block_pool.py BlockPoolEvent) come from the same block-pool
mutators; these are the subset a router can use.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from itertools import count
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from vllm_anatomy.core.kv_cache_utils import ExternalBlockHash

if TYPE_CHECKING:
    from vllm_anatomy.config import KVEventsConfig

logger = logging.getLogger(__name__)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events (a tagged union on the wire)."""


MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class BlockStored(KVCacheEvent):
    """Blocks became prefix-cache hits: their hashes, the hash they chain from, their tokens."""
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    # NOTE: LoRA adapters key blocks by name in vLLM; no LoRA here (None).
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block: the extra keys its hash included (here the cache salt, block 0 only).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    # Set by KVCacheManager.take_events from the group's spec ("full_attention").
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # NOTE: LOCAL / REMOTE for events a KV connector relays; None here.
    locality: str | None = None

    def __hash__(self) -> int:
        # (vLLM counts events per worker in a Counter to keep those every worker saw)
        return hash((tuple(self.block_hashes), self.parent_block_hash, tuple(self.token_ids), self.block_size,
                     self.lora_id, self.medium, tuple(self.extra_keys) if self.extra_keys else None,
                     self.group_idx, self.kv_cache_spec_kind, self.kv_cache_spec_sliding_window, self.locality))


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted (their memory reused): their hashes no longer hit."""
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium, self.group_idx, self.locality))


class AllBlocksCleared(KVCacheEvent):
    """reset_prefix_cache: no hash hits any more."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class EventPublisher(ABC):
    """Publishes a scheduler's event batches, stamped with its data-parallel rank."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, events: EventBatch) -> None:
        """Emit one batch, in order (never blocks the engine's step)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Flush and close."""

    def get_publisher_config(self) -> KVEventsConfig | None:
        return None


class NullEventPublisher(EventPublisher):
    """Events off (the default)."""

    def publish(self, events: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher(EventPublisher):
    """PUB socket (and optional ROUTER replay socket), fed by a thread of its own.

    NOTE: publish() only puts the batch on a queue: encoding and sending
    happen on the publisher thread, so a slow or absent subscriber never
    delays a step (past `hwm` queued messages ZMQ drops, as PUB does).
    The endpoint is bound when it is a wildcard (tcp://*:5557), ipc:// or
    inproc://, else connected (a subscriber that binds).
    """

    SHUTDOWN_TIMEOUT: float = 1.0
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, data_parallel_rank: int, endpoint: str = "tcp://*:5557",
                 replay_endpoint: str | None = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "") -> None:
        # (imported here: config imports torch, and the pure core, which imports this module, must not)
        from vllm_anatomy.config import KVEventsConfig
        super().__init__(data_parallel_rank)
        self._event_queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        # (seq, payload) of the last buffer_steps batches, for replay.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx: zmq.Context = zmq.Context.instance()
        self._endpoint = self.offset_endpoint_port(endpoint, data_parallel_rank)
        self._replay_endpoint = self.offset_endpoint_port(replay_endpoint, data_parallel_rank)
        assert self._endpoint is not None
        self._publisher_config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=self._endpoint,
            replay_endpoint=self._replay_endpoint, buffer_steps=buffer_steps, hwm=hwm,
            max_queue_size=max_queue_size, topic=topic)
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._hwm = hwm
        self._socket_setup()
        self._seq_gen = count()
        self._topic_bytes = topic.encode("utf-8")
        self._running = True
        self._thread = threading.Thread(target=self._publisher_thread, daemon=True, name="zmq-publisher")
        self._thread.start()

    def get_publisher_config(self) -> KVEventsConfig:
        return self._publisher_config

    def publish(self, events: EventBatch) -> None:
        if not self._running:
            raise RuntimeError("Publisher is closed")
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self._event_queue.put(events)

    def shutdown(self) -> None:
        """Send what is queued (for at most SHUTDOWN_TIMEOUT s), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._event_queue.put_nowait(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning("KV event publisher: %d batches still queued after %.1f s",
                           self._event_queue.qsize(), self.SHUTDOWN_TIMEOUT)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def _socket_setup(self) -> None:
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self._hwm)
        endpoint = self._endpoint
        assert endpoint is not None
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        if self._replay_endpoint is not None:
            # ROUTER: several subscribers may ask, each answered by its identity.
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(self._replay_endpoint)

    def _publisher_thread(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        assert self._pub is not None
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._service_replay()
                except Exception:
                    logger.exception("KV event publisher: replay failed")
            try:
                batch = self._event_queue.get(timeout=0.1)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if batch is None:
                break           # shutdown's sentinel: everything before it was sent
            try:
                seq = next(self._seq_gen)
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("KV event publisher: send failed")
                time.sleep(0.1)

    def _service_replay(self) -> None:
        """A subscriber sent (identity, b"", start seq): send it every buffered batch from there, then END_SEQ."""
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            logger.warning("KV event publisher: invalid replay request %s", frame)
            return
        client_id, _, start_seq_bytes = frame
        start_seq = int.from_bytes(start_seq_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client_id, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client_id, b"", b"", self.END_SEQ, b""))

    @staticmethod
    def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
        """Each data-parallel rank publishes on its own port (tcp) or name (inproc)."""
        if not endpoint or data_parallel_rank == 0:
            return endpoint
        if "inproc" in endpoint:
            return f"{endpoint}_dp{data_parallel_rank}"
        if "tcp" in endpoint:
            if ":" in endpoint:
                base, port = endpoint.rsplit(":", 1)
                return f"{base}:{int(port) + data_parallel_rank}"
            return endpoint
        raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


class EventPublisherFactory:
    _registry: dict[str, Callable[..., EventPublisher]] = {
        "null": NullEventPublisher,
        "zmq": ZmqEventPublisher,
    }

    @classmethod
    def register_publisher(cls, name: str, ctor: Callable[..., EventPublisher]) -> None:
        if name in cls._registry:
            raise KeyError(f"publisher '{name}' already registered")
        cls._registry[name] = ctor

    @classmethod
    def create(cls, config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
        """The publisher a KVEventsConfig asks for (NullEventPublisher when events are off)."""
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher()
        config_dict = asdict(config)
        kind = config_dict.pop("publisher")
        config_dict.pop("enable_kv_cache_events")
        try:
            constructor = cls._registry[kind]
        except KeyError as exc:
            raise ValueError(f"Unknown event publisher '{kind}'") from exc
        return constructor(data_parallel_rank=data_parallel_rank, **config_dict)
