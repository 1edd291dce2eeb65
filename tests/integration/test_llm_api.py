"""The offline API's contract on the real default model: sampling options, bad
input (clear errors, nothing lost), aborts and stop strings free every block."""
import itertools

import pytest

from tests.helpers import interrupt_nth_add
from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.core.request import RequestStatus
from vllm_anatomy.engine.protocol import EngineCoreRequest, FinishReason

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "Tell me a short story about a robot."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256)


def _no_blocks_held(llm):
    sched = llm.llm_engine.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    # Every block but the null block is free (cached ones included): nothing leaked.
    return (not sched.has_unfinished_requests() and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1)


def test_seeded_sampling_is_reproducible_across_batches(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    alone = llm.chat(CHAT, sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=16)
    batched = llm.chat([[{"role": "user", "content": "Hi!"}], CHAT], [other, sp], use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone
    unseeded = {tuple(llm.chat(CHAT, SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False)[0]
                      .outputs[0].token_ids) for _ in range(3)}
    assert len(unseeded) > 1, "temperature sampling without a seed should vary"


def test_logprobs(llm):
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1          # greedy: the sampled token is the top one
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop_tok = greedy.token_ids[3]
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]),
                   use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == greedy.token_ids[:greedy.token_ids.index(stop_tok) + 1]
    # "The capital of France is Paris." then EOS after 8 tokens; min_tokens=12
    # forbids EOS (<|im_end|> = 2) until 12 tokens.
    short = [{"role": "user", "content": "What is the capital of France?"}]
    base = llm.chat(short, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "stop" and base.token_ids[-1] == 2 and len(base.token_ids) < 12
    forced = llm.chat(short, SamplingParams(temperature=0, max_tokens=20, min_tokens=12),
                      use_tqdm=False)[0].outputs[0]
    assert len(forced.token_ids) >= 12 and 2 not in forced.token_ids[:12]
    assert forced.token_ids[:len(base.token_ids) - 1] == base.token_ids[:-1]


def test_stop_string_aborts_in_engine_and_frees_blocks(llm):
    greedy = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    word = greedy.text.split()[3]
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24, stop=[word]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == greedy.text[:greedy.text.index(word)]
    assert _no_blocks_held(llm)


def test_prompt_too_long_raises_and_loses_nothing(llm):
    tok = llm.get_tokenizer()
    long_prompt = {"prompt_token_ids": [tok.encode("a")[0]] * 300}
    with pytest.raises(ValueError, match="longer than the maximum model length of 256"):
        llm.generate(["Hello", long_prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    # The valid prompt of the refused batch was not started either.
    assert not llm.llm_engine.has_unfinished_requests() and _no_blocks_held(llm)


def _next_request_id(llm) -> int:
    """The id generate() will give its next prompt (LLM numbers them), without using it up."""
    first = next(llm.request_counter)
    llm.request_counter = itertools.count(first)
    return first


@pytest.mark.parametrize("refusal", ["duplicate id", "ctrl-c"])
def test_a_refused_add_aborts_what_this_generate_added(llm, monkeypatch, refusal):
    """The third prompt is refused when it is added (its id is someone else's, or Ctrl-C
    lands in the add): the two prompts added before it (the first with n=2) are aborted,
    nothing stays held, another caller's request is untouched, and the next generate()
    returns exactly its own outputs. (Before: they stayed in the engine, ran at the next
    generate() and came back among its outputs.)"""
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["Hello, my name is", "The sky is", "Once upon a time"]
    params = [SamplingParams(n=2, temperature=0.8, max_tokens=8), sp, sp]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], sp, use_tqdm=False)]
    other_prompt = {"prompt_token_ids": llm.get_tokenizer().encode("Bees make honey")}
    other_expected = llm.generate(other_prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    first = _next_request_id(llm)
    other = str(first + 2) if refusal == "duplicate id" else "other"
    engine.add_request(other, other_prompt, sp)            # another caller's request, added by hand
    if refusal == "duplicate id":
        error: type[BaseException] = ValueError            # generate()'s third id is taken
    else:
        error = KeyboardInterrupt                          # the two children of prompt 0, prompt 1, then 2
        interrupt_nth_add(monkeypatch, engine.engine_core_client, 4)
    with pytest.raises(error):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    sched = engine.engine_core.scheduler
    assert list(engine.output_processor.request_states) == [other] and not engine.output_processor.parent_requests
    assert list(sched.requests) == [other] and engine.get_num_unfinished_requests() == 1
    finished = {}
    while engine.has_unfinished_requests():                # the other request runs on, alone
        finished.update({o.request_id: o for o in engine.step()})
    assert list(finished) == [other] and finished[other].outputs[0].token_ids == other_expected
    outs = llm.generate(prompts[1:], sp, use_tqdm=False)
    assert [o.request_id for o in outs] == [str(first + 3), str(first + 4)]
    assert [o.outputs[0].token_ids for o in outs] == expected
    engine.step()                                          # (tells the worker the last ones finished)
    assert _no_blocks_held(llm)
    assert not engine.engine_core.model_executor.driver_worker.model_runner.input_batch.req_id_to_index


@pytest.mark.parametrize("prompt, err", [("", ValueError), ({"prompt_token_ids": []}, ValueError),
                                         ({"prompt_token_ids": [10 ** 9]}, ValueError),
                                         ({"nothing": 1}, ValueError), (3.5, TypeError)])
def test_bad_prompts(llm, prompt, err):
    with pytest.raises(err):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)


def test_bad_engine_arguments():
    with pytest.raises(TypeError, match="Unknown engine argument"):
        LLM(max_num_batchd_tokens=3)
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        LLM(num_gpu_blocks_override=1)


def test_engine_core_ignores_too_long_prompt_and_aborts_unknown(llm):
    core = llm.llm_engine.engine_core
    core.abort_requests(["never-existed"])                       # a no-op
    sp = SamplingParams(max_tokens=4)
    core.add_request(EngineCoreRequest("too-long", [5] * 300, sp, 0.0))
    outs, _ = core.step()
    (eco,) = [o for out in outs.values() for o in out.outputs if o.request_id == "too-long"]
    assert eco.finish_reason == FinishReason.LENGTH and eco.new_token_ids == []
    assert _no_blocks_held(llm)


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("x", {"prompt_token_ids": llm.get_tokenizer().encode("Once upon a time")},
                       SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    req = engine.engine_core.scheduler.requests["x"]
    assert req.status == RequestStatus.RUNNING and req.num_output_tokens > 0
    engine.abort_request(["x"])
    assert req.status == RequestStatus.FINISHED_ABORTED
    engine.step()   # the next step tells the worker to drop it
    assert _no_blocks_held(llm)
    assert "x" not in engine.engine_core.model_executor.driver_worker.model_runner.input_batch.req_id_to_index


def test_an_llm_dropped_without_shutdown_gives_its_engine_back(tiny_llama_dir):
    """EngineCore freezes its start-up heap (gc.freeze, as vLLM's); an LLM that goes out of
    scope shuts its engine down (a finalizer), so the collector can take the engine's cycles,
    weights and KV cache back. Without it each dropped LLM stayed for the process's life."""
    import gc
    import weakref
    llm = LLM(tiny_llama_dir, max_model_len=128)
    llm.generate(["t5 t6 t7"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    engine, core = weakref.ref(llm.llm_engine), weakref.ref(llm.llm_engine.engine_core)
    del llm
    gc.collect()
    assert engine() is None and core() is None
    assert gc.get_freeze_count() == 0          # the frozen start-up heap went back to the collector
