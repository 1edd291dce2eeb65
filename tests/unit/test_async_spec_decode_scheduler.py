"""AsyncScheduler with speculative decoding (draft_model), with fabricated worker outputs (no model, CPU only).

As v0.27.1: the scheduler plans step N+1 before step N's output arrives, so
each request that samples gets K -1 placeholder drafts (spec_token_ids) and
counts the step's own drafts as output placeholders, as if all were accepted;
update_from_output rolls num_computed_tokens and the placeholders back over the
rejected ones. The engine's batch queue is replayed by hand: schedule N+1,
then update N.
"""
from __future__ import annotations

from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm_anatomy.core.outputs import DraftTokenIds, ModelRunnerOutput
from vllm_anatomy.core.sched.async_scheduler import AsyncScheduler
from tests.unit.core_utils import new_scheduler
from tests.unit.test_scheduler import create_request

K = 3


def create_scheduler(max_num_batched_tokens: int = 8192, max_model_len: int = 512) -> AsyncScheduler:
    spec = SpeculativeConfig(num_speculative_tokens=K, method="draft_model", model="fake-draft")
    config = VllmConfig(ModelConfig(model="fake", max_model_len=max_model_len), CacheConfig(block_size=16),
                        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16,
                                        max_model_len=max_model_len, async_scheduling=True),
                        speculative_config=spec)
    scheduler = new_scheduler(config, 1000)
    assert isinstance(scheduler, AsyncScheduler)
    return scheduler


def output(so, tokens: dict[str, list[int]], verified: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [tokens.get(r, []) for r in req_ids],
                             verified_draft_token_ids=[verified.get(r, []) for r in req_ids] if verified else None)


def spec_stats(outs):
    stats = [eco.scheduler_stats for eco in outs.values() if eco.scheduler_stats is not None]
    return stats[0].spec_decoding_stats if stats else None


def test_placeholders_then_rollback():
    s = create_scheduler()
    req = create_request("a", 20, max_tokens=50)
    s.add_request(req)
    so1 = s.schedule()                                   # the prompt
    assert so1.num_scheduled_tokens == {"a": 20} and not so1.scheduled_spec_decode_tokens
    assert req.num_output_placeholders == 1 and req.spec_token_ids == [-1] * K
    so2 = s.schedule()                                   # before step 1's token: 1 + K placeholders
    assert so2.num_scheduled_tokens == {"a": 1 + K}
    assert so2.scheduled_spec_decode_tokens == {"a": [-1] * K}
    assert req.num_computed_tokens == 20 + 1 + K
    assert req.num_output_placeholders == 1 + 1 + K     # step 1's token; step 2's token and its drafts
    s.update_from_output(so1, output(so1, {"a": [11]}))
    assert list(req.output_token_ids) == [11] and req.num_output_placeholders == 1 + K
    so3 = s.schedule()                                   # step 2's drafts counted as accepted
    assert so3.num_scheduled_tokens == {"a": 1 + K} and req.num_computed_tokens == 20 + 2 * (1 + K)
    # Step 2: one draft accepted, then a recovered token: 2 rejected.
    so2_verified = {"a": [31, 32, 33]}
    s.update_draft_token_ids_in_output(DraftTokenIds(["a"], [so2_verified["a"]]), so2)
    assert so2.scheduled_spec_decode_tokens == {"a": [31, 32, 33]}
    outs = s.update_from_output(so2, output(so2, {"a": [31, 40]}))
    assert list(req.output_token_ids) == [11, 31, 40]
    assert req.num_computed_tokens == 20 + 2 * (1 + K) - 2
    assert req.num_output_placeholders == 1 + K          # step 3's token and drafts
    stats = spec_stats(outs)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, K, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]
    # Step 3: all accepted, plus the bonus token.
    s.schedule()
    s.update_from_output(so3, output(so3, {"a": [41, 42, 43, 44]}))
    assert list(req.output_token_ids) == [11, 31, 40, 41, 42, 43, 44]
    assert req.num_computed_tokens == 20 + 6 + (1 + K)   # known tokens - 1, then step 4's in flight
    assert req.num_output_placeholders == 1 + K


def test_record_names_the_verified_drafts_and_rejected_slots():
    s = create_scheduler()
    s.record_steps = True
    req = create_request("a", 20, max_tokens=50)
    s.add_request(req)
    so1 = s.schedule()
    so2 = s.schedule()
    step2 = s.last_step_record
    s.update_from_output(so1, output(so1, {"a": [11]}))
    s.schedule()                                          # step 3 in flight while step 2 is updated
    step3 = s.last_step_record
    s.update_draft_token_ids_in_output(DraftTokenIds(["a"], [[31, 32, 33]]), so2)
    s.update_from_output(so2, output(so2, {"a": [31, 40]}))
    (record,) = s.last_spec_decode_records
    # Step 2's verification lands in step 2's record, not in the latest one (step 3's).
    assert step2 is not None and step3 is not None and (step2.step_id, step3.step_id) == (2, 3)
    assert step2.spec_decode == [record] and step3.spec_decode == []
    assert record.draft_token_ids == [31, 32, 33] and record.num_accepted == 1
    # Step 2 computed positions 20 (token 11) and 21..23 (drafts): 22 and 23 were rejected.
    assert record.first_draft_position == 21
    block = s.kv_cache_manager.get_blocks("a").blocks[0][1].block_id
    assert record.rejected_slots == [block * 16 + 6, block * 16 + 7]


def test_no_extra_step_past_max_tokens():
    """The last step is not followed by a wasted one, even counting every draft as rejected."""
    s = create_scheduler()
    req = create_request("a", 20, max_tokens=2)
    s.add_request(req)
    so1 = s.schedule()
    so2 = s.schedule()                                    # may end the request (1 token + drafts)
    assert so2.num_scheduled_tokens == {"a": 1 + K}
    s.update_from_output(so1, output(so1, {"a": [11]}))
    assert s.schedule().num_scheduled_tokens == {}         # step 2 surely ends it: nothing scheduled
    outs = s.update_from_output(so2, output(so2, {"a": [21, 22, 23, 24]}))
    (out,) = outs[0].outputs
    assert out.new_token_ids == [21] and out.finish_reason is not None   # nothing past max_tokens


def test_request_left_out_loses_its_placeholders():
    """The worker proposes only for the step it ran: a running request left out of a step
    (token budget) keeps no -1 drafts it could not fill."""
    s = create_scheduler(max_num_batched_tokens=24)
    a, b = create_request("a", 20, max_tokens=50), create_request("b", 20, max_tokens=50)
    s.add_request(a)
    s.add_request(b)
    so1 = s.schedule()                                    # a's prompt, 4 tokens of b's
    assert so1.num_scheduled_tokens == {"a": 20, "b": 4}
    assert a.spec_token_ids == [-1] * K and not b.spec_token_ids
    so2 = s.schedule()                                    # a: 1 + K; b: the rest of its prompt
    assert so2.scheduled_spec_decode_tokens == {"a": [-1] * K}
    s.update_from_output(so1, output(so1, {"a": [11]}))
    so3 = s.schedule()
    s.update_from_output(so2, output(so2, {"a": [11, 12, 13, 14], "b": [51]}))
    for req in (a, b):
        if req.request_id not in so3.num_scheduled_tokens:
            assert not req.spec_token_ids
