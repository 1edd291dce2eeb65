"""The priority scheduling policy (--scheduling-policy priority), GPU-free with fabricated outputs.

As v0.27.1: waiting requests are admitted by (priority, arrival_time) (lower
first), and a running request short of blocks preempts the running request
with the largest (priority, arrival_time), even one already scheduled in this
step, whose tokens then go back to the budget.
"""
from __future__ import annotations

import pytest

from tests.unit.core_utils import new_scheduler
from tests.unit.test_scheduler import create_request, make_output, outputs_by_id, step
from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.request_queue import (FCFSRequestQueue, PriorityRequestQueue, SchedulingPolicy,
                                                   create_request_queue)
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.engine.protocol import EngineCoreEventType


def priority_scheduler(max_num_seqs: int = 16, max_num_batched_tokens: int = 8192, block_size: int = 4,
                       num_blocks: int = 1000, max_model_len: int = 64, policy: str = "priority",
                       enable_prefix_caching: bool = False) -> Scheduler:
    config = VllmConfig(
        ModelConfig(model="fake", max_model_len=max_model_len),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, policy=policy))
    return new_scheduler(config, num_blocks)


def request(req_id: str, num_tokens: int, priority: int, arrival_time: float, max_tokens: int = 16) -> Request:
    req = create_request(req_id, num_tokens, block_size=4, max_tokens=max_tokens)
    req.priority, req.arrival_time = priority, arrival_time
    return req


def test_priority_queue_orders_by_priority_then_arrival_then_id():
    q = PriorityRequestQueue()
    reqs = [request("c", 4, 1, 1.0), request("a", 4, 0, 3.0), request("b", 4, 0, 2.0), request("d", 4, 0, 2.0)]
    for r in reqs:
        q.add_request(r)
    assert [r.request_id for r in q] == ["b", "d", "a", "c"] and len(q) == 4 and q
    assert q.peek_request().request_id == "b"
    q.prepend_request(request("z", 4, -1, 9.0))      # no front in a heap: its priority decides
    assert q.pop_request().request_id == "z"
    q.remove_requests([reqs[1]])
    assert [r.request_id for r in q] == ["b", "d", "c"]
    other = PriorityRequestQueue()
    other.add_request(request("e", 4, 0, 0.5))
    q.prepend_requests(other)
    assert [q.pop_request().request_id for _ in range(4)] == ["e", "b", "d", "c"] and not q
    with pytest.raises(IndexError):
        q.peek_request()
    assert isinstance(create_request_queue(SchedulingPolicy.FCFS), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)


def test_unknown_policy_is_refused_at_config_time():
    with pytest.raises(ValueError, match="Unknown scheduling policy"):
        SchedulerConfig(policy="lifo")


def test_waiting_requests_are_admitted_by_priority():
    s = priority_scheduler(max_num_seqs=2)
    for r in (request("low", 8, 5, 1.0), request("mid", 8, 1, 2.0), request("high", 8, 0, 3.0)):
        s.add_request(r)
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"high", "mid"}        # the two best, not the two oldest
    assert [r.request_id for r in s.running] == ["high", "mid"]
    fcfs = priority_scheduler(max_num_seqs=2, policy="fcfs")
    for r in (request("low", 8, 5, 1.0), request("mid", 8, 1, 2.0), request("high", 8, 0, 3.0)):
        fcfs.add_request(r)
    assert set(fcfs.schedule().num_scheduled_tokens) == {"low", "mid"}   # fcfs ignores priority


def three_running(policy: str) -> tuple[Scheduler, Request, Request, Request]:
    """4 usable blocks of 4 tokens. 'worst' (priority 9) runs first; then 'best' (0) and
    'mid' (1) are admitted behind it, filling the pool. Running order: worst, best, mid."""
    s = priority_scheduler(num_blocks=5, max_num_batched_tokens=64, policy=policy)
    worst = request("worst", 2, 9, 1.0)
    s.add_request(worst)
    step(s)                                   # worst: 1 block, 3 tokens
    best, mid = request("best", 8, 0, 2.0), request("mid", 2, 1, 3.0)
    s.add_request(best)
    s.add_request(mid)
    step(s)                                   # best: 2 blocks, mid: 1 block; worst: 4 tokens in its block
    assert [r.request_id for r in s.running] == ["worst", "best", "mid"]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    return s, worst, best, mid


def test_preemption_unschedules_a_worse_request_scheduled_earlier_in_the_step():
    """Step 3: worst's next token fits its block: scheduled. best crosses into a new block,
    none is free: the victim is max(priority, arrival) = worst, already scheduled: it is
    taken back (its token returns to the budget), and the loop goes on to mid, not past it."""
    s, worst, best, mid = three_running("priority")
    so = s.schedule()
    assert so.num_scheduled_tokens == {"best": 1, "mid": 1}
    assert so.preempted_req_ids == {"worst"} and worst.status == RequestStatus.PREEMPTED
    assert s.running == [best, mid] and worst.num_computed_tokens == 0
    assert s.kv_cache_manager.get_block_ids("worst") == ([],)
    rec = s.last_step_record
    assert [r.request_id for r in rec.scheduled] == ["best", "mid"] and rec.token_budget_end == 64 - 2
    assert worst.events[-1].type == EngineCoreEventType.PREEMPTED
    assert set(outputs_by_id(s.update_from_output(so, make_output(s, so)))) == {"best", "mid"}


def test_fcfs_preempts_the_last_admitted_instead():
    s, worst, best, mid = three_running("fcfs")
    so = s.schedule()
    assert so.num_scheduled_tokens == {"worst": 1, "best": 1} and so.preempted_req_ids == {"mid"}


def test_a_preempted_request_resumes_in_priority_order():
    s, worst, best, mid = three_running("priority")
    s.update_from_output(so := s.schedule(), make_output(s, so))
    late = request("late", 2, 5, 9.0)          # worse than nothing waiting yet, better than worst
    s.add_request(late)
    assert [r.request_id for r in s.waiting] == ["late", "worst"]
