"""Scheduler, vLLM-test style: no model, fabricated ModelRunnerOutputs (CPU only)."""
from __future__ import annotations

import json
import subprocess
import sys
import zlib

import numpy as np
import pytest

from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm_anatomy.core.kv_cache_utils import get_request_block_hasher, sha256
from vllm_anatomy.core.outputs import ModelRunnerOutput
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.output import SchedulerOutput
from vllm_anatomy.core.sched.record import AdmissionStop, DeferReason
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.core.outputs import LogprobsLists
from vllm_anatomy.engine.protocol import EngineCoreEventType, FinishReason
from vllm_anatomy.sampling_params import SamplingParams
from tests.unit.core_utils import new_scheduler


def create_scheduler(max_num_seqs: int = 16, max_num_batched_tokens: int = 8192, block_size: int = 16,
                     num_blocks: int = 10000, max_model_len: int | None = None, enable_prefix_caching: bool = True,
                     enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0) -> Scheduler:
    max_model_len = max_model_len or max_num_batched_tokens
    config = VllmConfig(
        ModelConfig(model="fake", max_model_len=max_model_len),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                        long_prefill_token_threshold=long_prefill_token_threshold))
    return new_scheduler(config, num_blocks)


def create_request(req_id: str, prompt: list[int] | int, block_size: int = 16, max_tokens: int = 16,
                   **sampling_kwargs) -> Request:
    if isinstance(prompt, int):
        # NOTE: a stable offset per id (zlib.crc32, not hash(): str hashes change with every
        # process, and ~1 run in 300 gave two ids the same offset, so a prefix-cache hit)
        prompt = [1000 + zlib.crc32(req_id.encode()) % 1000 + i for i in range(prompt)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **sampling_kwargs),
                   block_hasher=get_request_block_hasher(block_size, sha256))


