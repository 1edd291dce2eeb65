"""The Scheduler and KVCacheManager API as v0.27.1 declares it, and the knobs that came with it:
max_num_scheduled_tokens, the watermark, reset_prefix_cache(reset_running_requests=True).
GPU-free, fabricated outputs."""
from __future__ import annotations

import time

import pytest

from tests.unit.core_utils import new_scheduler
from tests.unit.test_async_scheduler import Pipeline
from tests.unit.test_async_scheduler import create_request as create_async_request
from tests.unit.test_async_scheduler import create_scheduler as create_async_scheduler
from tests.unit.test_scheduler import create_request, create_scheduler, make_output, step
from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm_anatomy.core.kv_cache_coordinator import KVCacheCoordinatorNoPrefixCache, UnitaryKVCacheCoordinator
from vllm_anatomy.core.request import RequestStatus
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.core.single_type_kv_cache_manager import FullAttentionManager
from vllm_anatomy.engine.protocol import EngineCoreEventType


def test_absent_features_have_vllms_none_values():
    s = create_scheduler()
    assert s.connector is None and s.ec_connector is None and s.encoder_cache_manager is None
    assert s.get_kv_connector() is None and s.get_kv_event_publisher_config() is None
    coordinator = s.kv_cache_manager.coordinator
    assert isinstance(coordinator, UnitaryKVCacheCoordinator)
    [manager] = coordinator.single_type_managers
    assert isinstance(manager, FullAttentionManager) and manager.kv_cache_group_id == 0
    assert s.kv_cache_manager.block_pool is coordinator.block_pool is manager.block_pool
    off = create_scheduler(enable_prefix_caching=False)
    assert isinstance(off.kv_cache_manager.coordinator, KVCacheCoordinatorNoPrefixCache)


def test_get_computed_blocks_returns_vllms_three_values():
    s = create_scheduler(block_size=4, num_blocks=20)
    a = create_request("a", list(range(1, 10)), block_size=4)
    s.add_request(a)
    step(s)
    b = create_request("b", list(range(1, 10)), block_size=4)
    blocks, num_tokens, shared_prefix_boundary = s.kv_cache_manager.get_computed_blocks(b)
    assert num_tokens == 8 and blocks.get_block_ids() == ([1, 2],) and shared_prefix_boundary == 0
    s.add_request(b)
    step(s)                                                       # b shares a's two full blocks
    assert s.kv_cache_manager.get_num_common_prefix_blocks("a") == [2]


def test_preempt_request_takes_the_steps_timestamp():
    s = create_scheduler()
    r = create_request("r", 10)
    s.add_request(r)
    step(s)
    s.running.remove(r)
    s._preempt_request(r, 123.5)
    assert r.events[-1].type == EngineCoreEventType.PREEMPTED and r.events[-1].timestamp == 123.5
    assert r.status == RequestStatus.PREEMPTED and s.waiting.peek_request() is r
    assert s.reset_preempted_req_ids == {"r"}
    assert s.schedule().preempted_req_ids == {"r"} and s.reset_preempted_req_ids == set()


def test_finish_requests_returns_the_finished_and_none_finishes_all():
    s = create_scheduler()
    for i in range(3):
        s.add_request(create_request(f"r{i}", 5))
    step(s)
    assert [r.request_id for r in s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)] == ["r1"]
    assert s.finish_requests("r1", RequestStatus.FINISHED_ABORTED) == []      # already finished
    assert sorted(r.request_id for r in s.finish_requests(None, RequestStatus.FINISHED_ABORTED)) == ["r0", "r2"]
    assert not s.has_unfinished_requests()


def test_finished_set_only_when_included():
    config = create_scheduler().vllm_config
    s = new_scheduler(config, 100, Scheduler, include_finished_set=False)
    assert s.finished_req_ids_dict is None
    s.add_request(create_request("a", 4, max_tokens=1))
    so = s.schedule()
    [eco] = s.update_from_output(so, make_output(s, so)).values()
    assert eco.finished_requests is None and eco.outputs[0].finished


def scheduler_with(**scheduler_kwargs) -> Scheduler:
    config = VllmConfig(ModelConfig(model="fake", max_model_len=64), CacheConfig(block_size=4),
                        SchedulerConfig(max_model_len=64, **scheduler_kwargs))
    return new_scheduler(config, 11)                  # 10 usable blocks


def test_max_num_scheduled_tokens_is_the_budget():
    s = scheduler_with(max_num_batched_tokens=64, max_num_scheduled_tokens=10)
    assert s.max_num_scheduled_tokens == 10
    s.add_request(create_request("a", 16, block_size=4))
    s.add_request(create_request("b", 16, block_size=4))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 10} and so.total_num_scheduled_tokens == 10
    assert scheduler_with(max_num_batched_tokens=64).max_num_scheduled_tokens == 64


