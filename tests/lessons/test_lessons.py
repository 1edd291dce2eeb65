"""Every lesson is also a test: run each lessons/NN_*.py in its own process.

A lesson passes when it exits 0 (its check(...) calls raise on a false fact),
printed its checks, and ended with a dashboard link to a run it recorded in the
trace dir we gave it, asking for a step, tab and request that exist in that run (lesson
2: the preempted request at its preemption step, on the port of the running dashboard).
Also: the `vllm-anatomy lesson` command, on a fake lessons folder (no model needed).
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LESSONS = sorted(glob.glob(os.path.join(ROOT, "lessons", "[0-9][0-9]_*.py")))
# Per lesson, wall clock. Lessons aim for well under a minute on 2 CPU cores; the
# limit leaves room for a machine shared with other work.
TIME_LIMIT_S = int(os.environ.get("VLLM_ANATOMY_LESSON_TIMEOUT_S", "300"))
CHECK_MARK = "\u2713"
PAGES = ("timeline", "inspector", "journey", "metrics", "lessons", "processes", "selftest")
URL = re.compile(r"\?(\S*\brun=[^&\s]+\S*)")
CLI = [sys.executable, "-m", "vllm_anatomy.entrypoints.cli.main"]


def test_lessons_are_found():
    numbers = [os.path.basename(p)[:2] for p in LESSONS]
    assert numbers and len(numbers) == len(set(numbers)), f"lesson numbers must be unique: {LESSONS}"


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("lesson", LESSONS, ids=[os.path.basename(p) for p in LESSONS])
def test_lesson_runs_and_checks_its_facts(lesson, tmp_path, default_model_dir):
    env = dict(os.environ, VLLM_ANATOMY_LESSON_TRACE_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, lesson], cwd=str(tmp_path), env=env, capture_output=True,
                              text=True, timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{os.path.basename(lesson)} ran past {TIME_LIMIT_S} s; its output so far:\n{out[-4000:]}")
    tail = f"\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"exit code {proc.returncode}{tail}"
    checks = [line for line in proc.stdout.splitlines() if line.lstrip().startswith(CHECK_MARK)]
    assert checks, f"the lesson printed no checked facts{tail}"
    query = _deep_link(proc.stdout, tail)
    assert query.get("page") in PAGES, f"dashboard link without a known page: {query}"
    run_path = os.path.join(str(tmp_path), query["run"])
    assert os.path.sep not in query["run"] and os.path.isfile(run_path), \
        f"the linked run {query['run']} is not a run store in VLLM_ANATOMY_LESSON_TRACE_DIR={tmp_path}{tail}"
    _check_landing(run_path, query)


def _deep_link(stdout: str, tail: str) -> dict[str, str]:
    """The query of the link printed under "See it in the dashboard:"."""
    lines = stdout.splitlines()
    at = [i for i, line in enumerate(lines) if line.strip() == "See it in the dashboard:"]
    assert at, f"the lesson printed no dashboard link{tail}"
    urls = URL.findall(lines[at[-1] + 1])
    assert urls, f"no link under 'See it in the dashboard:'{tail}"
    return {k: v[0] for k, v in urllib.parse.parse_qs(urls[0]).items()}


def _check_landing(run_path: str, query: dict[str, str]) -> None:
    """What the link asks for exists in the run: the step is committed, the tab is one of the
    inspector's, and the request takes part in that step (scheduled, preempted or queued)."""
    from dashboard.components.tabs import TABS
    from vllm_anatomy.tracing.reader import open_run
    with open_run(run_path) as run:
        # The lessons point a learner at the torch reference backend: on a CPU they run it.
        from vllm_anatomy.engine.arg_utils import teaching_attention_backend
        if teaching_attention_backend() == "torch":
            assert run.meta["config"]["model_config"]["attention_backend"] == "torch", run.meta["config"]
        steps = run.steps()
        step = int(query["step"]) if "step" in query else None
        if step is not None:
            assert step in steps, f"step {step} is not a committed step of the run"
        if "tab" in query:
            assert query["page"] == "inspector" and query["tab"] in TABS.values(), query
        if "request" in query:
            assert query["request"] in {s.request_id for s in run.requests()}, query
            if step is not None:
                snap = run.snapshot(step)
                assert snap is not None, f"step {step} has no snapshot"
                rec, sched = snap["scheduler"]["step_record"], snap["scheduler"]
                there = ({x["request_id"] for x in rec["scheduled"]} | set(rec["preempted_req_ids"])
                         | {r["request_id"] for r in sched["waiting"] + sched["running"]})
                assert query["request"] in there, f"request {query['request']} is not in step {step}"


