"""EngineCoreProc in a real child process with the real default model, driven
through SyncMPClient: same greedy tokens as the in-process EngineCore, aborts
free blocks, utility calls, a private socket directory, a bad request failing
alone, and engine death (a fatal step error, SIGKILL) reaching every caller as
EngineDeadError."""
import os
import signal
import stat
import threading
import time

import pytest

from vllm_anatomy.engine.core_client import EngineCoreClient, InprocClient
from vllm_anatomy.engine.core_client_mp import SyncMPClient
from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.engine.protocol import EngineCoreRequest, FinishReason
from vllm_anatomy.executor.uniproc_executor import UniProcExecutor
from vllm_anatomy.sampling_params import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [[1, 4093, 28, 5248, 282, 4649, 47, 2], [504, 2365, 6354, 16438, 27003]]
GREEDY = dict(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def vllm_config():
    from vllm_anatomy.engine.arg_utils import EngineArgs
    return EngineArgs(max_model_len=256, num_gpu_blocks_override=64).create_engine_config()


class FailingForwardExecutor(UniProcExecutor):
    """A batch-level failure, what still kills the engine: every step with tokens raises
    (as a forward that fails for the whole batch would). Imported by the spawned engine."""

    def execute_model(self, scheduler_output, non_block=False):
        if scheduler_output.total_num_scheduled_tokens:
            raise IndexError("injected: the batch's forward failed")
        return super().execute_model(scheduler_output, non_block)


class HangingShutdownExecutor(FailingForwardExecutor):
    """Fails the batch, then never finishes shutting down (a stuck flush, a thread that
    will not stop): the dead engine's exit watchdog must end the process anyway."""

    def shutdown(self):
        time.sleep(3600)


def start_client(vllm_config, executor_class=None) -> SyncMPClient:
    # NOTE: the spawned engine inherits the environment: one OpenMP thread (shared CPUs).
    os.environ["OMP_NUM_THREADS"] = "1"
    client = EngineCoreClient.make_client(multiprocess_mode=True, asyncio_mode=False,
                                          vllm_config=vllm_config, executor_class=executor_class)
    assert isinstance(client, SyncMPClient)
    return client


@pytest.fixture(scope="module")
def client(vllm_config):
    c = start_client(vllm_config)
    yield c
    proc = c.resources.engine_proc
    c.shutdown()
    assert not proc.is_alive()
    assert not os.path.exists(c.resources.ipc_dir)


def wait_for_exit(proc, timeout_s: float) -> int | None:
    """The engine process's exit code once it has exited (within timeout_s); None if it still runs.

    NOTE: multiprocessing learns a child's exit code from waitpid. In a whole-suite run the
    dead engine's exitcode stayed None after join(30) while nothing of it ran any more (its
    last words, faulthandler's dump, were in the log): something else in this test process
    had reaped it. So the pid is asked too: gone, a zombie or another process by now
    (another start time) means exited; the code then reads as 1 only when unknown."""
    import psutil
    started = psutil.Process(proc.pid).create_time() if psutil.pid_exists(proc.pid) else None
    proc.join(timeout_s)
    if proc.exitcode is not None:
        return proc.exitcode
    try:
        p = psutil.Process(proc.pid)
        if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
            return None                       # still running
    except psutil.NoSuchProcess:
        pass
    return 1


def request(rid, prompt, **params):
    return EngineCoreRequest(rid, list(prompt), SamplingParams(**params), time.time())


def first_output(c, rid):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for out in c.get_output().outputs:
            if out.request_id == rid:
                return out
    raise AssertionError(f"no output for {rid}")


def run_to_completion(c, requests) -> dict[str, list[int]]:
    for r in requests:
        c.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: set[str] = set()
    deadline = time.monotonic() + 60
    while len(finished) < len(requests):
        assert time.monotonic() < deadline
        for out in c.get_output().outputs:
            if out.request_id not in tokens:
                continue   # a late output of an earlier test's request
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
    return tokens


def test_outputs_equal_in_process_engine(client, vllm_config):
    reqs = [request(f"p{i}", p, **GREEDY) for i, p in enumerate(PROMPTS)]
    got = run_to_completion(client, reqs)
    import torch
    # NOTE: one thread, like the engine process: two OpenMP threads spinning on
    # two shared, busy cores make this 15x slower.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    inproc = InprocClient(vllm_config)
    try:
        want = run_to_completion(inproc, [request(f"p{i}", p, **GREEDY) for i, p in enumerate(PROMPTS)])
    finally:
        inproc.shutdown()
        torch.set_num_threads(num_threads)
    assert got == want
    assert all(len(t) == GREEDY["max_tokens"] for t in got.values())


def test_trace_headers_survive_the_socket(client):
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    client.add_request(EngineCoreRequest("th", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1),
                                         time.time(), trace_headers=headers))
    out = first_output(client, "th")
    assert out.trace_headers == headers


