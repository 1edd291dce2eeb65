"""The scheduler's speculative-decoding paths, with fabricated worker outputs (no model, CPU only).

A request's drafts (spec_token_ids, set by update_draft_token_ids) are scheduled
after its last token, inside the step's one token budget; a draft model's
lookahead slots are reserved by allocate_slots; update_from_output rolls
num_computed_tokens back over the rejected drafts and counts drafts and
acceptances (SpecDecodingStats); preemption drops the drafts; prefix caching
hashes only real tokens.
"""
from __future__ import annotations

from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm_anatomy.core.outputs import DraftTokenIds, ModelRunnerOutput
from vllm_anatomy.core.request import RequestStatus
from vllm_anatomy.core.sched.scheduler import Scheduler
from tests.unit.core_utils import new_scheduler
from tests.unit.test_scheduler import create_request

K = 3


def create_scheduler(method: str = "ngram", num_spec_tokens: int = K, max_num_batched_tokens: int = 8192,
                     num_blocks: int = 1000, max_model_len: int = 512, block_size: int = 16,
                     record_steps: bool = False) -> Scheduler:
    spec = SpeculativeConfig(num_speculative_tokens=num_spec_tokens, method=method,
                             model=None if method == "ngram" else "fake-draft")
    config = VllmConfig(ModelConfig(model="fake", max_model_len=max_model_len), CacheConfig(block_size=block_size),
                        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16,
                                        max_model_len=max_model_len),
                        speculative_config=spec)
    scheduler = new_scheduler(config, num_blocks)
    scheduler.record_steps = record_steps
    return scheduler


def run(s: Scheduler, tokens: dict[str, list[int]], drafts: dict[str, list[int]] | None = None):
    """One step: schedule, the worker's output (`tokens` per request, [] for a partial chunk),
    then the drafts it proposed (what EngineCore.post_step hands over)."""
    so = s.schedule()
    req_ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [tokens.get(r, []) for r in req_ids])
    engine_outputs = s.update_from_output(so, out)
    if drafts is not None:
        s.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))
    return so, engine_outputs


def spec_stats(outs):
    stats = [eco.scheduler_stats for eco in outs.values() if eco.scheduler_stats is not None]
    return stats[0].spec_decoding_stats if stats else None


def prefilled(s: Scheduler, prompt_len: int = 20, drafts: list[int] | None = None, max_tokens: int = 50):
    req = create_request("a", prompt_len, max_tokens=max_tokens)
    s.add_request(req)
    run(s, {"a": [11]}, {"a": drafts or [21, 22, 23]})
    return req


def test_drafts_are_scheduled_after_the_last_token_in_one_budget():
    s = create_scheduler()
    req = prefilled(s)
    assert req.spec_token_ids == [21, 22, 23]
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1 + K}
    assert so.scheduled_spec_decode_tokens == {"a": [21, 22, 23]}
    assert so.total_num_scheduled_tokens == 4
    assert req.spec_token_ids == []                # emptied: new drafts come after the step
    assert req.num_computed_tokens == 21 + K       # advanced optimistically over the drafts


def test_rejected_drafts_roll_num_computed_tokens_back():
    s = create_scheduler()
    req = prefilled(s)
    # Draft 21 accepted, 22 rejected: the worker returns [21, recovered 30].
    so, outs = run(s, {"a": [21, 30]})
    assert list(req.output_token_ids[-2:]) == [21, 30]
    assert req.num_tokens == 23
    assert req.num_computed_tokens == req.num_tokens - 1      # 24 computed, 2 of them rolled back
    stats = spec_stats(outs)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0] and stats.num_draft_tokens_per_pos == [1, 1, 1]


def test_all_drafts_accepted_gives_k_plus_one_tokens():
    s = create_scheduler()
    req = prefilled(s)
    _, outs = run(s, {"a": [21, 22, 23, 40]})
    assert list(req.output_token_ids) == [11, 21, 22, 23, 40]
    assert req.num_computed_tokens == req.num_tokens - 1
    assert spec_stats(outs).num_accepted_tokens_per_pos == [1, 1, 1]


def test_budget_schedules_only_the_drafts_that_fit():
    s = create_scheduler(max_num_batched_tokens=64)
    req = prefilled(s, prompt_len=20)
    other = create_request("b", 62)
    s.add_request(other)
    so = s.schedule()
    # Running first: "a" takes 1 + 3, the rest of the budget goes to b's prompt chunk.
    assert so.num_scheduled_tokens == {"a": 4, "b": 60}
    assert so.scheduled_spec_decode_tokens == {"a": [21, 22, 23]}
    s2 = create_scheduler(max_num_batched_tokens=3)
    req2 = create_request("a", 3)
    s2.add_request(req2)
    run(s2, {"a": [11]}, {"a": [21, 22, 23]})
    so = s2.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.scheduled_spec_decode_tokens == {"a": [21, 22]}
    assert req.status == RequestStatus.RUNNING