def test_watermark_keeps_blocks_free_for_running_requests():
    """watermark 0.2 of 11 blocks = 2 blocks kept free when admitting beside running requests;
    the first request of an idle engine is admitted regardless."""
    s = scheduler_with(max_num_batched_tokens=64, watermark=0.2)
    assert s.kv_cache_manager.watermark_blocks == 2
    s.add_request(create_request("a", 26, block_size=4))          # 7 blocks: admitted (nothing runs)
    step(s)                                                       # a's 27th token still fits its 7th block
    s.add_request(create_request("b", 4, block_size=4))           # 1 block + 2 kept free <= 3 free: admitted
    s.add_request(create_request("c", 8, block_size=4))           # 2 blocks + 2 kept free > 2 free: waits
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    without = scheduler_with(max_num_batched_tokens=64)
    without.add_request(create_request("a", 26, block_size=4))
    step(without)
    without.add_request(create_request("b", 4, block_size=4))
    without.add_request(create_request("c", 8, block_size=4))
    assert set(without.schedule().num_scheduled_tokens) == {"a", "b", "c"}
    with pytest.raises(ValueError, match="watermark"):
        SchedulerConfig(watermark=1.0)


def test_reset_prefix_cache_preempts_running_requests_when_asked():
    s = create_scheduler(block_size=4, num_blocks=20, max_model_len=64)
    a, b = create_request("a", 9, block_size=4, max_tokens=5), create_request("b", 6, block_size=4, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert not s.reset_prefix_cache()                             # blocks are held
    assert s.reset_prefix_cache(reset_running_requests=True)
    assert not s.running and [r.request_id for r in s.waiting] == ["a", "b"]     # their order kept
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 19 and all(blk.block_hash is None for blk in pool.blocks)
    so = s.schedule()
    # Resumed at once, recomputing everything (nothing cached any more), as resumed requests
    # whose full token lists the worker takes (they were not in the last step, for it).
    assert so.num_scheduled_tokens == {"a": 10, "b": 7}
    assert so.scheduled_cached_reqs.resumed_req_ids == {"a", "b"}
    assert set(so.scheduled_cached_reqs.all_token_ids) == {"a", "b"} and so.preempted_req_ids == {"a", "b"}
    s.update_from_output(so, make_output(s, so))
    while s.has_unfinished_requests():
        step(s)
    assert a.num_output_tokens == b.num_output_tokens == 5


def test_reset_prefix_cache_drops_in_flight_output_under_async_scheduling():
    """Async scheduling: a's next token is in flight when the cache is reset. The resumed
    request recomputes that position; the late token is dropped, not delivered twice."""
    s = create_async_scheduler(block_size=4, num_blocks=30, max_model_len=64)
    a = create_async_request("a", range(1, 10), block_size=4, max_tokens=4)
    s.add_request(a)
    # The fabricated model's token depends only on the position it samples: a recompute
    # samples the same token again.
    p = Pipeline(s, token_for=lambda req_id, step_id: 200 + s.requests[req_id].num_computed_tokens)
    p.launch()
    p.launch()                                                    # two steps in flight
    p.finish()                                                    # the prefill's token arrives
    assert s.reset_prefix_cache(reset_running_requests=True, reset_connector=False)
    assert a.drop_stale_output and a.num_stale_output_tokens == 1
    p.run()
    # 209: the prefill's; the in-flight step's 210 is dropped, the recompute samples 210 again.
    assert p.outputs["a"] == [209, 210, 211, 212] and p.finish_reasons["a"] == "length"
    assert a.num_stale_output_tokens == 0


def test_start_up_checks_live_in_the_config_not_the_scheduler():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(max_model_len=32, long_prefill_token_threshold=64)
    # A KV cache smaller than one max_model_len sequence builds (EngineCore refuses it at start-up).
    assert create_scheduler(block_size=4, num_blocks=3, max_model_len=64).kv_cache_manager.usage == 0.0


def test_schedule_records_one_timestamp_for_its_events():
    s = create_scheduler()
    s.add_request(a := create_request("a", 4))
    s.add_request(b := create_request("b", 4))
    before = time.monotonic()
    s.schedule()
    [ts_a] = [e.timestamp for e in a.events if e.type == EngineCoreEventType.SCHEDULED]
    [ts_b] = [e.timestamp for e in b.events if e.type == EngineCoreEventType.SCHEDULED]
    assert ts_a == ts_b >= before
