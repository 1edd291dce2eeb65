"""Every lesson is also a test: run each lessons/NN_*.py in its own process.

A lesson passes when it exits 0 (its check(...) calls raise on a false fact),
printed its checks, and ended with a dashboard link to a run it recorded in the
trace dir we gave it. Also: the `vllm-anatomy lesson` command, on a fake lessons
folder (no model needed).
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
PAGES = ("timeline", "inspector", "journey", "metrics", "lessons")
URL = re.compile(r"\?(\S*\brun=[^&\s]+\S*)")
CLI = [sys.executable, "-m", "vllm_anatomy.entrypoints.cli.main"]


@pytest.fixture(scope="session")
def default_model_dir():
    from vllm_anatomy.model_executor.default_model import ensure_default_model
    return str(ensure_default_model())


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
    urls = URL.findall(proc.stdout)
    assert urls, f"the lesson printed no dashboard link{tail}"
    query = urllib.parse.parse_qs(urls[-1])
    assert query.get("page", [None])[0] in PAGES, f"dashboard link without a known page: {urls[-1]}"
    if "step" in query:
        assert query["step"][0].isdigit(), f"dashboard link with a bad step: {urls[-1]}"
    run_path = query["run"][0]
    assert os.path.isfile(run_path), f"the linked run store {run_path} does not exist{tail}"
    assert os.path.commonpath([run_path, str(tmp_path)]) == str(tmp_path), \
        f"the run was not recorded under VLLM_ANATOMY_LESSON_TRACE_DIR={tmp_path}: {run_path}"


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


def test_cli_errors_are_clear(fake_lessons, tmp_path):
    env = dict(os.environ, VLLM_ANATOMY_LESSONS_DIR=str(fake_lessons))
    missing = _cli("7", env=env)
    assert missing.returncode == 2 and "no lesson 7" in missing.stderr and "1, 2" in missing.stderr
    assert "Traceback" not in missing.stderr
    bare = _cli(env=env)
    assert bare.returncode == 2 and "--list" in bare.stderr
    wrong = _cli("--list", env=dict(os.environ, VLLM_ANATOMY_LESSONS_DIR=str(tmp_path)))
    assert wrong.returncode == 2 and "not a lessons folder" in wrong.stderr
