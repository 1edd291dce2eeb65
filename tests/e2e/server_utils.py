"""Start and stop a real `vllm-anatomy serve` subprocess for e2e tests.

RemoteOpenAIServer mirrors vLLM's tests/utils.py helper of that name: a free
port, the server as a child process (OMP_NUM_THREADS=1: the test machines have
2 cores), wait for /health, and on exit stop it *and* its EngineCore child.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The `vllm-anatomy` entry point, run with this interpreter (`-m ...cli.main` warns: the
# package imports main first).
_SERVE = "import sys; from vllm_anatomy.entrypoints.cli.main import main; sys.exit(main(sys.argv[1:]))"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """{'vllm:num_requests_running': 0.0, 'vllm:request_success_total{finished_reason="stop"}': 3.0, ...}

    Labels other than finished_reason are dropped (model_name, engine are constant).
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        reason = re.search(r'finished_reason="([^"]*)"', name_labels)
        le = re.search(r'le="([^"]*)"', name_labels)
        key = name + (f'{{finished_reason="{reason.group(1)}"}}' if reason else "") + (
            f'{{le="{le.group(1)}"}}' if le else "")
        out[key] = float(value)
    return out


def wait_idle(server: "RemoteOpenAIServer", timeout: float = 10.0) -> dict[str, float]:
    """/metrics once the engine reports no running and no waiting request (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


class RemoteOpenAIServer:

    def __init__(self, *serve_args: str, api_key: str | None = None, startup_timeout: float = 240,
                 env: dict[str, str] | None = None, log_path: str | None = None,
                 preexec_fn=None) -> None:
        """log_path: the server's stdout and stderr go to this file (else to the test's);
        preexec_fn: run in the child before the server starts (e.g. to lower a limit)."""
        self.port = free_port()
        self.api_key = api_key
        cmd = [sys.executable, "-c", _SERVE, "serve", "--port", str(self.port),
               *serve_args, *(["--api-key", api_key] if api_key else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self._log = open(log_path, "wb") if log_path else None
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=self._log,
                                     preexec_fn=preexec_fn)
        self._wait_healthy(startup_timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} during start-up")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout:.0f} s")

    def engine_core_process(self) -> psutil.Process:
        """The EngineCore child: started with multiprocessing "spawn", so its
        command line runs `spawn_main` (the other child, if any, is the
        multiprocessing resource tracker)."""
        for child in psutil.Process(self.proc.pid).children(recursive=False):
            if "spawn_main" in " ".join(child.cmdline()):
                return child
        raise LookupError("no EngineCore child process found")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def stop(self) -> None:
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # NOTE: the server shuts its engine down; anything still alive (a hung
        # engine, the resource tracker) is ended here so no test leaks a process.
        for child in children:
            try:
                child.wait(timeout=10)
            except psutil.TimeoutExpired:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> "RemoteOpenAIServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
