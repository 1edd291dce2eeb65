"""The dashboard's shell, headless (AppTest) and without a model: runs opened by name
only (anything else refused with one message that says nothing about the file
system), run files read without changing them (a crashed run's -wal/-shm hashed
before and after), damaged rows reported per row, deep links (run, page, step, tab,
request), the run header against the run's meta, start-up stages, and the CLI
(run names, port, signals stop the Streamlit child)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.dashboard.conftest import APP, GPU_SAMPLE, ROOT

SAMPLE_NAME = "h100-smollm2-full.sqlite"
PAGES = ("inspector", "timeline", "journey", "metrics", "lessons")
needs_sample = pytest.mark.skipif(not os.path.exists(GPU_SAMPLE), reason="samples/h100-smollm2-full.sqlite not shipped")


def _copy(src: str, dst: str) -> str:
    s, d = sqlite3.connect(f"file:{src}?immutable=1", uri=True), sqlite3.connect(dst)
    try:
        s.backup(d)
    finally:
        s.close()
        d.close()
    return dst


def _hashes(path: str) -> dict[str, str | None]:
    out = {}
    for suffix in ("", "-wal", "-shm"):
        p = path + suffix
        out[suffix or "db"] = hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.exists(p) else None
    return out


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """A trace dir (with a lessons folder) and a samples dir holding a copy of the GPU sample."""
    trace, samples = tmp_path / "traces", tmp_path / "samples"
    (trace / "lessons").mkdir(parents=True)
    samples.mkdir()
    if os.path.exists(GPU_SAMPLE):
        _copy(GPU_SAMPLE, str(samples / SAMPLE_NAME))
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", str(trace))
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", str(samples))
    monkeypatch.delenv("VLLM_ANATOMY_LESSON_TRACE_DIR", raising=False)
    return {"trace": str(trace), "samples": str(samples), "lessons": str(trace / "lessons")}


def _app(**query):
    from streamlit.testing.v1 import AppTest
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({k: str(v) for k, v in query.items()})
    return at.run()


def _no_exception(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


# -- run names ----------------------------------------------------------------------------------
@needs_sample
def test_run_names_resolve_only_inside_the_run_dirs(dirs, tmp_path):
    from dashboard import data, state
    lesson_run = _copy(GPU_SAMPLE, os.path.join(dirs["lessons"], "run-lesson.sqlite"))
    outside = _copy(GPU_SAMPLE, str(tmp_path / "elsewhere.sqlite"))
    assert state.resolve_run(SAMPLE_NAME) == os.path.join(dirs["samples"], SAMPLE_NAME)
    assert state.resolve_run("run-lesson.sqlite") == lesson_run
    assert state.resolve_run(os.path.abspath(lesson_run)) == lesson_run       # a link printed by an older lesson
    refused = [outside, str(tmp_path / "missing.sqlite"), str(tmp_path), "/etc/passwd", "../samples/" + SAMPLE_NAME,
               "samples/" + SAMPLE_NAME, "..", ".hidden.sqlite", "x.db", "a\x00b.sqlite",
               os.path.join(dirs["samples"], "..", "elsewhere.sqlite")]
    answers = {r: state.resolve_run(r) for r in refused}
    assert all(isinstance(a, data.RunError) and a.message == state.REFUSED for a in answers.values()), answers
    missing = state.resolve_run("run-none.sqlite")
    assert isinstance(missing, data.RunError) and "no such run store file" in missing.message


@needs_sample
def test_a_refused_run_reveals_nothing(dirs, tmp_path):
    """Whether the named file exists, is a directory or a run store elsewhere: one message,
    the same on every page, no run opened, nothing of the path echoed."""
    from dashboard.state import REFUSED
    outside = _copy(GPU_SAMPLE, str(tmp_path / "secret-run.sqlite"))
    seen = set()
    for run in (outside, str(tmp_path / "nothing-here.sqlite"), str(tmp_path), "/etc/hostname"):
        for page in ("inspector", "live"):
            at = _app(run=run, page=page)
            _no_exception(at)
            errors = [e.value for e in at.error]
            assert errors == [REFUSED], (run, page, errors)
            assert at.session_state["run_path"] is None
            assert "secret" not in " ".join(m.value for m in at.markdown)
            seen.add(tuple(errors))
    assert len(seen) == 1


@needs_sample
def test_an_old_lesson_link_lands_and_the_url_names_the_run(dirs):
    run = _copy(GPU_SAMPLE, os.path.join(dirs["trace"], "run-20250101-000000-abc.sqlite"))
    at = _app(run=os.path.abspath(run), page="inspector", step=12)
    _no_exception(at)
    assert at.title[0].value == "Step inspector" and at.session_state["cursor"] == 12
    assert at.query_params["run"] in ("run-20250101-000000-abc.sqlite", ["run-20250101-000000-abc.sqlite"])


# -- deep links -----------------------------------------------------------------------------------
@needs_sample
def test_deep_link_carries_run_page_step_tab_and_request(dirs):
    at = _app(run=SAMPLE_NAME, page="inspector", step=15, tab="KV cache", request="7")
    _no_exception(at)
    assert at.title[0].value == "Step inspector"
    assert at.session_state["cursor"] == 15
    assert at.session_state["wanted"] == {"tab": "KV cache", "request": "7"}
    qp = {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}
    assert qp == {"run": SAMPLE_NAME, "page": "inspector", "step": "15", "tab": "KV cache", "request": "7"}
    # a step move keeps the tab and request; another page drops the tab, keeps the request
    at.session_state["cursor"] = 16
    at.run()
    assert at.query_params["step"] in ("16", ["16"]) and "tab" in at.query_params
    at.session_state["goto_page"] = "metrics"
    at.run()
    _no_exception(at)
    assert at.title[0].value == "Metrics over time" and "tab" not in at.query_params
    assert at.query_params["request"] in ("7", ["7"]) and at.query_params["step"] in ("16", ["16"])


def test_link_helper_builds_relative_deep_links():
    from streamlit.testing.v1 import AppTest

    def script():
        import streamlit as st

        from dashboard import state
        st.session_state.run_path = "/somewhere/run-x.sqlite"
        st.write(state.link("inspector", step=15, tab="KV cache", request=7))
        st.write(state.link("journey", request="3", run="other.sqlite"))
        st.write(state.link("metrics"))
    at = AppTest.from_function(script).run()
    assert [m.value for m in at.markdown] == [
        "inspector?run=run-x.sqlite&page=inspector&step=15&tab=KV+cache&request=7",
        "journey?run=other.sqlite&page=journey&request=3",
        "metrics?run=run-x.sqlite&page=metrics"]


@needs_sample
def test_old_links_with_run_page_step_still_land(dirs):
    for page, title in (("timeline", "Timeline"), ("journey", "Request journey"), ("metrics", "Metrics over time")):
        at = _app(run=SAMPLE_NAME, page=page, step=9)
        _no_exception(at)
        assert at.title[0].value == title and at.session_state["cursor"] == 9


# -- read-only, crashed runs, damaged rows ----------------------------------------------------
_CRASH = """
import os, signal, sqlite3, sys
from vllm_anatomy.tracing.store import _SCHEMA
src, dst = sys.argv[1], sys.argv[2]
conn = sqlite3.connect(dst, isolation_level=None)
conn.execute("PRAGMA journal_mode=WAL")
conn.execute("PRAGMA wal_autocheckpoint=0")     # everything stays in the -wal, as in a run cut short
for stmt in filter(str.strip, _SCHEMA.split(";")):
    conn.execute(stmt)
