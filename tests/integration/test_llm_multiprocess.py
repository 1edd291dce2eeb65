"""The offline LLM with EngineCore in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1,
vLLM's SyncMPClient + EngineCoreProc), on the real default model: the same greedy
tokens, texts and counters as in-process, abort, a request the engine refuses
failing alone, structured output, a recorded run whose engine process wrote its
steps, engine death (EngineDeadError, no hang) and a shutdown that leaves no child.
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import interrupt_nth_add
from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.sampling_params import StructuredOutputsParams
from vllm_anatomy.tracing.reader import list_runs, open_run

pytestmark = pytest.mark.model

QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow.",
             "Who wrote Romeo and Juliet?", "What do bees make?"]
ENGINE_ARGS = dict(max_model_len=256, num_gpu_blocks_override=64)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 12, **kw})


def make_llm(model_dir: str, multiprocess: bool, **kw) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")
        return LLM(model_dir, **ENGINE_ARGS, **kw)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("traces"))


@pytest.fixture(scope="module")
def inproc(default_model_dir):
    llm = make_llm(default_model_dir, multiprocess=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def mp_llm(default_model_dir, trace_dir):
    llm = make_llm(default_model_dir, multiprocess=True, trace_level="full", trace_dir=trace_dir)
    yield llm
    llm.shutdown()


def chats(llm: LLM) -> list[dict]:
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                         add_generation_prompt=True, return_dict=False)}
            for q in QUESTIONS]


def test_the_engine_runs_in_its_own_process(mp_llm, inproc):
    client = mp_llm.llm_engine.engine_core_client
    assert type(client).__name__ == "SyncMPClient" and mp_llm.llm_engine.engine_core is None
    assert client.resources.engine_proc.is_alive() and client.resources.engine_proc.pid != os.getpid()
    assert type(inproc.llm_engine.engine_core_client).__name__ == "InprocClient"
    assert inproc.llm_engine.engine_core is inproc.llm_engine.engine_core_client.engine_core


def test_greedy_tokens_texts_and_counters_equal_in_process(mp_llm, inproc):
    prompts = chats(inproc)
    params = [greedy(), greedy(max_tokens=20), greedy(stop=[" by"]), greedy(ignore_eos=True, max_tokens=16)]
    before = {llm: llm.get_metrics() for llm in (mp_llm, inproc)}
    expected = inproc.generate(prompts, params, use_tqdm=False)
    got = mp_llm.generate(prompts, params, use_tqdm=True)          # the progress bar works too
    assert [o.request_id for o in got] == [o.request_id for o in expected]
    for g, e in zip(got, expected):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason and g.finished
    assert got[2].outputs[0].stop_reason == " by"                # a stop string, found on the frontend
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
        assert (mp_llm.get_metrics()[name] - before[mp_llm][name]
                == inproc.get_metrics()[name] - before[inproc][name]), name
    assert mp_llm.get_metrics()["vllm_anatomy:engine_steps"] > before[mp_llm]["vllm_anatomy:engine_steps"]


def test_abort_frees_the_request_in_the_engine_process(mp_llm):
    engine = mp_llm.llm_engine
    engine.add_request("to-abort", chats(mp_llm)[0], greedy(max_tokens=200, ignore_eos=True))
    engine.step()
    engine.abort_request(["to-abort"])
    assert not engine.has_unfinished_requests()
    stats = None
    for _ in range(100):    # the ABORT message is on its way: the engine's answer follows it
        stats = engine.engine_core_client.get_scheduler_stats()
        if stats.num_running_reqs == stats.num_waiting_reqs == 0:
            break
        time.sleep(0.05)
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0
    out = mp_llm.generate([chats(mp_llm)[1]], greedy(max_tokens=4), use_tqdm=False)   # still serving
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_request_the_engine_refuses_fails_alone(mp_llm, inproc):
    expected = inproc.generate([chats(inproc)[3]], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    engine = mp_llm.llm_engine
    good = engine.process_inputs("good", chats(mp_llm)[3], greedy())
    bad = engine.process_inputs("bad", chats(mp_llm)[3], greedy())
    vocab = mp_llm.get_tokenizer().vocab_size
    bad[1].sampling_params.stop_token_ids = [vocab + 5]   # as if the frontend had missed it
    engine.add_processed_request(*good)
    engine.add_processed_request(*bad)                     # the engine process refuses it, not this call
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert finished["bad"].outputs[0].finish_reason == "error" and finished["bad"].outputs[0].token_ids == []
    assert finished["good"].outputs[0].token_ids == expected


@pytest.mark.parametrize("refusal", ["duplicate id", "ctrl-c"])
def test_a_refused_add_aborts_what_this_generate_added(mp_llm, inproc, monkeypatch, refusal):
    """generate([p0 (n=2), p1, p2]) whose p2 is refused when added (its id is taken, or
    Ctrl-C lands in the add): p0's children and p1 are aborted in this process and in
    the engine's, another caller's request runs on, and the next generate() returns
    exactly its own outputs (before: they stayed, and came back from the next call)."""
    engine = mp_llm.llm_engine
    prompts = chats(mp_llm)[:3]
    params = [SamplingParams(n=2, temperature=0.8, max_tokens=12), greedy(), greedy()]
    expected = [o.outputs[0].token_ids for o in inproc.generate(prompts[1:], greedy(), use_tqdm=False)]
    other_expected = inproc.generate(chats(inproc)[3], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    first = next(mp_llm.request_counter)
    mp_llm.request_counter = itertools.count(first)
    other = str(first + 2) if refusal == "duplicate id" else "other"
    engine.add_request(other, chats(mp_llm)[3], greedy())    # another caller's request, added by hand
    error: type[BaseException] = ValueError                  # generate()'s third id is taken
    if refusal == "ctrl-c":
        error = KeyboardInterrupt                            # p0's two children, p1, then p2
        interrupt_nth_add(monkeypatch, engine.engine_core_client, 4)
    with pytest.raises(error):
        mp_llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert list(engine.output_processor.request_states) == [other] and not engine.output_processor.parent_requests
    # (the ABORT was sent before this call: the engine process answers it in order)
    assert engine.engine_core_client.call_utility("get_num_unfinished_requests") <= 1
    finished = {}
    while engine.has_unfinished_requests():                  # the other request runs on, alone
        finished.update({o.request_id: o for o in engine.step()})
    assert list(finished) == [other] and finished[other].outputs[0].token_ids == other_expected
    outs = mp_llm.generate(prompts[1:], greedy(), use_tqdm=False)
    assert [o.request_id for o in outs] == [str(first + 3), str(first + 4)]
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = engine.engine_core_client.get_scheduler_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0


def test_structured_output(mp_llm, inproc):
    tok = inproc.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Pick a color."}], tokenize=False,
                                     add_generation_prompt=True)
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 10}},
              "required": ["color"], "additionalProperties": False}
    params = [greedy(structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"])),
              greedy(max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema))]
    got = mp_llm.generate([prompt, prompt], params, use_tqdm=False)
    expected = inproc.generate([prompt, prompt], params, use_tqdm=False)
    assert got[0].outputs[0].text in ("red", "green", "blue")
    assert got[1].outputs[0].text.startswith("{")
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_shutdown_leaves_no_child_and_the_run_has_the_engines_steps(mp_llm, trace_dir):
    """Last of the module's tests on mp_llm: it shuts the engine down."""
    resources = mp_llm.llm_engine.engine_core_client.resources
    proc = resources.engine_proc
    mp_llm.shutdown()
    mp_llm.shutdown()                                      # twice is fine
    assert not proc.is_alive() and proc.exitcode is not None
    assert proc not in multiprocessing.active_children()
    assert not os.path.exists(resources.ipc_dir)
    [meta] = list_runs(trace_dir)
    run = open_run(meta["path"])
    try:
        steps = run.steps()
        assert steps and steps == list(range(1, len(steps) + 1))
        assert sorted(s.step_id for s in run.spans("EngineCore.step")) == steps
        assert len(run.spans("OutputProcessor.process_outputs")) > 0      # the frontend's side
        assert run.requests()
    finally:
        run.close()