def test_abort_frees_blocks(client):
    client.add_request(request("long", PROMPTS[0] * 4, temperature=0.0, max_tokens=200, ignore_eos=True))
    first_output(client, "long")
    stats = client.get_scheduler_stats()
    assert stats.num_running_reqs == 1 and stats.kv_cache_usage > 0
    client.abort_requests(["long"])
    deadline = time.monotonic() + 5
    while (stats := client.get_scheduler_stats()).kv_cache_usage > 0:
        assert time.monotonic() < deadline, stats
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


def test_utility_calls(client):
    assert client.reset_prefix_cache() is True
    assert client.call_utility("get_num_unfinished_requests") == 0
    with pytest.raises(RuntimeError, match="unknown utility method 'shutdown'"):
        client.call_utility("shutdown")


def test_malformed_messages_are_dropped_engine_keeps_serving(client):
    sock, identity = client.input_socket, client.engine_identity
    sock.send_multipart([identity, b"\x7f", b"junk"])                 # unknown type
    sock.send_multipart([identity, b"\x00", b"\xc1not msgpack"])      # ADD, bad payload
    sock.send_multipart([identity, b"\x00"])                          # missing frame
    got = run_to_completion(client, [request("after-junk", PROMPTS[1], **GREEDY)])
    assert len(got["after-junk"]) == GREEDY["max_tokens"]


def test_undecodable_add_with_a_readable_id_is_answered(client):
    """An ADD the engine cannot decode (here: sampling params of the wrong
    type) but whose request id it can read gets an ERROR finish, so its caller
    is not left waiting; the engine keeps serving."""
    import msgspec
    sock, identity = client.input_socket, client.engine_identity
    sock.send_multipart([identity, b"\x00", msgspec.msgpack.encode(["undecodable", [1, 2], "not params", 0.0])])
    deadline, outs = time.monotonic() + 30, {}
    while "undecodable" not in outs and time.monotonic() < deadline:
        outs.update({o.request_id: o for o in client.get_output().outputs})
    assert outs["undecodable"].finish_reason == FinishReason.ERROR
    got = run_to_completion(client, [request("after-undecodable", PROMPTS[1], **GREEDY)])
    assert len(got["after-undecodable"]) == GREEDY["max_tokens"]


def test_socket_files_are_owner_only(client):
    ipc_dir = client.resources.ipc_dir
    assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
    names = sorted(os.listdir(ipc_dir))
    assert names == ["input.sock", "output.sock"]
    for name in names:
        st = os.stat(os.path.join(ipc_dir, name))
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) & 0o077 == 0


