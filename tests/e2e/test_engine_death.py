"""When the EngineCore process dies, the server says so (503) and no request hangs.

Its own server: this module kills the engine. The engine's pid is found as the
server process' `spawn_main` child (psutil), see server_utils.engine_core_process.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from server_utils import RemoteOpenAIServer

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_engine_killed_gives_503_and_no_hang():
    # NOTE: by default the server exits when its engine dies (as vLLM's);
    # kept up here to check what it answers meanwhile (test_lifecycle checks the exit).
    with RemoteOpenAIServer("--max-model-len", "256", env={"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}) as server:
        url = server.url
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
        engine = server.engine_core_process()
        # One request in flight while the engine dies: it must end, not hang.
        in_flight: dict = {}

        def long_request():
            body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                in_flight["lines"] = list(r.iter_lines())

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.5)
        engine.kill()
        t.join(timeout=15)
        assert not t.is_alive(), "a streaming request hung after the engine died"
        lines = [line for line in in_flight["lines"] if line]
        assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]

        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health did not report the dead engine"
            time.sleep(0.2)
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and time.monotonic() - t0 < 5
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "stream": True}, timeout=10)
        assert r.status_code == 503