def make_output(scheduler: Scheduler, so: SchedulerOutput, tokens: dict[str, list[int]] | None = None,
                default: int = 7) -> ModelRunnerOutput:
    """What a worker would return: a token per request whose prompt is complete, [] for a partial chunk."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = scheduler.requests.get(req_id)
        partial = req is not None and req.num_computed_tokens < req.num_tokens
        sampled.append([] if partial else (tokens or {}).get(req_id, [default]))
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def step(scheduler: Scheduler, tokens: dict[str, list[int]] | None = None, default: int = 7):
    so = scheduler.schedule()
    outs = scheduler.update_from_output(so, make_output(scheduler, so, tokens, default))
    return so, outs


def outputs_by_id(outs) -> dict:
    return {o.request_id: o for eco in outs.values() for o in eco.outputs}


# ---- admission, budget, chunked prefill -----------------------------------------------------

def test_add_request_queues_and_records_event():
    s = create_scheduler()
    req = create_request("a", 10)
    s.add_request(req)
    assert list(s.waiting) == [req] and s.requests["a"] is req
    assert [e.type for e in req.events] == [EngineCoreEventType.QUEUED]
    assert s.get_request_counts() == (0, 1) and s.has_requests()
    with pytest.raises(ValueError):
        s.add_request(create_request("a", 3))


def test_schedule_new_requests_builds_scheduler_output():
    s = create_scheduler()
    for i in range(3):
        s.add_request(create_request(f"r{i}", 20))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"r0": 20, "r1": 20, "r2": 20}
    assert so.total_num_scheduled_tokens == 60
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r0", "r1", "r2"]
    assert so.scheduled_new_reqs[0].block_ids == ([1, 2],)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0   # before this step's advance
    assert so.scheduled_cached_reqs.num_reqs == 0
    assert all(s.requests[f"r{i}"].num_computed_tokens == 20 for i in range(3))   # optimistic
    assert all(r.status == RequestStatus.RUNNING for r in s.running) and not s.waiting
    rec = s.last_step_record
    assert rec.token_budget_start - rec.token_budget_end == 60
    assert rec.admission_stop_reason == "queue_empty"
    assert [x.kind for x in rec.scheduled] == ["final_prefill_chunk"] * 3


def test_token_budget_is_shared_running_first_then_waiting():
    s = create_scheduler(max_num_batched_tokens=16, max_model_len=64)
    for i in range(3):
        s.add_request(create_request(f"r{i}", 10))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"r0": 10, "r1": 6}       # r1 chunked, r2 waits
    assert s.last_step_record.admission_stop_reason == "budget_exhausted"
    assert s.last_step_record.token_budget_end == 0
    so, outs = step(s)
    # r0 decodes 1, r1 finishes its prompt (4), r2's whole prompt (10) fits in the 11 left.
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 4, "r2": 10}
    assert set(outputs_by_id(outs)) == {"r0", "r1", "r2"}
    kinds = {x.request_id: x.kind for x in s.last_step_record.scheduled}
    assert kinds == {"r0": "decode", "r1": "final_prefill_chunk", "r2": "final_prefill_chunk"}
    assert so.scheduled_cached_reqs.req_ids == ["r0", "r1"]


def test_chunked_prefill_progression_and_no_output_for_partial_chunks():
    s = create_scheduler(max_num_batched_tokens=16, max_model_len=64)
    req = create_request("a", 50)
    s.add_request(req)
    scheduled, kinds = [], []
    for _ in range(4):
        so, outs = step(s)
        scheduled.append(so.num_scheduled_tokens["a"])
        kinds.append(s.last_step_record.scheduled[0].kind)
        if req.num_output_tokens == 0:
            assert outs[0].outputs == []                        # no partial-prefill output
    assert scheduled == [16, 16, 16, 2]
    assert kinds == ["prefill_chunk"] * 3 + ["final_prefill_chunk"]
    assert req.num_output_tokens == 1 and req.num_computed_tokens == 50
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1} and s.last_step_record.scheduled[0].kind == "decode"


def test_chunked_prefill_disabled_waits_for_a_whole_prompt():
    s = create_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    s.add_request(create_request("a", 20))
    s.add_request(create_request("b", 20))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 20}
    assert s.last_step_record.admission_stop_reason == "chunked_prefill_disabled"
    with pytest.raises(ValueError):
        create_scheduler(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)


def test_long_prefill_token_threshold_caps_every_chunk():
    # v0.27.1 caps every chunk, running and waiting, even of a request alone
    # in the engine (later vLLM lifts the cap for a lone request).
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=128, long_prefill_token_threshold=8)
    s.add_request(create_request("a", 40))
    s.add_request(create_request("b", 40))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}           # running requests capped too
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 8}                   # alone: still capped

    lone = create_scheduler(max_num_batched_tokens=64, max_model_len=128, long_prefill_token_threshold=8)
    lone.add_request(create_request("c", 40))
    assert lone.schedule().num_scheduled_tokens == {"c": 8}
    # A decode (1 token) is below any threshold: the cap only ever shortens prefills.
    lone = create_scheduler(max_num_batched_tokens=64, max_model_len=128, long_prefill_token_threshold=8)
    lone.add_request(create_request("d", 8))
    so, _ = step(lone)
    assert so.num_scheduled_tokens == {"d": 8}
    so, _ = step(lone)
    assert so.num_scheduled_tokens == {"d": 1}


def test_max_num_seqs_stops_admission():
    s = create_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(create_request(f"r{i}", 5))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"} and [r.request_id for r in s.waiting] == ["r2"]
    assert s.last_step_record.admission_stop_reason == "max_num_seqs"


def test_no_free_blocks_stops_admission_without_preempting():
    s = create_scheduler(block_size=4, num_blocks=5, max_model_len=16)   # 4 usable blocks
    s.add_request(create_request("a", 12, block_size=4))                 # 3 blocks
    s.add_request(create_request("b", 8, block_size=4))                  # 2 blocks: does not fit
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 12}
    assert s.last_step_record.admission_stop_reason == "no_free_blocks"
    assert s.last_step_record.preempted_req_ids == []
    assert s.requests["b"].status == RequestStatus.WAITING


def test_new_block_ids_are_increments_for_running_requests():
    s = create_scheduler(block_size=4, num_blocks=20, max_model_len=64)
    s.add_request(create_request("a", 7, block_size=4, max_tokens=10))
    step(s)                                                      # prompt: blocks 1, 2; 8 tokens now
    so, _ = step(s)                                              # slot 7: still block 2
    assert so.scheduled_cached_reqs.new_block_ids == [None]
    so, _ = step(s)                                              # slot 8 opens block 3
    assert so.scheduled_cached_reqs.new_block_ids == [([3],)]
    assert so.scheduled_cached_reqs.num_computed_tokens == [8]  # before the optimistic advance
    assert so.scheduled_cached_reqs.num_output_tokens == [2]


# ---- preemption -----------------------------------------------------------------------------

def test_preemption_victim_is_last_running_and_goes_to_front_of_waiting():
    s = create_scheduler(block_size=4, num_blocks=5, max_model_len=16)   # 4 usable blocks
    a = create_request("a", [1, 2, 3, 4, 5, 6, 7], block_size=4)
    b = create_request("b", [11, 12, 13, 14, 15, 16, 17], block_size=4)
    s.add_request(a)
    s.add_request(b)
    step(s)                                                      # both prefill: 2 blocks each
    step(s)                                                      # both decode slot 7
    c = create_request("c", 3, block_size=4)
    s.add_request(c)
    b_blocks = s.kv_cache_manager.get_block_ids("b")[0]
    so, _ = step(s)                                              # a needs a 3rd block: no free block
    assert so.preempted_req_ids == {"b"} and set(so.num_scheduled_tokens) == {"a"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.num_output_tokens == 2   # outputs are kept
    assert [r.request_id for r in s.waiting] == ["b", "c"]       # front of the queue
    assert [r.request_id for r in s.running] == ["a"]
    assert s.kv_cache_manager.get_block_ids("b") == ([],)
    assert s.kv_cache_manager.get_block_ids("a")[0][2] in b_blocks   # a reused b's freed block
    rec = s.last_step_record
    assert rec.preempted_req_ids == ["b"] and rec.admission_stop_reason == "preempted_this_step"
    assert EngineCoreEventType.PREEMPTED in [e.type for e in b.events]


def test_no_admission_in_a_preempting_step_then_resume_with_full_token_list():
    s = create_scheduler(block_size=4, num_blocks=5, max_model_len=16)   # 4 usable blocks
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    a = create_request("a", prompt, block_size=4)
    s.add_request(a)
    step(s, default=9)                                           # a: blocks 1, 2; 9 tokens
    b = create_request("b", prompt, block_size=4)
    s.add_request(b)
    so, _ = step(s, default=9)                                   # a gets 3; b hits 1, allocates 4
    assert s.kv_cache_manager.get_block_ids("a") == ([1, 2, 3],)
    assert s.kv_cache_manager.get_block_ids("b") == ([1, 4],)
    assert b.num_cached_tokens == 4
    so, _ = step(s, default=9)                                   # b needs a 3rd block: preempts itself
    assert so.preempted_req_ids == {"b"} and set(so.num_scheduled_tokens) == {"a"}
    # b would fit right now (its hits 1, 2 are held by a, block 4 is free), but
    # a step that preempted admits nobody.
    assert s.last_step_record.admission_stop_reason == "preempted_this_step"
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    so, _ = step(s, default=9)
    assert so.scheduled_cached_reqs.resumed_req_ids == {"b"}
    i = so.scheduled_cached_reqs.req_ids.index("b")
    # b was not scheduled last step: its full token list travels (a's does not).
    assert so.scheduled_cached_reqs.all_token_ids == {"b": prompt + [9]}
    assert so.scheduled_cached_reqs.new_block_ids[i] == ([1, 2, 4],)   # replaces the old row
    assert so.scheduled_cached_reqs.num_computed_tokens[i] == 8       # prefix hits
    assert so.num_scheduled_tokens["b"] == 1
    assert {x.request_id: x.kind for x in s.last_step_record.scheduled}["b"] == "resumed"
    assert s.last_step_record.prefix_hits[0].hit_block_ids == [1, 2]
    assert b.num_cached_tokens == 4                              # set at first admission only


def test_record_steps_off_keeps_no_record_and_changes_no_decision():
    """EngineCore turns the step record off when tracing is off: every output must stay the same."""
    import msgspec

    def run(record_steps: bool) -> tuple[Scheduler, list]:
        s = create_scheduler(block_size=4, num_blocks=9, max_model_len=32, max_num_batched_tokens=32)
        s.record_steps = record_steps
        seen = []
        for i in range(6):
            s.add_request(create_request(f"r{i}", [1, 2, 3, 4, 5, 6] + [i] * (i + 3), block_size=4, max_tokens=8))
        while s.has_requests():
            so, outs = step(s, default=9)
            for eco in outs.values():
                for o in eco.outputs:
                    o.events = None     # timestamps
            seen.append(msgspec.to_builtins((so, {c: (eco.outputs, eco.finished_requests, eco.scheduler_stats)
                                                  for c, eco in outs.items()}), order="sorted"))
        return s, seen

    (on, seen_on), (off, seen_off) = run(True), run(False)
    assert seen_on == seen_off and len(seen_on) > 10
    assert any(so.get("preempted_req_ids") for so, _ in seen_on) and on.last_step_record is not None
    assert off.last_step_record is None


# ---- stop conditions ------------------------------------------------------------------------

def run_one(s: Scheduler, req: Request, tokens: list[int]) -> list:
    """Feed `tokens` one per step; return all EngineCoreOutputs for req."""
    s.add_request(req)
    got = []
    for tok in tokens:
        _, outs = step(s, {req.request_id: [tok]})
        got += [o for o in outputs_by_id(outs).values() if o.request_id == req.request_id]
        if req.is_finished():
            break
    return got


def test_stop_on_eos():
    s = create_scheduler()
    req = create_request("a", 5, eos_token_id=2)
    outs = run_one(s, req, [5, 6, 2, 8])
    assert [o.new_token_ids for o in outs] == [[5], [6], [2]]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason is None
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_ids_set_stop_reason():
    s = create_scheduler()
    req = create_request("a", 5, stop_token_ids=[42, 43])
    outs = run_one(s, req, [5, 43, 8])
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == 43
    hidden = create_request("b", 5, all_stop_token_ids=[44])
    outs = run_one(s, hidden, [44])
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == 44


def test_max_tokens_caps_length():
    s = create_scheduler()
    req = create_request("a", 5, max_tokens=3)
    outs = run_one(s, req, [1] * 10)
    assert [o.new_token_ids for o in outs] == [[1], [1], [1]]
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_max_model_len_caps_length():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=12)
    req = create_request("a", 10, max_tokens=100)
    outs = run_one(s, req, [1] * 10)
    assert req.num_tokens == 12 and outs[-1].finish_reason == FinishReason.LENGTH


def test_min_tokens_defers_eos_and_stop_tokens():
    s = create_scheduler()
    req = create_request("a", 5, eos_token_id=2, stop_token_ids=[3], min_tokens=3)
    outs = run_one(s, req, [2, 3, 4, 2])
    assert [o.new_token_ids for o in outs] == [[2], [3], [4], [2]]
    assert outs[-1].finish_reason == FinishReason.STOP and req.num_output_tokens == 4


def test_ignore_eos_runs_to_max_tokens():
    s = create_scheduler()
    req = create_request("a", 5, eos_token_id=2, ignore_eos=True, max_tokens=4)
    outs = run_one(s, req, [2, 2, 2, 2, 2])
    assert sum(len(o.new_token_ids) for o in outs) == 4 and outs[-1].finish_reason == FinishReason.LENGTH


def test_finished_request_is_freed_and_reported_once():
    s = create_scheduler()
    req = create_request("a", 20, max_tokens=1)
    s.add_request(req)
    so, outs = step(s)
    assert outs[0].finished_requests == {"a"}
    assert outs[0].outputs[0].events[0].type == EngineCoreEventType.QUEUED
    assert "a" not in s.requests and not s.running
    assert s.kv_cache_manager.usage == 0.0
    assert s.has_requests()                                      # workers still need to hear it
    so = s.schedule()
    assert so.finished_req_ids == {"a"} and so.total_num_scheduled_tokens == 0
    assert not s.has_requests()


def test_batched_logprobs_are_sliced_per_request():
    """One LogprobsLists for the step (row i: request row i; columns: sampled + the batch's
    top-k); each request that asked gets its rows (slice_request), the others none."""
    s = create_scheduler()
    s.add_request(create_request("a", 4, logprobs=1))
    s.add_request(create_request("b", 4))                       # no logprobs
    s.add_request(create_request("c", 4, logprobs=2))
    so = s.schedule()
    lp = LogprobsLists(np.array([[7, 3, 4], [8, 8, 1], [9, 9, 2]]),
                       np.array([[-0.1, -2.5, -3.0], [-0.2, -0.2, -4.0], [-0.3, -0.3, -1.5]], dtype=np.float32),
                       np.array([2, 1, 1]))
    mro = ModelRunnerOutput(["a", "b", "c"], {"a": 0, "b": 1, "c": 2}, [[7], [8], [9]], logprobs=lp)
    outs = outputs_by_id(s.update_from_output(so, mro))
    assert outs["b"].new_logprobs is None
    a, c = outs["a"].new_logprobs, outs["c"].new_logprobs
    assert a.logprob_token_ids.tolist() == [[7, 3, 4]] and a.sampled_token_ranks.tolist() == [2]
    assert c.logprobs.tolist() == [[-0.30000001192092896, -0.30000001192092896, -1.5]]
    assert a.cu_num_generated_tokens is None


def test_logprobs_lists_slice_by_cumulative_counts_and_tensors_concatenate():
    """cu_num_generated_tokens: where each request's rows start (spec decode: several per request)."""
    lp = LogprobsLists(np.arange(12).reshape(6, 2), np.zeros((6, 2)), np.arange(6), cu_num_generated_tokens=[0, 1, 4])
    assert lp.slice_request(1, 3).sampled_token_ranks.tolist() == [1, 2, 3]
    assert lp.slice_request(2, 2).logprob_token_ids.tolist() == [[8, 9], [10, 11]]
    import torch

    from vllm_anatomy.core.outputs import LogprobsTensors
    a = LogprobsTensors(torch.tensor([[1, 2]]), torch.tensor([[-0.5, -1.0]]), torch.tensor([1]))
    b = LogprobsTensors(torch.tensor([[3, 4], [5, 6]]), torch.tensor([[-0.1, -2.0], [-0.2, -3.0]]),
                        torch.tensor([1, 2]))
    both = LogprobsTensors.cat([a, b], cu_num_generated_tokens=[0, 1])
    assert both.logprob_token_ids.tolist() == [[1, 2], [3, 4], [5, 6]] and both.cu_num_generated_tokens == [0, 1]
    assert LogprobsTensors.cat([a]) is a
    lists = both.tolists()
    assert lists.slice_request(1, 2).sampled_token_ranks.tolist() == [1, 2]
    empty = LogprobsTensors.empty_cpu(3, 2)
    assert empty.logprobs.shape == (3, 2) and empty.selected_token_ranks.shape == (3,)


