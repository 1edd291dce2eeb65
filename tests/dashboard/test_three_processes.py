"""A three-process live run (issue 16, item 2) started by the dashboard's own launcher
(dashboard/live.py: LiveRun.start with processes=3, as the start form's "three processes"
does): the API server in the engine child, EngineCoreProc and the worker in processes of
their own, all writing one run store. Read back: spans from the three pids, a request's
trace crossing ZMQ (frontend → EngineCoreProc), its first step's trace crossing the
shared-memory ring (EngineCoreProc → worker), the ZMQ message sizes agreeing on both
sides; then the Processes page (AppTest) draws those lanes and hops, and the Self-test
page answers all five questions from the same run."""
from __future__ import annotations

import os
import time

import pytest

from tests.dashboard.conftest import APP, FIXTURE_SPEC

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_run(tmp_path_factory):
    from dashboard.live import LiveRun
    trace_dir = str(tmp_path_factory.mktemp("three_proc"))
    live = LiveRun.start({**FIXTURE_SPEC, "processes": 3}, trace_dir)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            st = live.status()
            if st["state"] in ("done", "error", "crashed", "stopped"):
                break
            time.sleep(0.5)
        assert st["state"] == "done", (st.get("state"), st.get("error"), live.log_tail())
    finally:
        live.stop()
    assert len(st["outputs"]) == len(FIXTURE_SPEC["prompts"]) and all(st["outputs"].values())
    return trace_dir, st["run_path"]


def test_three_pids_one_run_store(three_run):
    from vllm_anatomy.tracing.reader import open_run
    _, path = three_run
    with open_run(path) as run:
        spans = run.spans()
        reqs = run.requests()
        steps = run.spans("EngineCore.step")
    kinds = {}
    for s in spans:
        kinds.setdefault(s.process_kind, set()).add(s.pid)
    assert set(kinds) == {"frontend", "engine_core", "worker"}, kinds
    assert all(len(p) == 1 for p in kinds.values()) and len(set.union(*kinds.values())) == 3
    pid = {k: next(iter(v)) for k, v in kinds.items()}
    # The HTTP request went through the API server: one POST span per request, in the frontend.
    assert len([s for s in spans if s.name == "POST /v1/chat/completions"]) == len(FIXTURE_SPEC["prompts"])
    for req in reqs:
        trace = [s for s in spans if s.trace_id == req.trace_id]
        # ③ a request's own trace crosses ZMQ: frontend spans and EngineCore.add_request in EngineCoreProc
        assert {s.pid for s in trace} == {pid["frontend"], pid["engine_core"]}, req.request_id
        add = next(s for s in trace if s.name == "EngineCore.add_request")
        assert add.pid == pid["engine_core"]
        send = next(s for s in spans if s.name == "MPClient._send_input"
                    and s.attributes.get("vllm_anatomy.request_id") == req.request_id)
        recv = next(s for s in spans if s.name == "EngineCoreProc.process_input_sockets"
                    and s.attributes.get("vllm_anatomy.request_id") == req.request_id)
        assert send.pid == pid["frontend"] and recv.pid == pid["engine_core"]
        assert recv.attributes["vllm_anatomy.thread"] == "input"
        assert send.attributes["vllm_anatomy.message_bytes"] == recv.attributes["vllm_anatomy.message_bytes"] > 0
        # ⑤ the first step that served it crosses the shared-memory ring: its tree has the worker's spans
        first = min((s for s in steps if any(lk["span_id"] == req.span_id for lk in s.links)),
                    key=lambda s: s.step_id)
        step_trace = [s for s in spans if s.trace_id == first.trace_id]
        # (and its outputs' way to the frontend, when it had outputs: issue 30)
        assert {pid["engine_core"], pid["worker"]} <= {s.pid for s in step_trace} <= set(pid.values())
        assert any(s.name == "Worker.execute_model" and s.pid == pid["worker"] for s in step_trace)
    # ⑪ every output message is sent by the output thread and received by the frontend, same sizes
    sent = sorted(s.attributes["vllm_anatomy.message_bytes"] for s in spans if s.name == "EngineCoreProc.process_output_sockets"
                  and s.attributes.get("vllm_anatomy.message_type") == "OUTPUTS")
    got = sorted(s.attributes["vllm_anatomy.message_bytes"] for s in spans if s.name == "MPClient._decode_output")
    assert sent and sent == got