conn.execute(f"ATTACH DATABASE 'file:{src}?immutable=1' AS src")
conn.execute("BEGIN")
conn.execute("INSERT INTO meta SELECT * FROM src.meta WHERE key != 'end_time_ns'")
conn.execute("INSERT INTO spans SELECT * FROM src.spans")
conn.execute("INSERT INTO snapshots SELECT * FROM src.snapshots")
conn.execute("COMMIT")
os.kill(os.getpid(), signal.SIGKILL)
"""


def _sample_counts() -> tuple[int, int]:
    """(committed steps, span rows) of the shipped sample, read with plain SQL."""
    conn = sqlite3.connect(f"file:{GPU_SAMPLE}?immutable=1", uri=True)
    try:
        steps = conn.execute("SELECT count(DISTINCT step_id) FROM snapshots WHERE kind = 'step'").fetchone()[0]
        return steps, conn.execute("SELECT count(*) FROM spans").fetchone()[0]
    finally:
        conn.close()


def _crashed_run(dst: str) -> str:
    proc = subprocess.run([sys.executable, "-c", _CRASH, GPU_SAMPLE, dst], cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert os.path.getsize(dst + "-wal") > 100_000 and os.path.exists(dst + "-shm")
    return dst


@needs_sample
def test_reading_a_crashed_run_never_changes_its_files(dirs, tmp_path):
    from vllm_anatomy.tracing.reader import list_runs, open_run
    path = _crashed_run(os.path.join(dirs["trace"], "run-crashed.sqlite"))
    control = _crashed_run(str(tmp_path / "control.sqlite"))
    before = _hashes(path)
    with open_run(path) as run:
        steps = run.steps()
        assert len(steps) == _sample_counts()[0] and run.snapshot(steps[-1])["step_id"] == steps[-1]
        assert len(run.spans()) > 1000 and "end_time_ns" not in run.meta
    assert [r["path"] for r in list_runs(dirs["trace"])] == [path]
    for page in PAGES:
        at = _app(run="run-crashed.sqlite", page=page, step=40)
        _no_exception(at)
        assert not at.error, [e.value for e in at.error]
    assert _hashes(path) == before
    # the check can fail: an ordinary connection recovers the WAL and checkpoints it on close
    old = _hashes(control)
    conn = sqlite3.connect(control)
    conn.execute("SELECT count(*) FROM snapshots").fetchone()
    conn.close()
    assert _hashes(control) != old


@needs_sample
def test_a_finished_run_is_opened_immutable_and_a_lone_wal_from_a_copy(dirs, tmp_path):
    from vllm_anatomy.tracing.reader import open_run
    path = os.path.join(dirs["samples"], SAMPLE_NAME)
    before = _hashes(path)
    with open_run(path) as run:
        assert run.steps()
    assert _hashes(path) == before and before["-wal"] is None and before["-shm"] is None
    lone = _crashed_run(str(tmp_path / "lone.sqlite"))
    os.remove(lone + "-shm")                    # copied without its -shm: read from a private copy
    before = _hashes(lone)
    with open_run(lone) as run:
        assert len(run.steps()) == _sample_counts()[0]
    assert _hashes(lone) == before and not os.path.exists(lone + "-shm")


@needs_sample
def test_damaged_rows_are_reported_per_row(dirs):
    path = _copy(GPU_SAMPLE, os.path.join(dirs["trace"], "run-damaged.sqlite"))
    conn = sqlite3.connect(path)
    step_row = conn.execute("SELECT id FROM snapshots WHERE kind = 'step' AND step_id = 20").fetchone()[0]
    conn.execute("UPDATE snapshots SET data = '{\"scheduler\": [1, 2' WHERE id = ?", (step_row,))
    conn.execute("UPDATE snapshots SET data = 'not json' WHERE kind = 'model_runner' AND step_id = 21")
    conn.execute("UPDATE spans SET attributes = '{bad' WHERE rowid = (SELECT min(rowid) FROM spans "
                 "WHERE name = 'Scheduler.schedule')")
    conn.execute("UPDATE spans SET links = '\"a string\"' WHERE rowid = (SELECT min(rowid) FROM spans "
                 "WHERE name = 'EngineCore.step')")
    conn.commit()
    conn.close()
    at = _app(run="run-damaged.sqlite", page="inspector", step=20)
    _no_exception(at)
    errors = " ".join(e.value for e in at.error)
    assert "step 20" in errors and f"row id {step_row}" in errors and "malformed JSON" in errors
    for page, step in (("inspector", 21), ("timeline", 30), ("journey", 30), ("metrics", 30), ("lessons", 30)):
        at = _app(run="run-damaged.sqlite", page=page, step=step)
        _no_exception(at)
    at = _app(run="run-damaged.sqlite", page="metrics")
    listed = " ".join(e.label for e in at.expander)
    assert "damaged row" in listed, listed
    from vllm_anatomy.tracing.reader import open_run
    with open_run(path) as run:
        spans = run.spans()
        assert len(run.bad_rows) == 2 and all(b.table == "spans" for b in run.bad_rows)
        assert len(spans) == _sample_counts()[1] - 2


@needs_sample
def test_unreadable_spans_give_a_message_on_every_page(dirs):
    """A run store whose snapshots read but whose spans table does not (a damaged page of the
    file, here the table dropped): each page shows the loader's message, none a traceback.
    (The Processes and Self-test pages read spans through answers.RunSource, which raised.)"""
    path = _copy(GPU_SAMPLE, os.path.join(dirs["trace"], "run-nospans.sqlite"))
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE spans")
    conn.commit()
    conn.close()
    for page in PAGES + ("processes", "selftest"):
        at = _app(run="run-nospans.sqlite", page=page, step=8)
        _no_exception(at)
        if page in ("journey", "processes", "selftest"):
            errors = " ".join(e.value for e in at.error)
            assert "cannot read request spans" in errors and "no such table: spans" in errors, (page, errors)


TP_SAMPLE = os.path.join(ROOT, "samples", "cpu-smollm2-tp3-full.sqlite")


@pytest.mark.skipif(not os.path.exists(TP_SAMPLE), reason="samples/cpu-smollm2-tp3-full.sqlite not shipped")
def test_a_tensor_parallel_step_without_readable_spans_is_still_shown(dirs):
    """The inspector of a TP run reads its ranks' spans (answers.RunSource, which raised): with the
    spans table unreadable it says so and still shows the step, its tabs and its snapshots."""
    _copy(TP_SAMPLE, os.path.join(dirs["trace"], "run-tp-nospans.sqlite"))
    conn = sqlite3.connect(os.path.join(dirs["trace"], "run-tp-nospans.sqlite"))
    conn.execute("DROP TABLE spans")
    conn.commit()
    conn.close()
    at = _app(run="run-tp-nospans.sqlite", page="inspector", step=3)
    _no_exception(at)
    errors = " ".join(e.value for e in at.error)
    assert "cannot read request spans" in errors and "no such table: spans" in errors, errors
    assert at.title[0].value == "Step inspector" and len(at.tabs) >= 3


# -- the run header ---------------------------------------------------------------------------
@needs_sample
def test_run_header_shows_the_run_meta(dirs):
    from dashboard.components.run_header import NOT_RECORDED, header_fields
    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.tracing.factory import run_meta
    from vllm_anatomy.tracing.store import to_json
    config = EngineArgs(max_num_batched_tokens=96, max_num_seqs=6, block_size=32, trace_level="full"
                        ).create_engine_config()
    config.cache_config.num_gpu_blocks = 700
    meta = run_meta(config)
    path = _copy(GPU_SAMPLE, os.path.join(dirs["trace"], "run-meta.sqlite"))
    conn = sqlite3.connect(path)
    for k, v in meta.items():
        conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, to_json(v)))
    conn.commit()
    conn.close()
    from dashboard.components.kv_memory import mb
    want = {"run": "run-meta.sqlite", "model": "SmolLM2-135M-Instruct", "device": f"cpu · {meta['device_name']}",
            "dtype": str(config.model_config.dtype).replace("torch.", ""), "async scheduling": "off",
            "CUDA graphs": "NONE", "TP": "1", "block size": "32 tokens", "KV blocks": f"700 ({mb(700 * meta['kv_cache_bytes_per_block'])})",
            "token budget": "96 / step", "max_num_seqs": "6", "trace": "full"}
    assert {label: value for label, value, _ in header_fields(meta, "run-meta.sqlite")} == want
    for page in ("inspector", "live", "timeline"):
        at = _app(run="run-meta.sqlite", page=page, step=3)
        _no_exception(at)
        header = next(m.value for m in at.markdown if "va-run-header" in m.value)
        for label, value in want.items():
            assert f">{label}</span> <span class=\"v\">{value}</span>" in header, (page, label, value)
    # A run recorded before the header's fields existed: the sample's meta without them
    # (and a model path with no config.json to fall back on).
    old_meta = {k: v for k, v in _meta(GPU_SAMPLE).items() if k not in ("device_name", "kv_cache_bytes_per_block")}
    old_meta["model"] = "/nowhere/SmolLM2-135M-Instruct"
    old_meta["config"] = {**old_meta["config"], "scheduler_config": {
        k: v for k, v in old_meta["config"]["scheduler_config"].items() if k != "async_scheduling"}}
    old = {label: value for label, value, _ in header_fields(old_meta)}
    assert old["async scheduling"] is None and old["KV blocks"] == f"24 (MB {NOT_RECORDED})"
    from vllm_anatomy.tracing.reader import open_run
    with open_run(GPU_SAMPLE) as run:     # an older run: the block size from its worker snapshot
        mr = run.snapshot(run.steps()[0], "model_runner")
    kv = dict((label, value) for label, value, _ in header_fields(old_meta, None, mr))["KV blocks"]
    assert kv == "24 (8.44 MB)"            # 2 x 30 layers x 3 heads x 64 x 16 tokens x 2 bytes x 24
    assert old["CUDA graphs"] == "FULL_AND_PIECEWISE (sizes 1–64)" and old["token budget"] == "128 / step"


def _meta(path: str) -> dict:
    from vllm_anatomy.tracing.reader import open_run
    with open_run(path) as run:
        return run.meta


def test_run_meta_records_what_the_header_needs():
    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.tracing.factory import run_meta
    config = EngineArgs(block_size=16).create_engine_config()
    meta = run_meta(config)
    mc = config.model_config
    assert meta["kv_cache_bytes_per_block"] == (2 * mc.num_hidden_layers * 16 * mc.num_kv_heads * mc.head_dim
                                                * mc.dtype.itemsize)
    assert meta["device_name"] and "cores" in meta["device_name"]
    cfg = meta["config"]
    for section, key in (("scheduler_config", "async_scheduling"), ("compilation_config", "cudagraph_mode"),
                         ("cache_config", "block_size"),
                         ("scheduler_config", "max_num_batched_tokens"), ("scheduler_config", "max_num_seqs"),
                         ("model_config", "dtype")):
        assert key in cfg[section], (section, key)
    assert "tensor_parallel_size" in cfg["parallel_config"] or "world_size" in cfg["parallel_config"]


# -- start-up stages --------------------------------------------------------------------------
def test_startup_stages_follow_the_marks():
    from dashboard.live import STARTUP_STAGES, startup_stages
    s = 1_000_000_000
    names = [n for n, _, _ in STARTUP_STAGES]
    assert names == ["start process", "load model", "allocate KV cache", "warm up", "first step"]
    st = startup_stages(0, {}, 3 * s)
    assert [x["state"] for x in st] == ["running"] + ["waiting"] * 4 and st[0]["seconds"] == 3.0
    marks = {"store": 2 * s, "GPUModelRunner.load_model": 5 * s}
    st = startup_stages(0, marks, 6 * s)
    assert [x["state"] for x in st] == ["done", "done", "running", "waiting", "waiting"]
    assert [x["seconds"] for x in st[:3]] == [2.0, 3.0, 1.0]
    # a later mark closes the stages before it (a span the engine did not record)
    st = startup_stages(0, {"store": s, "first_step": 9 * s}, 10 * s)
    assert all(x["state"] == "done" for x in st) and sum(x["seconds"] for x in st) == 9.0


# -- the CLI ------------------------------------------------------------------------------------
def test_cli_passes_run_names_and_honours_the_port(monkeypatch, tmp_path, capsys):
    from vllm_anatomy.entrypoints.cli import dashboard
    from vllm_anatomy.entrypoints.cli.main import main
    trace = str(tmp_path)
    assert dashboard.run_param("run-x.sqlite", trace) == "run-x.sqlite"
    assert dashboard.run_param(os.path.join(trace, "run-x.sqlite"), trace) == "run-x.sqlite"
    assert dashboard.run_param(os.path.join(trace, "lessons", "run-l.sqlite"), trace) == "run-l.sqlite"
    with pytest.raises(ValueError, match="--trace-dir"):
        dashboard.run_param("/elsewhere/run-y.sqlite", trace)
    calls = []
    monkeypatch.setattr(dashboard, "serve", lambda cmd, env, cwd: calls.append((cmd, env)) or 0)
    monkeypatch.setenv("STREAMLIT_SERVER_PORT", "8642")
    assert main(["dashboard", "--trace-dir", trace]) == 0
    cmd, env = calls[-1]
    assert cmd[cmd.index("--server.port") + 1] == "8642" and env["VLLM_ANATOMY_TRACE_DIR"] == trace
    assert cmd[cmd.index("--client.toolbarMode") + 1] == "minimal"
    assert "http://127.0.0.1:8642/" in capsys.readouterr().out
    assert main(["dashboard", "--trace-dir", trace, "--port", "8700", "--run", os.path.join(trace, "run-x.sqlite"),
                 "--step", "4"]) == 0
    out = capsys.readouterr().out
    assert calls[-1][0][calls[-1][0].index("--server.port") + 1] == "8700"
    assert "http://127.0.0.1:8700/inspector?run=run-x.sqlite&page=inspector&step=4" in out
    # a run stored anywhere else, without --trace-dir: its folder becomes the trace dir
    other = tmp_path / "other"
    other.mkdir()
    assert main(["dashboard", "--run", str(other / "run-z.sqlite")]) == 0
    assert calls[-1][1]["VLLM_ANATOMY_TRACE_DIR"] == str(other) and "run=run-z.sqlite" in capsys.readouterr().out
    assert main(["dashboard", "--trace-dir", trace, "--run", str(other / "run-z.sqlite")]) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_returns_the_child_exit_code(tmp_path):
    """A Streamlit child that exits by itself, no signal to the CLI: serve() hands its code on,
    after waiting through at least one 0.2 s poll (the child lives 0.5 s)."""
    from vllm_anatomy.entrypoints.cli.dashboard import serve
    child = [sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(3)"]
    assert serve(child, dict(os.environ), str(tmp_path)) == 3


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_cli_stops_the_streamlit_child(tmp_path, sig):
    psutil = pytest.importorskip("psutil")
    port = _free_port()
    cli = subprocess.Popen([sys.executable, "-m", "vllm_anatomy.entrypoints.cli.main", "dashboard",
                            "--trace-dir", str(tmp_path), "--port", str(port)], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1).read() == b"ok":
                    break
            except OSError:
                assert time.monotonic() < deadline and cli.poll() is None, "the dashboard did not come up"
                time.sleep(0.5)
        children = psutil.Process(cli.pid).children(recursive=True)
        assert any("streamlit" in " ".join(c.cmdline()) for c in children)
        cli.send_signal(sig)
        assert cli.wait(30) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        for c in psutil.Process().children(recursive=True):     # only what this test started
            if c.pid != os.getpid() and "streamlit" in " ".join(c.cmdline()) and str(port) in c.cmdline():
                c.kill()


def test_make_run_passes_the_port(tmp_path):
    """`make run` leaves the port to the CLI (which reads STREAMLIT_SERVER_PORT) or to ARGS."""
    out = subprocess.run(["make", "-n", "-o", "setup", "run", "ARGS=--port 8777"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    line = [ln for ln in out.stdout.splitlines() if "vllm-anatomy dashboard" in ln][-1]
    assert line.endswith("dashboard --port 8777") and "8501" not in line
    assert shutil.which("make")


@pytest.mark.model
def test_the_faster_tokenizer_load_gives_the_same_tokenizer():
    """get_tokenizer skips AutoTokenizer's AutoConfig detour (a start-up cut): same class,
    same special tokens, same ids and chat template as AutoTokenizer."""
    from transformers import AutoTokenizer

    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
    default_model_dir = str(ensure_default_model())
    ours, auto = get_tokenizer(default_model_dir), AutoTokenizer.from_pretrained(default_model_dir,
                                                                                 local_files_only=True)
    assert type(ours) is type(auto) and ours.init_kwargs == auto.init_kwargs
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id
    for text in ("Hello world", "  spaces and\nnewlines\t", "中文 テキスト 😀", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == auto.encode(text)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a CPU?"}]
    assert ours.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False) == \
        auto.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)


# -- the pre-started engine process -------------------------------------------------------------
def _wait(pred, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.model
def test_a_prestarted_engine_process_takes_the_next_run(tmp_path):
    from dashboard import live
    from tests.dashboard.conftest import FIXTURE_SPEC
    live.prewarm(str(tmp_path))
    warm = live._warm
    try:
        assert _wait(lambda: json.load(open(warm["status_path"])).get("state") == "warm"), \
            open(warm["log_path"]).read()
        run = live.LiveRun.start({**FIXTURE_SPEC, "max_tokens": 2}, str(tmp_path))
        assert run.proc is warm["proc"] and live._warm is None
        assert _wait(lambda: run.status()["state"] in ("done", "error", "crashed")), run.log_tail()
        s = run.status()
        assert s["state"] == "done" and s["prestarted"] and s.get("step", 0) >= 1, s
        stages = run.startup(s)
        assert [x["state"] for x in stages][:1] == ["done"]
    finally:
        live._discard_warm()
        if "run" in locals():
            run.stop()


def test_a_prestarted_engine_process_leaves_with_its_dashboard(tmp_path):
    """The dashboard process dies without cleaning up: its waiting engine process exits."""
    psutil = pytest.importorskip("psutil")
    code = ("import os, sys, time; sys.path.insert(0, sys.argv[2]); from dashboard import live; "
            "live.prewarm(sys.argv[1]); print(live._warm['proc'].pid, flush=True); time.sleep(1); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), ROOT], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    pid = int(out.stdout.split()[0])
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return                     # already gone
    try:
        proc.wait(120)             # it notices once its imports are done (its parent changed)
    except psutil.TimeoutExpired:
        proc.kill()
        raise AssertionError("the pre-started engine process outlived its dashboard")
