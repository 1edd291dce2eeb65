"""KV cache events (BlockStored / BlockRemoved / AllBlocksCleared), as v0.27.1 publishes them.

GPU-free: the block pool and the scheduler with fabricated outputs, and the
ZMQ publisher over an ipc:// socket (a subscriber in this process).
"""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from tests.unit.core_utils import new_scheduler
from tests.unit.test_block_pool import make_request, new_pool
from tests.unit.test_scheduler import create_request, step
from vllm_anatomy.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm_anatomy.core.kv_cache_utils import maybe_convert_block_hash
from vllm_anatomy.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventPublisherFactory,
                                                KVEventBatch, NullEventPublisher, ZmqEventPublisher)
from vllm_anatomy.engine.arg_utils import EngineArgs, parse_kv_events_config


def as_int(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def test_block_stored_carries_hashes_parent_tokens_and_the_salt():
    pool = new_pool(6, kv_events=True)
    req = make_request("a", list(range(12)), cache_salt="tenant")      # 3 full blocks of 4
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, kv_cache_group_id=0)
    pool.cache_full_blocks(req, blocks, 2, 3, 4, kv_cache_group_id=0)
    first, second = pool.take_events()
    assert isinstance(first, BlockStored) and first.block_size == 4 and first.medium == "GPU"
    # Ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the hash's last 8 bytes.
    assert first.block_hashes == [as_int(h) for h in req.block_hashes[:2]] and first.parent_block_hash is None
    assert first.token_ids == list(range(8)) and first.extra_keys == [("tenant",), None]
    assert first.group_idx == 0 and first.lora_id is None and first.lora_name is None
    # The next call chains from the last cached block.
    assert second.parent_block_hash == as_int(req.block_hashes[1]) and second.token_ids == list(range(8, 12))
    assert pool.take_events() == []


def test_raw_block_hashes_when_asked(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    pool = new_pool(3, kv_events=True)
    req = make_request("a", list(range(4)))
    pool.cache_full_blocks(req, pool.get_new_blocks(1), 0, 1, 4, kv_cache_group_id=0)
    [stored] = pool.take_events()
    assert stored.block_hashes == [req.block_hashes[0]] == [maybe_convert_block_hash(req.block_hashes[0])]


def test_eviction_and_reset_are_removed_and_cleared_events():
    pool = new_pool(3, kv_events=True)
    req = make_request("a", list(range(4)))
    [blk] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1, 4, kv_cache_group_id=0)
    pool.free_blocks([blk])
    pool.get_new_blocks(2)                                # the cached block is popped and rewritten
    stored, removed = pool.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes
    assert removed.group_idx == 0 and removed.medium == "GPU"
    pool.free_blocks(pool.blocks[1:3])
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]


def test_the_dashboard_block_events_come_from_the_same_mutators_and_stay_separate():
    pool = new_pool(3, kv_events=True, block_pool_events=True)
    req = make_request("a", list(range(4)))
    pool.cache_full_blocks(req, pool.get_new_blocks(1), 0, 1, 4, kv_cache_group_id=0)
    assert [e.kind for e in pool.take_block_pool_events()] == ["allocate", "cache"]
    assert [type(e).__name__ for e in pool.take_events()] == ["BlockStored"]


class ListPublisher(NullEventPublisher):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[KVEventBatch] = []

    def publish(self, events) -> None:
        self.batches.append(events)


def events_scheduler(kv_events_config: KVEventsConfig | None):
    config = VllmConfig(ModelConfig(model="fake", max_model_len=64), CacheConfig(block_size=4),
                        SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                        kv_events_config=kv_events_config)
    return new_scheduler(config, 50)


def test_scheduler_publishes_one_batch_per_step_labelled_full_attention():
    s = events_scheduler(KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    assert s.enable_kv_cache_events and s.kv_cache_manager.block_pool.enable_kv_cache_events
    s.kv_event_publisher = pub = ListPublisher()
    s.add_request(create_request("a", 10, block_size=4, max_tokens=3))
    step(s)                                               # 2 full prompt blocks cached
    step(s)
    step(s)                                               # 12 tokens: the third block full
    assert [len(b.events) for b in pub.batches] == [1, 1]  # no event, no batch
    first = pub.batches[0].events[0]
    assert first.kv_cache_spec_kind == "full_attention" and first.kv_cache_spec_sliding_window is None
    assert pub.batches[0].ts <= pub.batches[1].ts


def test_events_off_means_no_events_and_a_null_publisher():
    s = events_scheduler(None)
    assert not s.enable_kv_cache_events and isinstance(s.kv_event_publisher, NullEventPublisher)
    assert isinstance(EventPublisherFactory.create(KVEventsConfig()), NullEventPublisher)
    with pytest.raises(ValueError, match="Unknown event publisher"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="kafka")


def test_zmq_publisher_sends_batches_and_replays_them(tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    pub = EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint,
                                                      replay_endpoint=replay, topic="kv"))
    assert isinstance(pub, ZmqEventPublisher) and pub.get_publisher_config().endpoint == endpoint
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batch = KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, 2],
                                                     block_size=2, lora_id=None, medium="GPU", lora_name=None),
                                         BlockRemoved(block_hashes=[7], medium="GPU"), AllBlocksCleared()])
    try:
        # NOTE: PUB drops what it sends before the subscription reaches it ("slow
        # joiner"): publish until one arrives, as a router that connects late would see.
        deadline, frames = time.monotonic() + 10, None
        while frames is None and time.monotonic() < deadline:
            pub.publish(batch)
            if sub.poll(100):
                frames = sub.recv_multipart()
        assert frames is not None, "no batch arrived"
        topic, seq, payload = frames
        got = decoder.decode(payload)
        assert topic == b"kv" and got.events == batch.events and got.data_parallel_rank == 0
        # Replay: a DEALER asks for every batch from sequence 0.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(10_000), "replay did not answer"
            _, r_topic, r_seq, r_payload = dealer.recv_multipart()
            if r_seq == ZmqEventPublisher.END_SEQ:
                break
            replayed.append(int.from_bytes(r_seq, "big"))
            assert decoder.decode(r_payload).events == batch.events
        assert replayed == list(range(len(replayed))) and int.from_bytes(seq, "big") in replayed
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.shutdown()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(batch)


def test_endpoint_ports_are_offset_per_data_parallel_rank():
    assert ZmqEventPublisher.offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert ZmqEventPublisher.offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert ZmqEventPublisher.offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"


def test_kv_events_config_from_the_command_line():
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}')
    assert config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:6000")
    with pytest.raises(Exception, match="topics"):
        parse_kv_events_config('{"topics": "x"}')
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}',
                              "--scheduling-policy", "priority", "--max-num-scheduled-tokens", "64"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.kv_events_config.enable_kv_cache_events and engine_args.scheduling_policy == "priority"
    assert engine_args.max_num_scheduled_tokens == 64