def test_processes_page_draws_three_processes(three_run):
    from streamlit.testing.v1 import AppTest

    from dashboard.answers.source import RunSource
    from dashboard.processes import step_view
    trace_dir, path = three_run
    os.environ["VLLM_ANATOMY_TRACE_DIR"] = trace_dir
    src = RunSource(path)
    first = min(s for s in src.steps if (src.snap(s) or {}).get("scheduler_output", {}).get("scheduled_new_reqs"))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"run": os.path.basename(path), "page": "processes", "step": str(first)})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Processes" and not [i for i in at.info if "One process" in i.value]
    hops, chain = at.table[0].value, at.table[1].value          # (st.table: whole cells, every row)
    assert {"ZMQ + msgspec", "shared-memory ring (rpc_broadcast_mq)", "shared-memory ring (worker_response_mq)"} \
        <= set(hops["boundary"])
    assert any("EngineCoreProc" in x for x in hops["to"]) and any("WorkerProc" in x for x in hops["to"])
    # the ZMQ request hop's size is the recorded message size
    view = step_view(src, first)
    zmq_in = [h for h in view["hops"] if h.marker == "③" and "ZMQ" in h.boundary]
    assert zmq_in and all(f"{h.nbytes:,} B" in " ".join(hops["size"]) for h in zmq_in)
    rows = dict(zip(chain.index, chain["this run's spans"]))
    assert "POST /v1/chat/completions" in rows["①"] and "MPClient._send_input" in rows["③"]
    assert "Worker.execute_model" in rows["⑤"] and "MPClient._decode_output" in rows["⑪"]
    lanes = [label for _, label in view["layout"]["lanes"]]
    for want in ("API server", "input thread", "run_busy_loop()", "output thread", "worker_busy_loop()"):
        assert any(want in x for x in lanes), (want, lanes)


def test_selftest_answers_the_three_process_run(three_run):
    from streamlit.testing.v1 import AppTest
    trace_dir, path = three_run
    os.environ["VLLM_ANATOMY_TRACE_DIR"] = trace_dir
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"run": os.path.basename(path), "page": "selftest"})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    answers = [m.value for m in at.markdown if m.value.startswith("**Answer, from this run (")]
    assert len(answers) >= 4          # a tiny run may lack a decode over two blocks (Q3 then says why)
    md = "\n".join(m.value for m in at.markdown)
    assert "ZMQ messages" in md and "shared-memory messages" in md


def test_start_form_asks_for_three_processes(monkeypatch, tmp_path):
    """The start form's "three processes" choice reaches the launcher as processes=3."""
    from streamlit.testing.v1 import AppTest

    import dashboard.live as live
    started = []

    def fake_start(cls, spec, trace_dir):
        started.append(spec)
        raise RuntimeError("not started in this test")
    monkeypatch.setattr(live.LiveRun, "start", classmethod(fake_start))
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_ANATOMY_PREWARM", "0")
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.radio(key="lf_processes").set_value(3)
    next(b for b in at.button if "Start live run" in b.label).click().run()
    assert started and started[0]["processes"] == 3 and started[0]["prompts"]


def test_the_run_meta_knows_the_engine_process_kv_cache(three_run):
    """The engine process sizes the KV cache; the frontend's config (and the run header) learns
    num_gpu_blocks from the engine's ready message, as vLLM's frontend does."""
    from dashboard.components.run_header import header_fields
    from tests.dashboard.conftest import FIXTURE_SPEC
    from vllm_anatomy.tracing.reader import open_run
    _, path = three_run
    with open_run(path) as run:
        meta = run.meta
    assert meta["config"]["cache_config"]["num_gpu_blocks"] == FIXTURE_SPEC["engine_args"]["num_gpu_blocks_override"]
    kv = dict((label, value) for label, value, _ in header_fields(meta))["KV blocks"]
    assert kv.startswith(f"{FIXTURE_SPEC['engine_args']['num_gpu_blocks_override']} (") and "MB" in kv \
        and "not recorded" not in kv
