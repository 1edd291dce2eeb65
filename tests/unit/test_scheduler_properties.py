"""Property-based tests: random workloads against a fake worker, invariants after every step.

The fake worker keeps a fake KV cache (one token id per slot): it writes each
scheduled token's id into its slot, then checks that every token a request
attends to is found where its block table says. A prefix hit on a block whose
content was overwritten, or a block shared by mistake, shows up as a mismatch.
The fake model's next token is a function of the whole sequence, like a real
(greedy) model, so equal prompts give equal outputs and share more blocks.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm_anatomy.core.kv_cache_utils import get_request_block_hasher, make_block_hash_with_group_id, sha256
from vllm_anatomy.core.outputs import ModelRunnerOutput
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.engine.protocol import FinishReason
from vllm_anatomy.sampling_params import SamplingParams
from tests.unit.core_utils import new_scheduler


def fake_model(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 50


def expected_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(fake_model(seq))
    return seq[len(prompt):]


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(4, 14))
    max_model_len = (num_blocks - 1) * block_size
    enable_chunked_prefill = draw(st.booleans())
    budget = draw(st.integers(max_model_len if not enable_chunked_prefill else 1, 2 * max_model_len))
    cfg = dict(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len, budget=budget,
               enable_chunked_prefill=enable_chunked_prefill, max_num_seqs=draw(st.integers(1, 4)),
               caching=draw(st.booleans()),
               # (SchedulerConfig refuses a threshold past max_model_len, as vLLM's does)
               threshold=draw(st.sampled_from([t for t in (0, 0, 3, 8) if t <= max_model_len])))
    prefixes = [draw(st.lists(st.integers(0, 49), min_size=0, max_size=max_model_len // 2)) for _ in range(2)]
    reqs = []
    for i in range(draw(st.integers(1, 7))):
        prefix = prefixes[draw(st.integers(0, 1))]
        suffix = draw(st.lists(st.integers(0, 49), min_size=0 if prefix else 1, max_size=6))
        prompt = (prefix + suffix)[: max_model_len - 1]
        max_tokens = draw(st.integers(1, max_model_len - len(prompt)))
        if draw(st.integers(0, 9)) == 0:
            prompt, max_tokens = [1] * (max_model_len + 1), 1     # too long: FINISHED_IGNORED
        arrival = draw(st.integers(0, 12))
        abort_at = draw(st.one_of(st.none(), st.integers(0, 30)))
        abort_mid_step = draw(st.booleans())
        reqs.append((f"r{i}", prompt, max_tokens, arrival, abort_at, abort_mid_step))
    return cfg, reqs


def make_scheduler(cfg) -> Scheduler:
    config = VllmConfig(
        ModelConfig(model="fake", max_model_len=cfg["max_model_len"]),
        CacheConfig(block_size=cfg["block_size"], enable_prefix_caching=cfg["caching"]),
        SchedulerConfig(max_num_batched_tokens=cfg["budget"], max_num_seqs=cfg["max_num_seqs"],
                        max_model_len=cfg["max_model_len"], enable_chunked_prefill=cfg["enable_chunked_prefill"],
                        long_prefill_token_threshold=cfg["threshold"]))
    return new_scheduler(config, cfg["num_blocks"], Scheduler, record_block_pool_events=True)


def check_invariants(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    pool = kv.block_pool
    req_to_blocks = kv.coordinator.single_type_managers[0].req_to_blocks
    # ref_cnt == number of block-table references held by requests.
    refs = Counter(blk.block_id for blocks in req_to_blocks.values() for blk in blocks)
    for blk in pool.blocks[1:]:
        assert blk.ref_cnt == refs[blk.block_id], blk
    assert 0 not in refs                                            # null block never handed out
    # The free queue holds exactly the ref_cnt-0 blocks, each once.
    free = [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()]
    assert len(free) == len(set(free)) == pool.get_num_free_blocks()
    assert set(free) == {blk.block_id for blk in pool.blocks[1:] if blk.ref_cnt == 0}
    # A block is in two requests only through a hash hit; never twice in one request.
    owners: Counter[int] = Counter()
    for blocks in req_to_blocks.values():
        assert len({blk.block_id for blk in blocks}) == len(blocks)
        owners.update(blk.block_id for blk in blocks)
    for block_id, n in owners.items():
        assert n == 1 or pool.blocks[block_id].block_hash is not None
    # Hash map and block hashes agree; a hashed block i of a request holds its hash i (group 0).
    hashed = {blk.block_id: blk.block_hash for blk in pool.blocks if blk.block_hash is not None}
    assert all(pool.cached_block_hash_to_block.contain(key, block_id) for block_id, key in hashed.items())
    assert len(pool.cached_block_hash_to_block) == len(set(hashed.values()))
    for req_id, blocks in req_to_blocks.items():
        req = s.requests[req_id]
        for i, blk in enumerate(blocks):
            assert blk.block_hash is None or blk.block_hash == make_block_hash_with_group_id(req.block_hashes[i], 0)
    # Statuses agree with queue membership; only running requests hold blocks.
    running, waiting = set(map(id, s.running)), set(map(id, s.waiting))
    assert not running & waiting and len(s.running) <= s.max_num_running_reqs
    for req in s.requests.values():
        assert req.num_computed_tokens <= req.num_tokens
        if req.status == RequestStatus.RUNNING:
            assert id(req) in running
            assert len(req_to_blocks.get(req.request_id, [])) * kv.block_size >= req.num_computed_tokens
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            assert id(req) in waiting and req.num_computed_tokens == 0
            assert not req_to_blocks.get(req.request_id)
        else:
            assert req.status == RequestStatus.FINISHED_IGNORED and id(req) not in running | waiting
    assert len(running) + len(waiting) == s.get_num_unfinished_requests()


def fake_worker(s: Scheduler, so, kv_slots: dict[int, int]) -> ModelRunnerOutput:
    """Write every scheduled token's KV slot, then check every attended slot, then sample."""
    bs = s.kv_cache_manager.block_size
    req_ids = list(so.num_scheduled_tokens)
    for req_id in req_ids:                              # NOTE: all writes before any read, per layer
        req, n = s.requests[req_id], so.num_scheduled_tokens[req_id]
        table = s.kv_cache_manager.get_block_ids(req_id)[0]
        for pos in range(req.num_computed_tokens - n, req.num_computed_tokens):
            kv_slots[table[pos // bs] * bs + pos % bs] = req.all_token_ids[pos]
    sampled = []
    for req_id in req_ids:
        req = s.requests[req_id]
        table = s.kv_cache_manager.get_block_ids(req_id)[0]
        for pos in range(req.num_computed_tokens):
            assert kv_slots.get(table[pos // bs] * bs + pos % bs) == req.all_token_ids[pos], (req_id, pos)
        partial = req.num_computed_tokens < req.num_tokens
        sampled.append([] if partial else [fake_model(list(req.all_token_ids))])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_finish(workload):
    cfg, reqs = workload
    s = make_scheduler(cfg)
    kv_slots: dict[int, int] = {}
    got: dict[str, list[int]] = {r[0]: [] for r in reqs}
    finish: dict[str, FinishReason] = {}
    aborted: set[str] = set()

    def abort(req_id: str) -> None:
        if req_id in s.requests and not s.requests[req_id].is_finished():
            aborted.add(req_id)
        s.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)   # a no-op otherwise
    for step_id in range(2000):
        for req_id, prompt, max_tokens, arrival, abort_at, mid in reqs:
            if arrival == step_id:
                s.add_request(Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      block_hasher=get_request_block_hasher(cfg["block_size"], sha256)))
            if abort_at == step_id and not mid:
                abort(req_id)
        check_invariants(s)
        if not s.has_requests() and step_id > 12:
            break
        so = s.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= cfg["budget"]
        check_invariants(s)
        mro = fake_worker(s, so, kv_slots)
        for req_id, prompt, max_tokens, arrival, abort_at, mid in reqs:
            if abort_at == step_id and mid:
                abort(req_id)                                        # while the step "runs"
        for eco in s.update_from_output(so, mro).values():
            for out in eco.outputs:
                assert out.request_id not in finish                 # nothing after the finish
                got[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    finish[out.request_id] = out.finish_reason
        check_invariants(s)
    else:
        raise AssertionError("workload did not finish: the scheduler made no progress")

    assert not s.requests and not s.running and not s.waiting
    assert s.kv_cache_manager.usage == 0.0
    for req_id, prompt, max_tokens, *_ in reqs:
        if req_id in aborted:
            continue
        if len(prompt) > cfg["max_model_len"]:
            assert finish[req_id] == FinishReason.LENGTH and got[req_id] == []
        else:
            assert finish[req_id] == FinishReason.LENGTH
            assert got[req_id] == expected_outputs(prompt, max_tokens)   # exactly max_tokens, correct ones


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_tight_cache_preempts_and_still_finishes(seed):
    """A workload sized to force preemption, with the same invariants."""
    import random
    rng = random.Random(seed)
    cfg = dict(block_size=2, num_blocks=9, max_model_len=16, budget=16, enable_chunked_prefill=True,
               max_num_seqs=4, caching=True, threshold=0)
    s = make_scheduler(cfg)
    prompts = {f"r{i}": [rng.randrange(50) for _ in range(rng.randint(3, 8))] for i in range(4)}
    for req_id, prompt in prompts.items():
        s.add_request(Request(req_id, prompt, SamplingParams(max_tokens=16 - len(prompt), ignore_eos=True),
                              block_hasher=get_request_block_hasher(2, sha256)))
    kv_slots, got, preemptions = {}, {r: [] for r in prompts}, 0
    for _ in range(500):
        if not s.has_requests():
            break
        so = s.schedule()
        preemptions += len(so.preempted_req_ids or ())
        check_invariants(s)
        for eco in s.update_from_output(so, fake_worker(s, so, kv_slots)).values():
            for out in eco.outputs:
                got[out.request_id] += out.new_token_ids
        check_invariants(s)
    assert not s.has_requests()
    assert preemptions > 0      # 4 requests x 8 blocks each cannot all fit in 8 blocks
    for req_id, prompt in prompts.items():
        assert got[req_id] == expected_outputs(prompt, 16 - len(prompt))