def test_drafts_stop_before_max_model_len():
    s = create_scheduler(max_model_len=24)
    req = prefilled(s, prompt_len=21)               # 22 tokens known; the bonus token may land at 23
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 2}     # the last token and one draft (positions 21, 22)
    assert so.scheduled_spec_decode_tokens == {"a": [21]}
    _, _ = run_output(s, so, {"a": [21, 50]})
    assert req.num_tokens == 24 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def run_output(s, so, tokens):
    req_ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [tokens.get(r, []) for r in req_ids])
    return so, s.update_from_output(so, out)


def test_draft_model_reserves_lookahead_slots():
    # 32-token prompt: 2 blocks; the first sampled token needs a 3rd; with a draft model the
    # K lookahead slots are reserved too (ngram: none).
    for method, blocks_after_prefill in (("ngram", 2), ("draft_model", 3)):
        s = create_scheduler(method=method)
        assert s.num_lookahead_tokens == (K if method == "draft_model" else 0)
        s.add_request(create_request("a", 32))
        s.schedule()
        assert len(s.kv_cache_manager.get_block_ids("a")[0]) == blocks_after_prefill, method


def test_draft_model_verifying_step_reserves_k_more():
    s = create_scheduler(method="draft_model")
    req = prefilled(s, prompt_len=28)               # 29 tokens; drafts at 29..31
    s.schedule()
    # computed 28 + 4 scheduled + 3 lookahead = 35 slots -> 3 blocks
    assert len(s.kv_cache_manager.get_block_ids("a")[0]) == 3
    assert req.num_computed_tokens == 32


def test_preemption_drops_drafts():
    s = create_scheduler(num_blocks=4, block_size=16, max_num_batched_tokens=64, max_model_len=48)
    a = create_request("a", 30, max_tokens=60)
    b = create_request("b", 10, max_tokens=60)
    s.add_request(a)
    s.add_request(b)
    run(s, {"a": [1], "b": [2]}, {"a": [3, 3, 3], "b": [4, 4, 4]})
    assert b.spec_token_ids == [4, 4, 4]
    so = s.schedule()                               # a needs a 3rd block: b (the newest) is preempted
    assert so.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    assert b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert "b" not in so.scheduled_spec_decode_tokens and so.scheduled_spec_decode_tokens == {"a": [3, 3, 3]}


def test_update_draft_token_ids_ignores_finished_and_prefilling():
    """(A structured-output request's drafts are cut by its grammar:
    tests/unit/test_structured_output_spec_decode.py.)"""
    s = create_scheduler(max_num_batched_tokens=16)
    long = create_request("long", 40)
    s.add_request(long)
    run(s, {}, {"long": [5, 5]})                    # a partial chunk: its drafts are meaningless
    assert long.is_prefill_chunk and long.spec_token_ids == []
    s.update_draft_token_ids(DraftTokenIds(["gone"], [[1, 2]]))     # an unknown (finished) id: ignored
    assert "gone" not in s.requests


def test_stop_token_among_accepted_drafts_finishes_and_frees():
    s = create_scheduler()
    req = create_request("a", 20, max_tokens=50, stop_token_ids=[99])
    s.add_request(req)
    run(s, {"a": [11]}, {"a": [21, 99, 23]})
    _, outs = run(s, {"a": [21, 99, 23, 40]})
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert list(req.output_token_ids) == [11, 21, 99]          # tokens after the stop are dropped
    assert "a" not in s.requests and s.kv_cache_manager.get_block_ids("a") == ([],)


def test_prefix_cache_hashes_only_real_tokens():
    s = create_scheduler(block_size=16)
    req = prefilled(s, prompt_len=14)               # 15 tokens known, drafts at 15..17
    run(s, {"a": [21, 30]}, {"a": [1, 2, 3]})       # 17 known: one full block of real tokens
    assert len(req.block_hashes) == 1
    # The next schedule caches block 0 (its tokens are all computed by then); its drafts
    # reach positions 17..19 of block 1, which holds 1 real token: not hashed, not cached.
    s.schedule()
    assert len(req.block_hashes) == 1 and s.kv_cache_manager.coordinator.single_type_managers[0].num_cached_block["a"] == 1


def test_step_record_says_what_was_accepted_and_where_rejected_slots_are():
    s = create_scheduler(record_steps=True, block_size=16)
    req = prefilled(s, prompt_len=20)               # 21 tokens: drafts at positions 21, 22, 23
    so, _ = run(s, {"a": [21, 30]})
    record = s.last_step_record
    assert record is not None
    [scheduled] = record.scheduled
    assert scheduled.kind == "decode" and scheduled.draft_token_ids == [21, 22, 23] and scheduled.num_tokens == 4
    [spec] = record.spec_decode
    assert (spec.draft_token_ids, spec.num_accepted, spec.output_token_ids) == ([21, 22, 23], 1, [21, 30])
    assert spec.first_draft_position == 21
    block = s.kv_cache_manager.get_block_ids("a")[0][1]
    assert spec.rejected_slots == [block * 16 + 6, block * 16 + 7]   # positions 22, 23
    snap = s.snapshot()
    assert snap["step_record"]["spec_decode"][0]["rejected_slots"] == spec.rejected_slots
    assert snap["running"][0]["spec_token_ids"] == [] and req.num_computed_tokens == 22
