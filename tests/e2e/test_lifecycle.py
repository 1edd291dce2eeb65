"""The server's process lifecycle, checked from outside: the process table (psutil),
/tmp and /dev/shm before and after.

  * a worker that dies while the engine is idle is noticed at once (/health 503),
    and the dead engine is reaped and its shared memory unlinked by the server;
  * SIGTERM drains for at most --shutdown-timeout s, then ends what is left with
    an error event, and exits 0; a second SIGTERM exits at once;
  * SIGKILL of the engine: the server exits (status 1, vLLM's watchdog);
    SIGKILL of the server: the orphaned engine exits and cleans up after it;
  * in every case: no socket directory, no segment, no process (zombie or not) left.

Each test has its own server (it ends it); every server listens on 127.0.0.1.
The run's files are found through the server itself: its bound socket
(`.../input.sock`) names the run's directory, and every segment of the run is
named after that directory, so other runs on the machine do not interfere.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from server_utils import RemoteOpenAIServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

MP = ("--distributed-executor-backend", "mp")
KEEP_ALIVE = {"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
LONG = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}


@dataclass
class RunResources:
    ipc_dir: str
    shm_prefix: str
    procs: list[psutil.Process] = field(default_factory=list)

    def shm_segments(self) -> list[str]:
        return [n for n in os.listdir("/dev/shm") if n.startswith(self.shm_prefix)]


def run_resources(server: RemoteOpenAIServer) -> RunResources:
    """The running server's socket directory, segment-name prefix and every descendant process."""
    proc = psutil.Process(server.proc.pid)
    # NOTE: the bound socket and the accepted connection both show the path.
    sockets = {c.laddr for c in proc.net_connections(kind="unix") if str(c.laddr).endswith("/input.sock")}
    assert len(sockets) == 1, sockets
    ipc_dir = os.path.dirname(sockets.pop())
    assert os.path.isdir(ipc_dir) and os.path.basename(ipc_dir).startswith("vllm_anatomy_")
    return RunResources(ipc_dir, f"vllm_anatomy_mq_{os.path.basename(ipc_dir)}_",
                        [proc, *proc.children(recursive=True)])


def assert_released(res: RunResources, timeout: float = 15.0) -> None:
    """Nothing of the run is left: its processes are gone (not zombies), its directory and segments too."""
    _, alive = psutil.wait_procs(res.procs, timeout=timeout)
    left = [(p.pid, _status(p), " ".join(_cmdline(p))[-80:]) for p in alive]
    assert not left, f"processes left behind: {left}"
    assert not os.path.exists(res.ipc_dir), f"socket directory left behind: {os.listdir(res.ipc_dir)}"
    assert res.shm_segments() == []