def test_model_runner_output_defaults_match_vllm():
    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    assert out.sampled_token_ids == [] and out.logprobs is None and out.prompt_logprobs_dict == {}
    assert out.pooler_output is None and out.kv_connector_output is None and out.num_nans_in_logits is None


def test_prompt_logprobs_go_out_with_the_first_token_only():
    import torch

    from vllm_anatomy.core.outputs import LogprobsTensors
    s = create_scheduler(max_num_batched_tokens=6, max_model_len=64)
    req = create_request("a", 10, prompt_logprobs=1)
    assert req.skip_reading_prefix_cache                          # computes every prompt token
    s.add_request(req)
    so = s.schedule()                                             # a 6-token chunk: no output
    assert so.num_scheduled_tokens == {"a": 6}
    assert outputs_by_id(s.update_from_output(so, make_output(s, so))) == {}
    so = s.schedule()                                             # the rest: first token + prompt logprobs
    plp = LogprobsTensors(torch.zeros(9, 2, dtype=torch.int32), torch.zeros(9, 2), torch.ones(9, dtype=torch.int32))
    mro = make_output(s, so)
    mro.prompt_logprobs_dict = {"a": plp}
    [out] = s.update_from_output(so, mro)[0].outputs
    assert out.new_token_ids == [7] and out.new_prompt_logprobs_tensors is plp


