"""MultiprocExecutor on the real default model: worker processes behind shared memory.

Greedy tokens through worker processes (one rank, and three tensor-parallel
ranks that each hold 3 of the 9 heads) equal the in-process UniProcExecutor's; worker errors come back with their traceback; a
SIGKILLed worker turns the next step into a clear error, not a hang; shutdown
leaves no process, no /dev/shm segment and no socket directory behind.
"""
import os
import signal
import time

import pytest
import torch

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.engine.arg_utils import EngineArgs
from vllm_anatomy.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "What is the capital of France?"]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE_ARGS = dict(num_gpu_blocks_override=64, max_model_len=512)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_worker():
    # Spawned workers inherit the environment: one torch thread each on these 2 cores.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def uni_token_ids():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # the in-process reference: same thread count as a worker
    try:
        llm = LLM(**ENGINE_ARGS)
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        torch.set_num_threads(threads)


def _generate(engine: LLMEngine, prompts, params, first_id=0) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(first_id + i), prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    return [finished[str(first_id + i)] for i in range(len(prompts))]


def _resources(executor) -> tuple[list[int], list[str], str]:
    names = [executor.rpc_broadcast_mq.buffer.name]
    names += [w.worker_response_mq.buffer.name for w in executor.workers]
    return [w.proc.pid for w in executor.workers], names, executor.ipc_dir


def _assert_released(pids, shm_names, ipc_dir) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)          # joined (reaped) and gone
    assert [n for n in shm_names if os.path.exists(f"/dev/shm/{n}")] == []
    assert not os.path.exists(ipc_dir)


@pytest.fixture(scope="module")
def mp2_engine():
    # NOTE: 3 ranks, not 2: the default model's 9 heads and 3 KV heads split by 3.
    config = EngineArgs(tensor_parallel_size=3, **ENGINE_ARGS).create_engine_config()
    engine = LLMEngine(config)
    yield engine
    engine.shutdown()


def test_llm_mp_backend_matches_uniproc(uni_token_ids):
    llm = LLM(distributed_executor_backend="mp", **ENGINE_ARGS)
    executor = llm.llm_engine.engine_core.model_executor
    assert type(executor).__name__ == "MultiprocExecutor" and len(executor.workers) == 1
    resources = _resources(executor)
    try:
        out = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert out == uni_token_ids
    _assert_released(*resources)


def test_world_size_2_matches_uniproc(mp2_engine, uni_token_ids):
    assert _generate(mp2_engine, PROMPTS, PARAMS) == uni_token_ids
    executor = mp2_engine.engine_core.model_executor
    # Every rank ran every step (only rank 0 replied): their runners agree.
    snapshots = executor.collective_rpc("snapshot")
    assert len(snapshots) == 3 and snapshots[0] == snapshots[1] == snapshots[2]
    assert snapshots[0]["kv_cache_shape"][1] == 64


def test_worker_error_comes_back_with_its_traceback(mp2_engine, uni_token_ids):
    executor = mp2_engine.engine_core.model_executor
    with pytest.raises(RuntimeError) as info:
        executor.collective_rpc("sample_tokens", (None,))     # no execute_model before it
    text = str(info.value)
    assert "rank 0" in text and "Traceback" in text
    assert "sample_tokens called without a preceding execute_model" in text
    with pytest.raises(RuntimeError, match="no RPC method"):
        executor.collective_rpc("_init_executor")
    # Both workers are still serving, and the queues are still aligned.
    assert executor.collective_rpc("determine_num_available_blocks") == [64, 64, 64]
    assert _generate(mp2_engine, PROMPTS[:1], PARAMS, first_id=100) == uni_token_ids[:1]


def test_killed_worker_fails_the_next_step_fast(mp2_engine):
    # NOTE: runs last in this module: it ends the shared engine.
    executor = mp2_engine.engine_core.model_executor
    resources = _resources(executor)
    victim = executor.workers[1]      # not the replying rank: only the sentinel can tell
    os.kill(victim.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"VllmWorker-1 .* died unexpectedly with exit code -9"):
        _generate(mp2_engine, PROMPTS[:1], PARAMS, first_id=200)
    assert time.monotonic() - t0 < 10
    with pytest.raises(RuntimeError, match="died unexpectedly"):
        executor.collective_rpc("determine_num_available_blocks")
    mp2_engine.shutdown()
    _assert_released(*resources)
