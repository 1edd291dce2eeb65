"""The live engine process: a failing or killed engine is reported in the page
(never a traceback), and the CLI prints the dashboard's URL."""
import os
import time

import pytest

from tests.dashboard.conftest import APP, FIXTURE_SPEC

pytestmark = pytest.mark.model


def _wait_state(live, states, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = live.status()
        if s["state"] in states:
            return s
        time.sleep(0.3)
    raise AssertionError(f"engine stayed {live.status()['state']}; log:\n{live.log_tail()}")


def _live_page(live, trace_dir, monkeypatch):
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", trace_dir)
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["live"] = live
    return at.run()


def test_engine_error_is_shown(tmp_path, monkeypatch):
    from dashboard.live import LiveRun
    spec = {**FIXTURE_SPEC, "engine_args": {"max_num_batched_tokens": -1}}
    live = LiveRun.start(spec, str(tmp_path))
    s = _wait_state(live, ("error", "crashed"))
    assert s["state"] == "error" and "max_num_batched_tokens" in s["error"]
    at = _live_page(live, str(tmp_path), monkeypatch)
    assert not at.exception
    assert any("live engine failed" in e.value for e in at.error)
    assert any("max_num_batched_tokens" in c.value for c in at.code)


def test_killed_engine_is_reported_as_crashed(tmp_path, monkeypatch):
    from dashboard.live import LiveRun
    live = LiveRun.start(FIXTURE_SPEC, str(tmp_path))
    _wait_state(live, ("loading", "running"))
    live.proc.kill()            # the child we started, by its Popen handle
    live.proc.wait()
    s = live.status()
    assert s["state"] == "crashed" and f"exited with code {live.proc.returncode}" in s["error"]
    at = _live_page(live, str(tmp_path), monkeypatch)
    assert not at.exception and any("live engine failed" in e.value for e in at.error)


def test_cli_dashboard(monkeypatch, capsys, tmp_path):
    from vllm_anatomy.entrypoints.cli import dashboard
    from vllm_anatomy.entrypoints.cli.main import main
    assert os.path.samefile(dashboard.dashboard_app(), APP)
    assert dashboard.url_for("127.0.0.1", 8501, "run-x.sqlite", 3, "inspector") == \
        "http://127.0.0.1:8501/inspector?run=run-x.sqlite&page=inspector&step=3"
    calls = []
    monkeypatch.setattr(dashboard, "serve", lambda cmd, env, cwd: calls.append((cmd, env)) or 0)
    assert main(["dashboard", "--trace-dir", str(tmp_path), "--port", "8999"]) == 0
    cmd, env = calls[0]
    assert cmd[1:4] == ["-m", "streamlit", "run"] and "--server.headless" in cmd and "8999" in cmd
    assert env["VLLM_ANATOMY_TRACE_DIR"] == str(tmp_path)
    assert "http://127.0.0.1:8999/" in capsys.readouterr().out