# ---- aborts and FINISHED_IGNORED ------------------------------------------------------------

def test_abort_running_waiting_and_unknown():
    s = create_scheduler(max_num_seqs=1)
    a, b = create_request("a", 20), create_request("b", 20)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and not s.running
    assert s.kv_cache_manager.get_block_ids("a") == ([],) and "a" not in s.requests
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)      # still waiting
    assert not s.waiting and b.status == RequestStatus.FINISHED_ABORTED
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)      # already gone: no-op
    so = s.schedule()
    assert so.finished_req_ids == {"a", "b"}
    outs = s.update_from_output(so, make_output(s, so))
    assert outs[0].outputs == [] and outs[0].finished_requests == {"a", "b"}


def test_abort_while_the_step_runs_drops_its_output():
    s = create_scheduler()
    s.add_request(create_request("a", 10))
    s.add_request(create_request("b", 10))
    so = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outs = s.update_from_output(so, make_output(s, so))
    assert set(outputs_by_id(outs)) == {"b"}


def test_prompt_longer_than_max_model_len_is_ignored():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=32)
    req = create_request("long", 33)
    s.add_request(req)
    s.add_request(create_request("ok", 32, max_tokens=1))
    assert req.status == RequestStatus.FINISHED_IGNORED and req not in s.waiting
    so = s.schedule()
    assert "long" not in so.num_scheduled_tokens
    out = outputs_by_id(s.update_from_output(so, make_output(s, so)))
    assert out["long"].finish_reason == FinishReason.LENGTH and out["long"].new_token_ids == []
    assert out["ok"].finish_reason == FinishReason.LENGTH                # exactly max_model_len: 1 token
    assert "long" not in s.requests


