"""AsyncScheduler, GPU-free: step N+1 is scheduled before step N's output is seen.

The helpers fabricate ModelRunnerOutputs as a worker would, one step late: each
test drives `launch()` (schedule) and `finish()` (update_from_output of the
oldest step in flight) in the order EngineCore.step_with_batch_queue does.
"""
from __future__ import annotations

import time
from collections import deque

from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm_anatomy.core.kv_cache_utils import get_request_block_hasher, sha256
from vllm_anatomy.core.outputs import ModelRunnerOutput
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.async_scheduler import AsyncScheduler
from vllm_anatomy.core.sched.record import DeferReason
from vllm_anatomy.sampling_params import SamplingParams
from tests.unit.core_utils import new_scheduler


def create_scheduler(block_size=16, num_blocks=1000, max_model_len=256, max_num_batched_tokens=256):
    sc = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16,
                         max_model_len=max_model_len, async_scheduling=True)
    config = VllmConfig(ModelConfig(model="fake", max_model_len=max_model_len),
                        CacheConfig(block_size=block_size), sc)
    assert sc.get_scheduler_cls() is AsyncScheduler and sc.max_concurrent_batches == 2
    return new_scheduler(config, num_blocks, AsyncScheduler)


def create_request(req_id, prompt, block_size=16, **kw) -> Request:
    kw.setdefault("max_tokens", 8)
    return Request(req_id, list(prompt), SamplingParams(**kw), block_hasher=get_request_block_hasher(block_size, sha256))


class Pipeline:
    """Two steps in flight at most, outputs fabricated per scheduled request."""

    def __init__(self, s: AsyncScheduler, token_for=lambda req_id, step_id: 100 + step_id):
        self.s, self.token_for = s, token_for
        self.in_flight: deque = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}

    def launch(self):
        so = self.s.schedule()
        # The worker samples for every scheduled request; a partial prefill chunk's token is discarded.
        sampled = {r: ([] if self.s.requests[r].is_prefill_chunk else [self.token_for(r, so.step_id)])
                   for r in so.num_scheduled_tokens}
        self.in_flight.appendleft((so, sampled))
        return so

    def finish(self):
        so, sampled = self.in_flight.pop()
        req_ids = list(sampled)
        out = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [sampled[r] for r in req_ids])
        for eco in self.s.update_from_output(so, out).values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish_reasons[o.request_id] = str(o.finish_reason)
        return so

    def run(self, max_steps=200):
        """step_with_batch_queue's order: launch N+1, then finish N."""
        for _ in range(max_steps):
            if self.s.has_requests():
                so = self.launch()
                if so.total_num_scheduled_tokens and len(self.in_flight) < 2:
                    continue
            elif not self.in_flight:
                return
            self.finish()
        raise AssertionError("did not finish")


def test_decode_is_scheduled_before_its_input_token_is_known():
    s = create_scheduler()
    r = create_request("r", range(1, 21), max_tokens=5)
    s.add_request(r)
    p = Pipeline(s)
    so1 = p.launch()
    assert so1.num_scheduled_tokens == {"r": 20} and r.num_output_placeholders == 1
    so2 = p.launch()                                   # step 1's token is still "on the device"
    assert so2.num_scheduled_tokens == {"r": 1}
    assert so2.scheduled_cached_reqs.num_output_tokens == [1]   # in flight counts, as in v0.27.1
    assert r.num_tokens == 20 and r.num_computed_tokens == 21 and r.num_output_placeholders == 2
    rec = {x.request_id: x.kind for x in s.last_step_record.scheduled}
    assert rec == {"r": "decode"}                      # a placeholder counts as a token
    p.finish()
    assert r.num_tokens == 21 and r.num_output_placeholders == 1 and p.outputs["r"] == [101]


def test_no_step_is_wasted_past_max_tokens():
    s = create_scheduler()
    r = create_request("r", range(1, 21), max_tokens=5)
    s.add_request(r)
    p = Pipeline(s)
    scheduled = []
    orig = p.launch

    def launch():
        so = orig()
        scheduled.append(so.num_scheduled_tokens.get("r", 0))
        return so
    p.launch = launch
    p.run()
    # 5 tokens: the prefill samples the first, 4 decodes the rest. The step after
    # the 4th decode is not scheduled: the in-flight one already ends the request.
    assert [n for n in scheduled if n] == [20, 1, 1, 1, 1]
    assert p.outputs["r"] == [101, 102, 103, 104, 105] and p.finish_reasons["r"] == "length"
    assert r.num_output_placeholders == 0 and not s.has_requests()


def test_partial_prefill_chunks_add_no_placeholder():
    s = create_scheduler(max_num_batched_tokens=16)
    r = create_request("r", range(1, 41), max_tokens=3)
    s.add_request(r)
    p = Pipeline(s)
    counts = []
    for _ in range(3):
        p.launch()
        counts.append(r.num_output_placeholders)
        if len(p.in_flight) == 2:
            p.finish()
    assert counts == [0, 0, 1]                          # chunks of 16, 16, 8: only the last samples
    p.run()
    assert len(p.outputs["r"]) == 3