def _status(p: psutil.Process) -> str:
    try:
        return p.status()
    except psutil.NoSuchProcess:
        return "gone"


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def health(server: RemoteOpenAIServer) -> int | None:
    """/health's status code, or None if nothing listens any more."""
    try:
        return httpx.get(f"{server.url}/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def seconds_until(predicate, timeout: float, interval: float = 0.02) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(interval)
    return time.monotonic() - t0


class Stream(threading.Thread):
    """A streamed completion read in the background; lines and when the stream ended."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.lines: list[str] = []
        self.first_token = threading.Event()
        self.ended_at: float | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first_token.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.first_token.set()

    def wait_started(self) -> None:
        assert self.first_token.wait(60) and self.lines, f"no token: {self.error!r}"


def engine_and_workers(server: RemoteOpenAIServer) -> tuple[psutil.Process, list[psutil.Process]]:
    engine = server.engine_core_process()
    return engine, engine.children()


def test_worker_death_while_idle_is_noticed_at_once():
    with RemoteOpenAIServer("--max-model-len", "256", *MP, env=KEEP_ALIVE) as server:
        res = run_resources(server)
        assert len(res.shm_segments()) == 2, "the run's segments are named after its directory"
        engine, workers = engine_and_workers(server)
        assert len(workers) == 1
        assert health(server) == 200
        workers[0].kill()
        t0 = time.monotonic()
        latency = seconds_until(lambda: health(server) == 503, timeout=10)
        print(f"\nworker SIGKILLed while idle: /health 503 after {latency * 1000:.0f} ms")
        assert latency < 3
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        # The engine exits; the server reaps it (no zombie) and its segments are gone.
        _, alive = psutil.wait_procs([engine], timeout=10)
        assert not alive, f"engine left as {_status(engine)}"
        seconds_until(lambda: res.shm_segments() == [], timeout=10)
        print(f"engine exited and reaped, segments unlinked {time.monotonic() - t0:.2f} s after the kill")
        assert server.proc.poll() is None and os.path.isdir(res.ipc_dir)   # kept alive, answering 503
        assert health(server) == 503
    assert server.proc.returncode == 1      # stopped (SIGTERM) with its engine dead
    assert_released(res)


def test_sigterm_drains_then_ends_what_is_left_with_an_error_event():
    timeout = 4
    with RemoteOpenAIServer("--max-model-len", "512", "--shutdown-timeout", str(timeout)) as server:
        res = run_resources(server)
        long = Stream(server.url, LONG)
        short = Stream(server.url, {"prompt": "Hi", "max_tokens": 6, "ignore_eos": True, "stream": True})
        long.wait_started()
        short.wait_started()
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert seconds_until(lambda: health(server) == 503, timeout=3) < 3
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        server.proc.wait(timeout=timeout + 30)
        exited = time.monotonic() - t0
        long.join(5)
        short.join(5)
        print(f"\nSIGTERM with --shutdown-timeout {timeout}: long stream ended after "
              f"{long.ended_at - t0:.2f} s, server exited after {exited:.2f} s")
        # The short request finished within the drain, normally.
        assert short.lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in short.lines[-2]
        # The long one was still running at the deadline: an error event, then [DONE].
        assert long.lines[-1] == "data: [DONE]" and '"error"' in long.lines[-2], long.lines[-2:]
        assert "shutdown-timeout" in long.lines[-2]
        assert timeout - 0.5 < long.ended_at - t0 < timeout + 5
        assert exited < timeout + 15
    assert server.proc.returncode == 0
    assert_released(res)


def test_second_sigterm_exits_at_once():
    with RemoteOpenAIServer("--max-model-len", "512", "--shutdown-timeout", "120", *MP) as server:
        res = run_resources(server)
        assert len(res.shm_segments()) == 2
        long = Stream(server.url, LONG)
        long.wait_started()
        server.proc.send_signal(signal.SIGTERM)
        assert seconds_until(lambda: health(server) == 503, timeout=3) < 3
        assert server.proc.poll() is None and long.ended_at is None   # draining
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=30)
        exited = time.monotonic() - t0
        long.join(5)
        print(f"\nsecond SIGTERM: server exited after {exited:.2f} s (--shutdown-timeout 120)")
        assert exited < 10          # far below the 120 s drain; teardown is slow here
        assert long.ended_at is not None
    assert server.proc.returncode == 0
    assert_released(res)


def test_engine_sigkill_stops_the_server_and_leaves_nothing():
    with RemoteOpenAIServer("--max-model-len", "256", *MP) as server:
        res = run_resources(server)
        assert len(res.shm_segments()) == 2
        engine, workers = engine_and_workers(server)
        engine.kill()
        t0 = time.monotonic()
        assert seconds_until(lambda: health(server) in (503, None), timeout=3) < 3
        # The killed engine could not unlink its 10 MB broadcast segment: the server
        # does, on its death (not at its own exit, as the resource tracker would).
        seconds_until(lambda: res.shm_segments() == [], timeout=5)
        assert server.proc.poll() is None, "segments were only removed at the server's exit"
        assert server.proc.wait(timeout=30) == 1           # vLLM's watchdog: the server exits
        print(f"\nengine SIGKILLed: server exited (status 1) after {time.monotonic() - t0:.2f} s")
    assert_released(res)


def test_server_sigkill_orphaned_engine_cleans_up():
    with RemoteOpenAIServer("--max-model-len", "256") as server:
        res = run_resources(server)
        server.proc.kill()
        server.proc.wait(timeout=10)
        t0 = time.monotonic()
        assert_released(res)
        print(f"\nserver SIGKILLed: its engine and directory gone after {time.monotonic() - t0:.2f} s")