# ---- stats, prefix hits, snapshot -----------------------------------------------------------

def test_prefix_hits_and_stats_counted_in_tokens():
    s = create_scheduler(block_size=4, num_blocks=50, max_model_len=64)
    prompt = list(range(20))
    s.add_request(create_request("a", prompt, block_size=4))
    _, outs = step(s)
    stats = outs[0].scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 0)
    s.add_request(create_request("b", prompt, block_size=4))
    _, outs = step(s)
    stats = outs[0].scheduler_stats
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits) == (1, 20, 16)
    hit = s.last_step_record.prefix_hits[0]
    assert (hit.request_id, hit.num_hit_tokens) == ("b", 16)
    assert s.requests["b"].num_cached_tokens == 16
    assert stats.step_counter == 2
    assert outputs_by_id(outs)["b"].num_cached_tokens == 16


def test_snapshot_is_plain_json():
    s = create_scheduler(max_num_seqs=1)
    s.add_request(create_request("a", 20))
    s.add_request(create_request("b", 5))
    step(s)
    snap = json.loads(json.dumps(s.snapshot()))
    assert [r["request_id"] for r in snap["running"]] == ["a"]
    assert snap["running"][0] == {"request_id": "a", "status": "RUNNING", "num_tokens": 21,
                                  "num_computed_tokens": 20, "num_prompt_tokens": 20,
                                  "num_output_tokens": 1, "num_output_placeholders": 0,
                                  "num_stale_output_tokens": 0, "num_preemptions": 0, "num_cached_tokens": 0, "block_ids": [1, 2],
                                  "spec_token_ids": []}
    assert snap["waiting"][0]["status"] == "WAITING" and snap["waiting"][0]["block_ids"] == []
    assert snap["step_record"]["admission_stop_reason"] == "max_num_seqs"
    assert snap["skipped_waiting"] == [] and snap["step_record"]["deferred_req_ids"] == []
    assert snap["step_record"]["deferred_reasons"] == {}
    assert snap["kv_cache"]["req_to_block_ids"] == {"a": [1, 2]}


