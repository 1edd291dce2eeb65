"""AsyncLLM over a real EngineCoreProc (default model): concurrent generate()
calls, cancellation aborting in the engine, stop strings, DELTA streaming,
stat loggers, refusals that lose nothing, and SIGKILL -> EngineDeadError."""
import asyncio
import os
import signal
import time

import pytest

from vllm_anatomy.engine.arg_utils import EngineArgs
from vllm_anatomy.engine.async_llm import AsyncLLM
from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.model

QUESTIONS = ["What is the capital of France?", "Name a color.", "What do bees make?"]


def engine_args() -> EngineArgs:
    return EngineArgs(max_model_len=256, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def start_engine(**kwargs) -> AsyncLLM:
    os.environ["OMP_NUM_THREADS"] = "1"   # inherited by the spawned engine process
    return AsyncLLM.from_engine_args(engine_args(), **kwargs)


@pytest.fixture(scope="module")
def engine(loop):
    llm = start_engine(multiprocess=True)
    yield llm
    llm.shutdown()
    assert not llm.engine_core.resources.engine_proc.is_alive()


def run(loop, coro, timeout=60):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def chat(engine, question):
    ids = engine.get_tokenizer().apply_chat_template([{"role": "user", "content": question}],
                                                     tokenize=True, add_generation_prompt=True,
                                                     return_dict=False)
    return {"prompt_token_ids": ids}


async def collect(engine, prompt, params, request_id, **kw):
    return [out async for out in engine.generate(prompt, params, request_id, **kw)]


async def wait_until_idle(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_scheduler_stats()
        if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0:
            return
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.05)


def greedy(**kw):
    return SamplingParams(temperature=0.0, **{"max_tokens": 8, **kw})


def test_concurrent_generate_matches_one_at_a_time(engine, loop):
    async def main():
        prompts = [chat(engine, q) for q in QUESTIONS]
        together = await asyncio.gather(*(collect(engine, p, greedy(), f"c{i}")
                                          for i, p in enumerate(prompts)))
        alone = await collect(engine, prompts[0], greedy(), "alone")
        return together, alone
    together, alone = run(loop, main())
    finals = [outs[-1] for outs in together]
    assert all(f.finished for f in finals)
    assert [f.request_id for f in finals] == ["c0", "c1", "c2"]
    assert all(not o.finished for outs in together for o in outs[:-1])
    assert finals[0].outputs[0].token_ids == alone[-1].outputs[0].token_ids
    assert "Paris" in finals[0].outputs[0].text


@pytest.mark.parametrize("multiprocess", [True, False], ids=["engine_proc", "inproc"])
def test_async_scheduling_engine_matches(engine, loop, multiprocess):
    """An engine with async scheduling (EngineCoreProc's busy loop, or the
    in-process client, stepping with a batch queue) gives the same greedy
    tokens, honours stop strings and aborts, and ends idle."""
    args = engine_args()
    args.async_scheduling = True
    os.environ["OMP_NUM_THREADS"] = "1"
    other = AsyncLLM.from_engine_args(args, multiprocess=multiprocess)
    try:
        async def main(e):
            prompts = [chat(e, q) for q in QUESTIONS]
            outs = await asyncio.gather(*(collect(e, p, greedy(max_tokens=12), f"a{i}")
                                          for i, p in enumerate(prompts)))
            stopped = await collect(e, prompts[0], greedy(max_tokens=12, stop=["Paris"]), "s")
            return [o[-1].outputs[0].token_ids for o in outs], stopped[-1].outputs[0]
        want, want_stop = run(loop, main(engine))
        got, got_stop = run(loop, main(other))
        assert got == want and got_stop.text == want_stop.text and got_stop.finish_reason == "stop"
        run(loop, wait_until_idle(other))
    finally:
        other.shutdown()


def test_delta_stream_concatenates_to_the_final_text(engine, loop):
    prompt = chat(engine, QUESTIONS[0])
    delta = run(loop, collect(engine, prompt, greedy(max_tokens=10, output_kind=RequestOutputKind.DELTA), "d"))
    full = run(loop, collect(engine, prompt, greedy(max_tokens=10), "f"))
    assert len(delta) > 1
    assert "".join(o.outputs[0].text for o in delta) == full[-1].outputs[0].text
    assert sum((o.outputs[0].token_ids for o in delta), []) == full[-1].outputs[0].token_ids
    assert delta[-1].finished and delta[-1].outputs[0].finish_reason == full[-1].outputs[0].finish_reason


def test_stop_string_finishes_and_frees_the_engine(engine, loop):
    prompt = chat(engine, QUESTIONS[0])
    text = run(loop, collect(engine, prompt, greedy(max_tokens=12), "ref"))[-1].outputs[0].text
    assert "Paris" in text
    final = run(loop, collect(engine, prompt, greedy(max_tokens=12, stop=["Paris"]), "stop"))[-1]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "Paris"
    assert final.outputs[0].text == text[:text.index("Paris")]
    run(loop, wait_until_idle(engine))


def test_cancelled_consumer_aborts_the_request(engine, loop):
    async def main():
        params = greedy(max_tokens=200, ignore_eos=True)
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate(chat(engine, QUESTIONS[1]), params, "cancel-me"):
                first.set()
        task = asyncio.create_task(consume())
        await first.wait()
        assert (await engine.get_scheduler_stats()).num_running_reqs == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(engine)

        gen = engine.generate(chat(engine, QUESTIONS[2]), params, "close-me")
        await gen.__anext__()
        await gen.aclose()                   # a client that stops reading
        await wait_until_idle(engine)
        assert not engine.output_processor.has_unfinished_requests()
    run(loop, main())


def test_stat_loggers_see_every_batch(engine, loop):
    class Recorder:
        def __init__(self):
            self.calls = []

        def record(self, scheduler_stats, iteration_stats):
            self.calls.append((scheduler_stats, iteration_stats))
    rec = Recorder()
    engine.stat_loggers.append(rec)
    try:
        final = run(loop, collect(engine, chat(engine, QUESTIONS[2]), greedy(max_tokens=5, ignore_eos=True), "s"))[-1]
    finally:
        engine.stat_loggers.remove(rec)
    its = [it for _, it in rec.calls]
    assert sum(it.num_generation_tokens for it in its) == 5
    assert sum(it.num_prompt_tokens for it in its) == len(final.prompt_token_ids)
    assert len([t for it in its for t in it.time_to_first_tokens_iter]) == 1
    assert len([t for it in its for t in it.inter_token_latencies_iter]) == 4
    (fin,) = [f for it in its for f in it.finished_requests]
    assert fin.finish_reason == "length" and fin.num_generation_tokens == 5 and fin.e2e_latency > 0
    assert any(s is not None and s.num_running_reqs == 1 for s, _ in rec.calls)


def test_bad_requests_are_refused_and_lose_nothing(engine, loop):
    async def main():
        with pytest.raises(ValueError, match="out of vocabulary"):
            await collect(engine, [10**7], greedy(), "bad")
        with pytest.raises(ValueError, match="cannot be empty"):
            await collect(engine, {"prompt_token_ids": []}, greedy(), "empty")
        # The same id twice (two HTTP clients with one X-Request-Id): both run,
        # as in vLLM; the engine's ids differ by a random suffix.
        slow = engine.generate(chat(engine, QUESTIONS[0]), greedy(max_tokens=4), "dup")
        first = await slow.__anext__()
        other = await collect(engine, chat(engine, QUESTIONS[1]), greedy(max_tokens=4), "dup")
        rest = [o async for o in slow]      # the original request is unharmed
        assert (rest or [first])[-1].finished and other[-1].finished
        assert first.request_id == other[-1].request_id == "dup"
        await engine.check_health()
    run(loop, main())
    assert not engine.errored


def test_in_process_async_engine(engine, loop):
    import torch
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    local = AsyncLLM.from_engine_args(engine_args(), multiprocess=False)
    try:
        prompt = chat(engine, QUESTIONS[0])
        got = run(loop, collect(local, prompt, greedy(), "local"))[-1]
        want = run(loop, collect(engine, prompt, greedy(), "remote"))[-1]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    finally:
        local.shutdown()
        torch.set_num_threads(num_threads)


def test_sigkill_fails_every_waiting_generate(loop):
    doomed = start_engine(multiprocess=True)
    try:
        async def main():
            params = greedy(max_tokens=200, ignore_eos=True)
            gens = [doomed.generate(chat(doomed, q), params, f"k{i}") for i, q in enumerate(QUESTIONS[:2])]
            for g in gens:
                await g.__anext__()
            os.kill(doomed.engine_core.resources.engine_proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            for g in gens:
                with pytest.raises(EngineDeadError):
                    async for _ in g:
                        pass
            assert time.monotonic() - t0 < 5
            assert doomed.errored
            with pytest.raises(EngineDeadError):
                await doomed.check_health()
            with pytest.raises(EngineDeadError):
                await collect(doomed, [1, 2, 3], greedy(), "after")
            with pytest.raises(EngineDeadError):
                await doomed.get_scheduler_stats()
        run(loop, main(), timeout=30)
    finally:
        doomed.shutdown()
    assert not os.path.exists(doomed.engine_core.resources.ipc_dir)