@pytest.mark.model
@pytest.mark.slow
def test_lesson_2_links_the_preempted_request_at_its_preemption(tmp_path, default_model_dir):
    """The link lesson 2 prints opens the journey on the request it preempted, at that step."""
    lesson = os.path.join(ROOT, "lessons", "02_state_machine.py")
    env = dict(os.environ, VLLM_ANATOMY_LESSON_TRACE_DIR=str(tmp_path), PYTHONUNBUFFERED="1",
               STREAMLIT_SERVER_PORT="8765")
    env.pop("VLLM_ANATOMY_DASHBOARD_URL", None)
    proc = subprocess.run([sys.executable, lesson], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=TIME_LIMIT_S)
    tail = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, tail
    lines = proc.stdout.splitlines()
    link = lines[lines.index("See it in the dashboard:") + 1].strip()
    assert link.startswith("http://127.0.0.1:8765/journey?"), link       # the port of the running dashboard
    query = {k: v[0] for k, v in urllib.parse.parse_qs(link.split("?", 1)[1]).items()}
    from vllm_anatomy.tracing.reader import open_run
    with open_run(os.path.join(str(tmp_path), query["run"])) as run:
        first = next(s for s in run.steps() if run.snapshot(s)["scheduler"]["step_record"]["preempted_req_ids"])
        victim = run.snapshot(first)["scheduler"]["step_record"]["preempted_req_ids"][0]
    assert (query["page"], query["step"], query["request"]) == ("journey", str(first), victim)
    assert "The dashboard's lesson cards on the same idea" in proc.stdout
    assert "Preemption: RUNNING → PREEMPTED → WAITING" in proc.stdout


@pytest.mark.model
@pytest.mark.slow
def test_lesson_5_reports_a_missing_condense_as_a_false_fact(tmp_path, default_model_dir):
    """A run in which no step condensed the batch (here: lesson 5's own run, read back with every
    condense move hidden) fails the lesson's condense check, which says so, instead of crashing
    on the names only a condensing step sets (src, dst, moved: UnboundLocalError) or on a None
    request id used as a row key."""
    lesson = os.path.join(ROOT, "lessons", "05_prepare_inputs.py")
    script = "\n".join([
        "import runpy, sys",
        "from vllm_anatomy.tracing.reader import Run",
        "read = Run.snapshot",
        "def without_condense(self, step_id, kind='step'):",
        "    snap = read(self, step_id, kind)",
        "    if kind == 'model_runner' and snap is not None:",
        "        snap['input_batch']['condense_moves'] = []",
        "    return snap",
        "Run.snapshot = without_condense",
        f"sys.argv = [{lesson!r}]",
        f"runpy.run_path({lesson!r}, run_name='__main__')"])
    env = dict(os.environ, VLLM_ANATOMY_LESSON_TRACE_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=TIME_LIMIT_S)
    tail = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 1, tail
    assert proc.stderr.rstrip().splitlines()[-1] == ("AssertionError: lesson fact does not hold: condense() moved a "
                                                     "row into r1's hole (no step recorded a condense move)"), tail
    assert CHECK_MARK in proc.stdout, tail          # the checks before it held


