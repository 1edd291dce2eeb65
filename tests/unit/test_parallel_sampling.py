"""Parallel sampling (n > 1), without a model: the fan-out, the output aggregation, and
the children's shared prompt blocks in the scheduler's KV cache.

- fan_out / ParentRequest: child ids "{i}_{parent}", n = 1 each, seed + i;
- OutputProcessor with fabricated EngineCoreOutputs: FINAL_ONLY gives one
  RequestOutput with all n outputs, by index, once the last child finishes;
  DELTA gives each child's output as it comes, through one collector, merged by
  index; aborting the parent aborts its unfinished children;
- Scheduler with fabricated ModelRunnerOutputs: the children's full prompt
  blocks have ref_cnt n while all run, lose one holder per finished child, and
  reach the free queue only when the last one finishes.
"""
from __future__ import annotations

import asyncio

import pytest

from tests.conftest import save_word_level_tokenizer
from tests.unit.test_scheduler import create_scheduler, make_output
from vllm_anatomy.core.kv_cache_utils import get_request_block_hasher, sha256
from vllm_anatomy.core.request import Request
from vllm_anatomy.engine.output_processor import OutputProcessor, RequestOutputCollector
from vllm_anatomy.engine.parallel_sampling import ParentRequest, fan_out
from vllm_anatomy.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_anatomy.outputs import CompletionOutput
from vllm_anatomy.sampling_params import RequestOutputKind, SamplingParams
from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer

PROMPT = [5, 6, 7]


def make_request(n: int = 3, seed: int | None = None, kind=RequestOutputKind.FINAL_ONLY,
                 prompt: list[int] = PROMPT) -> EngineCoreRequest:
    params = SamplingParams(n=n, temperature=0.8, seed=seed, max_tokens=8, output_kind=kind)
    return EngineCoreRequest("r-abc", list(prompt), params, 0.0, external_req_id="r")


# -- fan-out -----------------------------------------------------------------------------------
def test_fan_out_ids_params_and_seeds():
    req = make_request(seed=100)
    children = fan_out(req)
    assert [c.request_id for _, _, c in children] == ["0_r-abc", "1_r-abc", "2_r-abc"]
    assert [i for _, i, _ in children] == [0, 1, 2]
    assert [c.sampling_params.seed for _, _, c in children] == [100, 101, 102]
    assert all(c.sampling_params.n == 1 and c.external_req_id == "r" for _, _, c in children)
    parent = children[0][0]
    assert parent is not None and parent.request_id == "r-abc" and parent.external_req_id == "r"
    assert parent.child_requests == {"0_r-abc", "1_r-abc", "2_r-abc"}
    assert children[-1][2] is req                       # the last child is the parent's own record
    assert children[0][2].prompt_token_ids is req.prompt_token_ids    # shared, not copied
    # Without a seed the children share one params object; the caller's n stays 3.
    unseeded = fan_out(make_request())
    assert unseeded[0][2].sampling_params is unseeded[2][2].sampling_params
    assert unseeded[0][0].sampling_params.n == 3 and unseeded[0][2].sampling_params.seed is None


def test_n_one_is_not_fanned_out():
    req = make_request(n=1)
    assert fan_out(req) == [(None, 0, req)] and req.request_id == "r-abc"


def out(index: int, text: str, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index=index, text=text, token_ids=[1], finish_reason=finish)


def test_parent_get_outputs_streaming_and_final_only():
    streaming = ParentRequest(make_request(kind=RequestOutputKind.DELTA))
    final_only = ParentRequest(make_request())
    ids = [streaming.get_child_info(i)[0] for i in range(3)]
    for i in range(3):
        final_only.get_child_info(i)
    assert streaming.get_outputs(ids[1], out(1, "a")) == ([out(1, "a")], False)
    assert streaming.get_outputs(ids[1], out(1, "b", "stop")) == ([out(1, "b", "stop")], False)
    # A child already finished and returned is not sent again.
    assert streaming.get_outputs(ids[1], out(1, "", "abort")) == ([], False)
    assert final_only.get_outputs(ids[2], out(2, "x", "stop")) == ([], False)
    assert final_only.get_outputs(ids[0], out(0, "y", "length")) == ([], False)
    outputs, finished = final_only.get_outputs(ids[1], out(1, "z", "stop"))
    assert finished and [o.index for o in outputs] == [0, 1, 2] and [o.text for o in outputs] == ["y", "z", "x"]


# -- the OutputProcessor --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("word_tokenizer")
    save_word_level_tokenizer(str(path))
    return get_tokenizer(str(path))


def add_children(op: OutputProcessor, req: EngineCoreRequest, queue=None) -> list[str]:
    ids = []
    for parent, index, child in fan_out(req):
        op.add_request(child, None, queue, parent, index)
        ids.append(child.request_id)
    return ids


def eco(req_id: str, tokens: list[int], finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, tokens, finish_reason=finish)