def test_engine_death_is_reported_without_a_hang(default_model_dir):
    llm = make_llm(default_model_dir, multiprocess=True)
    proc = llm.llm_engine.engine_core_client.resources.engine_proc
    try:
        engine = llm.llm_engine
        engine.add_request("warm", {"prompt_token_ids": [1, 2, 3]}, greedy(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        steps = engine.counters["vllm_anatomy:engine_steps"]

        def kill_after_the_next_step() -> None:
            deadline = time.monotonic() + 60
            while engine.counters["vllm_anatomy:engine_steps"] == steps and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)

        threading.Thread(target=kill_after_the_next_step, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            llm.generate(chats(llm), greedy(max_tokens=200, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - t0 < 30
        assert not engine.has_unfinished_requests()        # generate() forgot its requests
        with pytest.raises(EngineDeadError):
            llm.generate(chats(llm)[:1], greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not proc.is_alive()
    assert proc not in multiprocessing.active_children()


EXIT_WITHOUT_SHUTDOWN = """
import os, sys
from vllm_anatomy import LLM, SamplingParams

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    llm = LLM(sys.argv[1], max_model_len=128, num_gpu_blocks_override=16)
    print("ENGINE_PID", llm.llm_engine.engine_core_client.resources.engine_proc.pid, flush=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
"""


def test_a_script_that_never_shuts_down_leaves_no_engine_behind(default_model_dir, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    done = subprocess.run([sys.executable, str(script), default_model_dir], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [pid] = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("ENGINE_PID")]
    with pytest.raises(ProcessLookupError):   # stopped at the interpreter's exit (weakref.finalize)
        os.kill(pid, 0)