def test_eos_while_the_next_step_is_in_flight_drops_that_step():
    s = create_scheduler()
    r = create_request("r", range(1, 9), max_tokens=10, eos_token_id=2)
    s.add_request(r)
    p = Pipeline(s, token_for=lambda req_id, step_id: 2 if step_id == 2 else 50)
    p.launch()
    p.launch()
    p.finish()                                          # step 1: token 50
    so3 = p.launch()                                    # step 3 launched while step 2 runs
    assert so3.num_scheduled_tokens == {"r": 1}
    p.finish()                                          # step 2: EOS, the request stops
    assert r.status == RequestStatus.FINISHED_STOPPED and p.finish_reasons["r"] == "stop"
    assert "r" not in s.requests
    p.finish()                                          # step 3's token: the request is gone, skipped
    assert p.outputs["r"] == [50, 2]
    so4 = s.schedule()
    assert so4.finished_req_ids == {"r"}                # the worker drops its state


def test_preempted_request_keeps_and_delivers_its_in_flight_token():
    # v0.27.1: the token a step in flight samples for a request preempted
    # meanwhile is a real sample; it is delivered (appended to the PREEMPTED
    # request), and the request recomputes its KV, that token included.
    # 4 usable blocks of 4 tokens; two requests of 7 prompt tokens take 2 blocks each.
    s = create_scheduler(block_size=4, num_blocks=5, max_model_len=16)
    a = create_request("a", [1, 2, 3, 4, 5, 6, 7], block_size=4, max_tokens=4)
    b = create_request("b", [11, 12, 13, 14, 15, 16, 17], block_size=4, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    p = Pipeline(s)
    p.launch()                                          # both prefill (positions 0..6)
    so2 = p.launch()                                    # both decode position 7: still 2 blocks each
    assert set(so2.num_scheduled_tokens) == {"a", "b"} and b.num_output_placeholders == 2
    assert b.num_in_flight_tokens == 8
    p.finish()
    assert b.num_in_flight_tokens == 1
    so3 = p.launch()                                    # a needs a 3rd block: b is preempted
    assert so3.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    assert b.num_output_placeholders == 0 and b.num_stale_output_tokens == 1
    assert b.num_output_tokens == 1                     # step 1's token was already in
    p.finish()                                          # step 2 had b's second token: stale, delivered
    assert b.num_output_tokens == 2 and b.num_stale_output_tokens == 0 and b.num_in_flight_tokens == 0
    assert p.outputs["b"] == [101, 102] and b.status == RequestStatus.PREEMPTED
    p.run()
    assert len(p.outputs["a"]) == 4 and len(p.outputs["b"]) == 4
    assert p.outputs["b"][:2] == [101, 102]             # nothing resampled
    assert p.finish_reasons == {"a": "length", "b": "length"}
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 4


def test_readmission_waits_for_stale_output_and_later_requests_go_first():
    # A deeper pipeline than the engine's two steps: b is preempted while two
    # steps of its are in flight, so a later schedule() finds its stale output
    # still pending. v0.27.1 passes it over (skipped_waiting) and admits c.
    s = create_scheduler(block_size=4, num_blocks=5, max_model_len=16)
    a = create_request("a", [1, 2, 3, 4, 5, 6, 7], block_size=4, max_tokens=6)
    b = create_request("b", [11, 12, 13, 14, 15, 16, 17], block_size=4, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    p = Pipeline(s)
    p.launch()                                          # step 1: both prefill
    p.launch()                                          # step 2: both decode position 7
    so3 = p.launch()                                    # step 3: a needs a 3rd block: b preempted
    assert so3.preempted_req_ids == {"b"} and b.num_stale_output_tokens == 8
    c = create_request("c", [21, 22, 23], block_size=4, max_tokens=2)
    s.add_request(c)
    p.finish()                                          # step 1: b's first token, stale, delivered
    assert b.num_output_tokens == 1 and b.num_stale_output_tokens == 1
    so4 = p.launch()                                    # b's step-2 token is still in flight
    assert s.last_step_record.deferred_req_ids == ["b"]
    assert s.last_step_record.deferred_reasons == {"b": DeferReason.STALE_OUTPUT_IN_FLIGHT}
    assert "b" not in so4.num_scheduled_tokens and "c" in so4.num_scheduled_tokens
    assert [r.request_id for r in s.skipped_waiting] == ["b"] and b.status == RequestStatus.PREEMPTED
    assert s.get_request_counts() == (2, 1)
    snap = s.snapshot()
    assert [r["request_id"] for r in snap["skipped_waiting"]] == ["b"]
    assert snap["skipped_waiting"][0]["num_stale_output_tokens"] == 1
    p.finish()                                          # step 2: b's second token arrives
    assert b.num_stale_output_tokens == 0 and p.outputs["b"] == [101, 102]
    p.run()
    assert p.finish_reasons == {"a": "length", "b": "length", "c": "length"}
    assert p.outputs["b"][:2] == [101, 102] and len(p.outputs["b"]) == 6
    assert not s.skipped_waiting and s.kv_cache_manager.block_pool.get_num_free_blocks() == 4


def test_a_stale_token_can_finish_a_preempted_request():
    s = create_scheduler(block_size=4, num_blocks=5, max_model_len=16)
    a = create_request("a", [1, 2, 3, 4, 5, 6, 7], block_size=4, max_tokens=4)
    b = create_request("b", [11, 12, 13, 14, 15, 16, 17], block_size=4, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    p = Pipeline(s)
    p.launch()
    p.launch()                                          # b's second (last) token in flight
    p.finish()
    # b's last token is in flight: the scheduler skips b, and a's third block
    # comes from the free pool. Force the preemption by hand, as a smaller pool would.
    s.running.remove(b)
    s._preempt_request(b, time.monotonic())
    assert b.num_stale_output_tokens == 1
    p.finish()                                          # the stale token is b's last
    assert p.finish_reasons["b"] == "length" and "b" not in s.requests
    assert b not in s.waiting and b not in s.skipped_waiting
    p.run()
    assert p.finish_reasons == {"a": "length", "b": "length"} and p.outputs["b"] == [101, 102]


def test_matches_the_synchronous_scheduler_token_for_token():
    """Same fabricated model (token = f(request, how many tokens it has)), sync and async."""
    def run(async_scheduling):
        s = create_scheduler(block_size=4, num_blocks=12, max_model_len=40, max_num_batched_tokens=24)
        if not async_scheduling:
            from vllm_anatomy.core.sched.scheduler import Scheduler
            s = new_scheduler(s.vllm_config, 12, Scheduler)
        reqs = [create_request(f"r{i}", range(10 * i + 1, 10 * i + 4 + 3 * i), block_size=4,
                               max_tokens=3 + 2 * i, eos_token_id=2) for i in range(6)]
        for r in reqs:
            s.add_request(r)
        # Deterministic "model": the sampled token depends only on its index in
        # the sequence (num_computed_tokens once scheduled, sync or async), so
        # preemption and recompute produce the same values.
        def token_for(req_id, step_id):
            n = s.requests[req_id].num_computed_tokens
            return 2 if (req_id == "r3" and n >= 14) else 40 + n
        p = Pipeline(s, token_for)
        if async_scheduling:
            p.run()
        else:
            while s.has_requests():
                p.launch()
                p.finish()
        return p.outputs, p.finish_reasons, sum(r.num_preemptions for r in reqs)
    sync_out, sync_reasons, _ = run(False)
    async_out, async_reasons, preemptions = run(True)
    assert async_out == sync_out and async_reasons == sync_reasons
    assert sync_reasons["r3"] == "stop" and preemptions > 0


def test_engine_args_resolve_async_scheduling(tiny_llama_dir):
    import argparse

    from vllm_anatomy.engine.arg_utils import EngineArgs
    cfg = EngineArgs(model=tiny_llama_dir).create_engine_config()
    assert cfg.scheduler_config.async_scheduling is False          # auto: off on a CPU
    cfg = EngineArgs(model=tiny_llama_dir, async_scheduling=True).create_engine_config()
    assert cfg.scheduler_config.get_scheduler_cls() is AsyncScheduler
    # Worker processes: only when asked for (their busy loop waits for each step's tokens).
    cfg = EngineArgs(model=tiny_llama_dir, async_scheduling=True, distributed_executor_backend="mp")
    assert cfg.create_engine_config().scheduler_config.get_scheduler_cls() is AsyncScheduler
    cfg = EngineArgs(model=tiny_llama_dir, distributed_executor_backend="mp", device="cuda")
    assert cfg._resolve_async_scheduling(on_gpu=True) is False
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert EngineArgs.from_cli_args(parser.parse_args([])).async_scheduling is None


def test_engine_async_equals_sync_with_logprobs_and_seeds(tiny_llama_dir):
    """The whole engine on a tiny random model: async scheduling returns the same
    tokens and logprobs as sync, greedy and seeded-random, through chunked prefill."""
    from vllm_anatomy import LLM, SamplingParams
    prompts = [{"prompt_token_ids": [(5 * i + j) % 500 + 3 for j in range(n)]} for i, n in enumerate([3, 40, 17, 70])]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)]

    def run(async_scheduling):
        llm = LLM(tiny_llama_dir, max_model_len=256, max_num_batched_tokens=32, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    sync, asynchronous = run(False), run(True)
    assert [len(t) for t, _ in sync] == [9, 6, 1, 12]
    assert asynchronous == sync
    assert sync[0][1] is not None and len(sync[0][1]) == 9
