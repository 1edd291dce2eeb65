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
    assert any("live engine failed" in e.value and "max_num_batched_tokens" in e.value for e in at.error)
    assert not at.code and not any("Traceback" in e.value for e in at.error)     # one message, no traceback
    assert "Traceback" in live.log_tail(20_000)                                   # the log keeps it


def test_a_spec_the_api_server_would_refuse_is_refused_before_it_starts(tmp_path, monkeypatch):
    """A prompt whose tokens + max_tokens exceed max_model_len: the API server answers 400 (as vLLM's
    does), so neither mode starts it; the page says which prompt and what to change, in one sentence."""
    from dashboard.live import LiveRun
    spec = {**FIXTURE_SPEC, "max_tokens": 60, "processes": 3}
    live = LiveRun.start(spec, str(tmp_path))
    s = _wait_state(live, ("error", "crashed", "done"))
    assert s["state"] == "error" and s["error"].startswith("Not started: prompt 1 ("), s
    assert "max_model_len 80" in s["error"] and "Traceback" not in s["error"] and "\n" not in s["error"]
    assert not s.get("run_path")          # nothing was started: no run store
    at = _live_page(live, str(tmp_path), monkeypatch)
    assert not at.exception and any("Raise max_model_len or lower max_tokens" in e.value for e in at.error)


def test_every_scenario_fits_its_max_model_len(default_model_dir):
    """Every shipped scenario runs the same in one process and in three (check_prompts passes)."""
    from dashboard.live_engine import SpecRefused, check_prompts
    from dashboard.scenarios import PAIR_WORKLOAD, SCENARIOS, build_spec
    from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
    tok = get_tokenizer(default_model_dir)
    for name, sc in {**SCENARIOS, "pair": PAIR_WORKLOAD}.items():
        spec = build_spec(name, sc["prompts"], sc["engine_args"], sc["max_tokens"], sc["ignore_eos"])
        check_prompts(tok, spec, sc["engine_args"].get("max_model_len", 8192))
    with pytest.raises(SpecRefused, match=r"prompt 5 .* > max_model_len 112"):    # the tour as it crashed
        sc = SCENARIOS["tour"]
        check_prompts(tok, build_spec("tour", sc["prompts"], sc["engine_args"], sc["max_tokens"], True), 112)


def test_a_refused_request_is_named_and_the_others_run_on():
    """What the three-process driver does with a 400: the server's own message is kept for that request,
    nothing is raised (the other requests' tasks go on)."""
    import asyncio

    import httpx

    from dashboard.live_engine import _send_chat

    def answer(request):
        if b"too long" in request.content:
            return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 112 "
                                                                  "tokens.", "type": "BadRequestError"}})
        return httpx.Response(200, json={"choices": [{"message": {"content": "fine"}}]})

    async def go():
        outputs, refused = {}, {}
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://x") as client:
            spec = {"max_tokens": 4, "ignore_eos": False}
            await asyncio.gather(_send_chat(client, spec, 0, {"text": "too long"}, outputs, refused),
                                 _send_chat(client, spec, 1, {"text": "short"}, outputs, refused))
        return outputs, refused
    outputs, refused = asyncio.run(go())
    assert outputs == {"1": "fine"}
    assert refused == {"0": "400 Bad Request: This model's maximum context length is 112 tokens."}


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
