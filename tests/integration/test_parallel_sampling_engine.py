"""Parallel sampling and the sampling parameters through the whole engine, on a tiny random Llama (CPU).

- LLM.generate with n = 3: three outputs per request; with a seed they differ
  from each other and a rerun repeats them (child i has seed + i); the run
  store's KV snapshots show the three children on one set of prompt blocks
  (ref_cnt 3, three owners), the shared blocks still held after one child is
  aborted, and free once the last one finishes;
- AsyncLLM streaming (DELTA) with n = 3: every chunk carries its choice index,
  the concatenated deltas equal the final-only answer, and closing the stream
  aborts every child in the engine;
- penalties and bad words under async scheduling (their output tokens arrive
  as -1 placeholders, filled before sampling) equal the synchronous engine.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.engine.arg_utils import EngineArgs
from vllm_anatomy.engine.async_llm import AsyncLLM
from vllm_anatomy.sampling_params import RequestOutputKind
from vllm_anatomy.tracing.reader import open_run
from vllm_anatomy.worker.async_output import AsyncGPUModelRunnerOutput

PROMPT = [(7 * j) % 480 + 20 for j in range(40)]       # 2 full blocks of 16 + 8 tokens


def sampled(n=3, seed=11, max_tokens=6, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_generate_n_seeded_children_differ_and_repeat(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=64)
    other = [(3 * j) % 480 + 20 for j in range(9)]
    first = llm.generate([PROMPT, other], [sampled(), sampled(n=2, seed=5)], use_tqdm=False)
    again = llm.generate([PROMPT, other], [sampled(), sampled(n=2, seed=5)], use_tqdm=False)
    assert [len(o.outputs) for o in first] == [3, 2]
    assert [o.index for o in first[0].outputs] == [0, 1, 2]
    tokens = [c.token_ids for c in first[0].outputs]
    assert all(len(t) == 6 for t in tokens) and len({tuple(t) for t in tokens}) == 3
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in first]
    # Child i is the request with seed + i, alone: the fan-out changes nothing else.
    # NOTE: checked on a CPU, where a row's logits do not depend on the batch around it; a GPU's
    # kernels may round differently at another batch size, and one flipped draw changes the rest.
    alone = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=12, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)
    if not torch.cuda.is_available():
        assert alone[0].outputs[0].token_ids == tokens[1]
    assert llm.get_metrics()["vllm:request_success"] == 11      # children count as requests (vLLM too)
    llm.shutdown()


def test_children_share_prompt_blocks_in_the_run_store(tiny_llama_dir, tmp_path):
    llm = LLM(tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=64, trace_level="full",
              trace_dir=str(tmp_path))
    engine = llm.llm_engine
    engine.add_request("p", {"prompt_token_ids": PROMPT},
                       sampled(max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY))
    children = ["0_p", "1_p", "2_p"]
    for _ in range(3):
        engine.step()
    pool = engine.engine_core.scheduler.kv_cache_manager
    shared = pool.get_block_ids("0_p")[0][:2]
    assert all(pool.get_block_ids(c)[0][:2] == shared for c in children)
    # One child is aborted: its own blocks go back, the shared ones keep two holders.
    own = pool.get_block_ids("0_p")[0][2:]
    engine.abort_request(["0_p"])
    engine.step()
    assert [pool.block_pool.blocks[b].ref_cnt for b in shared] == [2, 2]
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (final,) = outs
    assert [(o.index, o.finish_reason) for o in final.outputs] == [(0, "abort"), (1, "length"), (2, "length")]
    path = llm.llm_engine.recorder.run_path
    llm.shutdown()

    run = open_run(path)
    steps = run.steps()
    kv = {s: run.snapshot(s)["scheduler"]["kv_cache"] for s in steps}
    ref = {s: {b["block_id"]: b for b in kv[s]["blocks"]} for s in steps}
    all_three = [s for s in steps if set(kv[s]["req_to_block_ids"]) == set(children)]
    assert all_three, "a step where the three children run"
    for s in all_three:
        assert [ref[s][b]["ref_cnt"] for b in shared] == [3, 3]
        assert all(sorted(ref[s][b]["owners"]) == children for b in shared)
    two = [s for s in steps if set(kv[s]["req_to_block_ids"]) == {"1_p", "2_p"}]
    assert two and all([ref[s][b]["ref_cnt"] for b in shared] == [2, 2] for s in two)
    assert all(ref[two[0]][b]["ref_cnt"] == 0 for b in own)
    last = steps[-1]
    assert not kv[last]["req_to_block_ids"] and all(ref[last][b]["ref_cnt"] == 0 for b in shared)
    assert set(shared) <= set(kv[last]["free_queue"])
    run.close()


def test_async_llm_streams_n_choices_with_indices(tiny_llama_dir):
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_dir, max_model_len=256,
                                                      num_gpu_blocks_override=64), multiprocess=False)
        try:
            prompt = {"prompt_token_ids": PROMPT}
            delta = sampled(max_tokens=5, output_kind=RequestOutputKind.DELTA)
            streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
            outs = [o async for o in engine.generate(prompt, delta, "s")]
            for o in outs:
                assert o.request_id == "s"
                for c in o.outputs:
                    streamed[c.index] += c.token_ids
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            final = [o async for o in engine.generate(prompt, sampled(max_tokens=5,
                                                      output_kind=RequestOutputKind.FINAL_ONLY), "f")]
            assert len(final) == 1 and {c.index: c.token_ids for c in final[0].outputs} == streamed
            # Closing a stream early aborts all three children in the engine.
            gen = engine.generate(prompt, sampled(max_tokens=200, output_kind=RequestOutputKind.DELTA), "c")
            await gen.__anext__()
            await gen.aclose()
            for _ in range(100):
                stats = await engine.get_scheduler_stats()
                if stats.num_running_reqs == stats.num_waiting_reqs == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0
            assert not engine.output_processor.request_states and not engine.output_processor.parent_requests
        finally:
            engine.shutdown()
    asyncio.run(main())


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.8),
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(allowed_token_ids=list(range(100, 140))),
], ids=["repetition", "presence_frequency", "allowed"])
def test_penalties_async_scheduling_equals_sync(tiny_llama_dir, params, monkeypatch):
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:13]}]
    fills = []
    original = AsyncGPUModelRunnerOutput.fill_placeholders
    monkeypatch.setattr(AsyncGPUModelRunnerOutput, "fill_placeholders",
                        lambda self: fills.append(1) or original(self))

    def run(async_scheduling, **kw):
        llm = LLM(tiny_llama_dir, max_model_len=256, max_num_batched_tokens=32, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw),
                            use_tqdm=False)
        llm.shutdown()
        return [o.outputs[0].token_ids for o in outs]
    plain = run(False)
    sync, asynchronous = run(False, **params), run(True, **params)
    assert asynchronous == sync
    assert sync != plain, "the parameter must change the greedy output of this model"
    # Penalties read the output tokens: the async run waited for last step's ids before sampling;
    # allowed_token_ids does not read them, so it never waits.
    assert bool(fills) == ("allowed_token_ids" not in params)


def test_bad_words_async_scheduling_equals_sync(tiny_llama_dir):
    """A two-token bad word: its last token is banned exactly where the output ends with its first.

    NOTE: given as token ids (SamplingParams.bad_words_token_ids, what bad_words
    becomes on the frontend): this test tokenizer does not encode every word
    it decodes back to the same ids."""
    def run(async_scheduling, bad=None):
        llm = LLM(tiny_llama_dir, max_model_len=256, async_scheduling=async_scheduling)
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words_token_ids=bad)
        out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids
        llm.shutdown()
        return out
    plain = run(False)
    a, b = plain[2], plain[3]
    sync, asynchronous = run(False, [[a, b]]), run(True, [[a, b]])
    # The first place the plain output has the word: identical up to there, then not b.
    k = next(k for k in range(1, len(plain)) if plain[k - 1] == a and plain[k] == b)
    assert asynchronous == sync and sync[:k] == plain[:k] and sync[k] != b
    assert all(not (x == a and y == b) for x, y in zip(sync, sync[1:]))
