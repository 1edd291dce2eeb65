"""The console script, as `make run` uses it."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model
CLI = os.path.join(os.path.dirname(sys.executable), "vllm-anatomy")


def _run(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=600)


def test_generate_prints_a_real_answer():
    r = _run("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "engine steps" in r.stderr and "KV blocks" in r.stderr


def test_bad_engine_argument_is_a_clear_error():
    r = _run("generate", "--prompt", "hi", "--max-model-len", "999999")
    assert r.returncode == 2
    assert "max_model_len=999999 exceeds" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_model_path_is_a_clear_error(tmp_path):
    r = _run("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "nope" in r.stderr