def test_final_only_gives_one_output_with_all_n(tokenizer):
    op = OutputProcessor(tokenizer)
    c0, c1, c2 = add_children(op, make_request())
    assert op.process_outputs([eco(c0, [10]), eco(c1, [11]), eco(c2, [12])]).request_outputs == []
    # Child 1 stops early (a stop token: kept in token_ids, not in the text); its output waits.
    assert op.process_outputs([eco(c0, [20]), eco(c1, [21], FinishReason.STOP), eco(c2, [22])]).request_outputs == []
    assert c1 not in op.request_states and "r-abc" in op.parent_requests
    (result,) = op.process_outputs([eco(c2, [32], FinishReason.LENGTH), eco(c0, [30], FinishReason.LENGTH)]
                                   ).request_outputs
    assert result.request_id == "r" and result.finished and result.prompt_token_ids == PROMPT
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert [o.text for o in result.outputs] == [" t10 t20 t30", " t11", " t12 t22 t32"]
    assert [o.token_ids for o in result.outputs] == [[10, 20, 30], [11, 21], [12, 22, 32]]
    assert [o.finish_reason for o in result.outputs] == ["length", "stop", "length"]
    assert not op.request_states and not op.parent_requests and not op.external_req_ids


def test_delta_streams_each_child_through_one_collector(tokenizer):
    async def run():
        op = OutputProcessor(tokenizer)
        queue = RequestOutputCollector(RequestOutputKind.DELTA, "r-abc")
        c0, c1 = add_children(op, make_request(n=2, kind=RequestOutputKind.DELTA), queue)
        op.process_outputs([eco(c0, [10]), eco(c1, [11])])
        op.process_outputs([eco(c1, [21], FinishReason.LENGTH)])
        # The consumer was slow: three outputs merged, by index, into one.
        first = queue.get_nowait()
        assert first is not None and not first.finished
        assert {o.index: (o.text, o.token_ids, o.finish_reason) for o in first.outputs} == {
            0: (" t10", [10], None), 1: (" t11 t21", [11, 21], "length")}
        op.process_outputs([eco(c0, [20], FinishReason.LENGTH)])
        last = await queue.get()
        assert last.finished and [(o.index, o.text, o.finish_reason) for o in last.outputs] == [(0, " t20", "length")]
    asyncio.run(run())


def test_abort_by_parent_id_aborts_unfinished_children(tokenizer):
    op = OutputProcessor(tokenizer)
    queue = RequestOutputCollector(RequestOutputKind.FINAL_ONLY, "r-abc")
    c0, c1, c2 = add_children(op, make_request(), queue)
    op.process_outputs([eco(c0, [10], FinishReason.STOP), eco(c1, [11]), eco(c2, [12])])
    assert queue.get_nowait() is None                   # FINAL_ONLY: nothing until all end
    assert op.abort_requests(["r-abc"]) == [c1, c2]     # the engine ids to free
    final = queue.get_nowait()
    assert final is not None and final.finished
    assert [(o.index, o.finish_reason) for o in final.outputs] == [(0, "stop"), (1, "abort"), (2, "abort")]
    assert not op.request_states and not op.parent_requests


# -- the scheduler: one set of prompt blocks, n holders -----------------------------------------------
BS = 4


def child_requests(n: int, prompt_len: int) -> list[Request]:
    req = make_request(n=n, prompt=list(range(100, 100 + prompt_len)))
    req.sampling_params.eos_token_id = 2
    return [Request.from_engine_core_request(c, get_request_block_hasher(BS, sha256)) for _, _, c in fan_out(req)]


def test_children_share_prompt_blocks_until_the_last_finishes():
    s = create_scheduler(block_size=BS, num_blocks=64, max_model_len=64, max_num_batched_tokens=64)
    pool = s.kv_cache_manager.block_pool
    children = child_requests(3, prompt_len=10)           # 2 full blocks + a partial one
    for c in children:
        s.add_request(c)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"0_r-abc": 10, "1_r-abc": 2, "2_r-abc": 2}   # 8 tokens hit, 2 computed
    tables = {c.request_id: s.kv_cache_manager.get_block_ids(c.request_id)[0] for c in children}
    shared = tables["0_r-abc"][:2]
    assert all(t[:2] == shared for t in tables.values())
    assert len({t[2] for t in tables.values()}) == 3, "each child writes its own partial block"
    assert [pool.blocks[b].ref_cnt for b in shared] == [3, 3]
    s.update_from_output(so, make_output(s, so))
    # Child 0 samples EOS: one holder fewer, the blocks stay held.
    so = s.schedule()
    s.update_from_output(so, make_output(s, so, tokens={"0_r-abc": [2]}))
    assert [pool.blocks[b].ref_cnt for b in shared] == [2, 2]
    free = set(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    assert not free & set(shared) and tables["0_r-abc"][2] in free
    so = s.schedule()
    s.update_from_output(so, make_output(s, so, tokens={"1_r-abc": [2]}))
    assert [pool.blocks[b].ref_cnt for b in shared] == [1, 1]
    so = s.schedule()
    s.update_from_output(so, make_output(s, so, tokens={"2_r-abc": [2]}))
    # The last holder finished: the shared blocks are free, still hashed (a hit for the next request).
    assert [pool.blocks[b].ref_cnt for b in shared] == [0, 0]
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert set(shared) <= set(free) and all(pool.blocks[b].block_hash is not None for b in shared)
    assert not s.has_unfinished_requests()


def test_without_prefix_caching_children_do_not_share():
    s = create_scheduler(block_size=BS, num_blocks=64, max_model_len=64, max_num_batched_tokens=64,
                         enable_prefix_caching=False)
    children = child_requests(3, prompt_len=10)
    for c in children:
        s.add_request(c)
    so = s.schedule()
    assert so.num_scheduled_tokens == {c.request_id: 10 for c in children}
    blocks = [b for c in children for b in s.kv_cache_manager.get_block_ids(c.request_id)[0]]
    assert len(blocks) == len(set(blocks)) == 9