def test_admission_stop_and_defer_codes_are_plain_strings_with_descriptions():
    # NOTE: a run stores the value; these strings are what old runs hold too.
    assert [code.value for code in AdmissionStop] == [
        "queue_empty", "budget_exhausted", "max_num_seqs", "no_free_blocks", "preempted_this_step",
        "chunked_prefill_disabled"]
    assert all(code.description for code in (*AdmissionStop, *DeferReason))
    s = create_scheduler()
    s.schedule()
    encoded = json.dumps(s.snapshot()["step_record"])
    assert '"admission_stop_reason": "queue_empty"' in encoded
    assert f"{AdmissionStop.QUEUE_EMPTY}" == "queue_empty"


def test_kv_cache_must_hold_one_max_len_sequence():
    """v0.27.1 refuses such a cache at start-up (check_enough_kv_cache_memory, called by
    EngineCore._initialize_kv_caches), not in the Scheduler, which builds what it is given."""
    import torch

    from vllm_anatomy.core.kv_cache_utils import check_enough_kv_cache_memory
    from vllm_anatomy.kv_cache_interface import FullAttentionSpec
    s = create_scheduler(block_size=4, num_blocks=4, max_model_len=16)       # 3 usable blocks: 12 tokens
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    specs = {"layer.0": spec, "layer.1": spec}
    page = 2 * spec.page_size_bytes                                          # one block of both layers
    check_enough_kv_cache_memory(s.vllm_config, specs, 4 * page)             # 16 tokens fit
    with pytest.raises(ValueError, match="estimated maximum model length is 12"):
        check_enough_kv_cache_memory(s.vllm_config, specs, 3 * page)
    with pytest.raises(ValueError, match="No available memory"):
        check_enough_kv_cache_memory(s.vllm_config, specs, 0)


def test_pure_core_does_not_import_torch():
    code = ("import sys, vllm_anatomy.core.sched.scheduler; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