def test_links_follow_the_running_dashboard(monkeypatch, capsys, tmp_path):
    """The link's port is $STREAMLIT_SERVER_PORT (what `make run` serves on), else 8501; the start
    command names the trace directory that lists the run; the lesson's cards are named."""
    sys.path.insert(0, os.path.join(ROOT, "lessons"))
    try:
        import _common
    finally:
        sys.path.remove(os.path.join(ROOT, "lessons"))
    run = tmp_path / "traces" / "lessons" / "run-x.sqlite"
    monkeypatch.delenv("VLLM_ANATOMY_DASHBOARD_URL", raising=False)
    monkeypatch.setattr(sys, "argv", ["04_prefix_caching.py"])
    monkeypatch.setenv("STREAMLIT_SERVER_PORT", str(_free_port()))      # nothing answers there
    url = _common.dashboard_link(str(run), "inspector", 7, tab="kv", request="P2")
    out = capsys.readouterr().out
    port = os.environ["STREAMLIT_SERVER_PORT"]
    assert url == (f"http://127.0.0.1:{port}/inspector?run=run-x.sqlite&page=inspector&step=7"
                   f"&tab=KV+cache&request=P2") and url in out
    assert f"no dashboard answers at http://127.0.0.1:{port}" in out
    assert f"vllm-anatomy dashboard --trace-dir {tmp_path / 'traces'} --port {port}" in out
    assert "Prefix caching: full blocks found by hash" in out and f"http://127.0.0.1:{port}/lessons?run=run-x.sqlite" in out
    monkeypatch.delenv("STREAMLIT_SERVER_PORT")
    assert _common.dashboard_link(str(run), "timeline").startswith("http://127.0.0.1:8501/timeline?")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the `vllm-anatomy lesson` command -----------------------------------------------------
@pytest.fixture
def fake_lessons(tmp_path):
    d = tmp_path / "lessons"
    d.mkdir()
    (d / "_common.py").write_text("")
    (d / "01_hello.py").write_text('"""Lesson 1: says hello."""\nimport os\n'
                                   'print("hello", os.environ.get("VLLM_ANATOMY_LESSON_TRACE_DIR"))\n')
    (d / "02_fails.py").write_text('"""Lesson 2: fails on purpose."""\nimport sys\nsys.exit(3)\n')
    (d / "notes.py").write_text("")
    return d


def _cli(*args, env=None, cwd=None):
    return subprocess.run([*CLI, "lesson", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd or ROOT)


def test_cli_lists_the_repository_lessons():
    proc = _cli("--list")
    assert proc.returncode == 0, proc.stderr
    listed = re.findall(r"^\s*(\d+)\s+(\d\d_\w+\.py)", proc.stdout, re.M)
    assert [name for _, name in listed] == [os.path.basename(p) for p in LESSONS]


def test_cli_runs_a_lesson_and_passes_its_exit_code(fake_lessons, tmp_path):
    env = dict(os.environ, VLLM_ANATOMY_LESSONS_DIR=str(fake_lessons))
    proc = _cli("1", "--trace-dir", str(tmp_path / "traces"), env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == f"hello {tmp_path / 'traces'}", proc.stderr
    assert _cli("02", env=env).returncode == 3
    listing = _cli("--list", env=env)
    assert "01_hello.py" in listing.stdout and "Lesson 2: fails on purpose." in listing.stdout
    assert "notes.py" not in listing.stdout


def test_cli_port_reaches_the_lesson(fake_lessons):
    (fake_lessons / "03_port.py").write_text('import os\nprint("port", os.environ.get("STREAMLIT_SERVER_PORT"))\n')
    env = dict(os.environ, VLLM_ANATOMY_LESSONS_DIR=str(fake_lessons))
    proc = _cli("3", "--port", "8612", env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "port 8612", proc.stderr


def test_cli_errors_are_clear(fake_lessons, tmp_path):
    env = dict(os.environ, VLLM_ANATOMY_LESSONS_DIR=str(fake_lessons))
    missing = _cli("7", env=env)
    assert missing.returncode == 2 and "no lesson 7" in missing.stderr and "1, 2" in missing.stderr
    assert "Traceback" not in missing.stderr
    bare = _cli(env=env)
    assert bare.returncode == 2 and "--list" in bare.stderr
    wrong = _cli("--list", env=dict(os.environ, VLLM_ANATOMY_LESSONS_DIR=str(tmp_path)))
    assert wrong.returncode == 2 and "not a lessons folder" in wrong.stderr