def test_bad_request_bypassing_the_frontend_fails_alone(client):
    """Issue 14: ids outside the vocabulary sent straight to the engine (no
    InputProcessor) used to kill it in the embedding or the sampler. EngineCore
    re-checks in its input thread: that request is finished with ERROR, the
    engine serves the next ones."""
    vocab = 49152
    c = client
    c.add_request(request("bad-prompt", [10**7], temperature=0.0, max_tokens=2))
    c.add_request(request("bad-stop", PROMPTS[0], temperature=0.0, max_tokens=4, min_tokens=2,
                          stop_token_ids=[vocab]))
    outs = {}
    deadline = time.monotonic() + 30
    while len(outs) < 2 and time.monotonic() < deadline:
        outs.update({o.request_id: o for o in c.get_output().outputs if o.request_id.startswith("bad-")})
    assert {rid: o.finish_reason for rid, o in outs.items()} == {
        "bad-prompt": FinishReason.ERROR, "bad-stop": FinishReason.ERROR}
    tokens = run_to_completion(c, [request("after-bad", PROMPTS[1], **GREEDY)])
    assert 0 < len(tokens["after-bad"]) <= GREEDY["max_tokens"]


def test_fatal_step_error_is_reported_as_engine_dead(vllm_config):
    c = start_client(vllm_config, FailingForwardExecutor)
    try:
        c.add_request(request("bad", PROMPTS[0], temperature=0.0, max_tokens=2))
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="EngineCore died: IndexError"):
            while True:
                c.get_output()
        assert time.monotonic() - t0 < 10
        # NOTE: generous: on a loaded 2-core machine the dying process' shutdown (its executor's
        # grace period, the recorder's flush) took over 10 s once (it takes ~1 s idle).
        assert wait_for_exit(c.resources.engine_proc, 30) not in (None, 0)
        with pytest.raises(EngineDeadError):
            c.add_request(request("later", PROMPTS[0], **GREEDY))
        with pytest.raises(EngineDeadError):
            c.get_output()
    finally:
        c.shutdown()


def test_dead_engine_stuck_in_shutdown_still_exits(vllm_config, monkeypatch):
    """After a fatal error the engine's shutdown hangs: faulthandler's watchdog (armed once the
    frontend was told) dumps the stacks and ends the process with 1, so no dead engine lingers."""
    monkeypatch.setenv("VLLM_ANATOMY_DEAD_ENGINE_EXIT_TIMEOUT_S", "3")   # the spawned engine inherits it
    c = start_client(vllm_config, HangingShutdownExecutor)
    try:
        c.add_request(request("bad", PROMPTS[0], temperature=0.0, max_tokens=2))
        with pytest.raises(EngineDeadError, match="EngineCore died: IndexError"):
            while True:
                c.get_output()
        t0 = time.monotonic()
        assert wait_for_exit(c.resources.engine_proc, 30) == 1, "the watchdog's exit code"
        assert time.monotonic() - t0 < 25      # 3 s and the start of a loaded machine, not the hour
    finally:
        c.shutdown()


def test_sigkill_reaches_every_waiting_caller(vllm_config):
    c = start_client(vllm_config)
    try:
        c.add_request(request("inflight", PROMPTS[0], temperature=0.0, max_tokens=200, ignore_eos=True))
        c.get_output()
        pid = c.resources.engine_proc.pid
        # Freeze the engine so a utility call is surely pending, then kill it.
        os.kill(pid, signal.SIGSTOP)
        errors = []

        def pending_call():
            try:
                c.get_scheduler_stats()
            except Exception as e:
                errors.append(e)
        caller = threading.Thread(target=pending_call)
        caller.start()
        time.sleep(0.3)
        assert caller.is_alive()                 # it really waits on the engine
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        caller.join(5)
        assert not caller.is_alive()
        with pytest.raises(EngineDeadError, match="died unexpectedly"):
            while True:
                c.get_output()
        assert time.monotonic() - t0 < 5
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)
        with pytest.raises(EngineDeadError):
            c.add_request(request("later", PROMPTS[0], **GREEDY))
        with pytest.raises(EngineDeadError):
            c.reset_prefix_cache()
    finally:
        c.shutdown()
    assert not os.path.exists(c.resources.ipc_dir)
