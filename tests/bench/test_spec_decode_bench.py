"""bench/spec_decode.py end to end on the CPU (--tiny, a small random Llama): it runs every
(method, workload, batch), prints the table and writes JSON with the speculative runs'
counters and their ratios to the synchronous baseline."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_tiny_run_writes_the_table(tiny_llama_dir, tmp_path):
    out = tmp_path / "spec.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "spec_decode.py"), "--tiny",
                           "--models", tiny_llama_dir, "--out", str(out)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    # CPU: no async baseline, no draft model for a non-default model: off and ngram only.
    assert {(r["method"], r["workload"], r["batch"]) for r in runs} == {
        (m, w, b) for m in ("off", "ngram") for w in ("repetitive", "random") for b in (1, 2)}
    for r in runs:
        assert r["output_tokens"] > 0 and r["output_tok_per_s"] > 0 and r["engine_steps"] > 0
        assert r["num_requests"] == 2
    # random workload, ignore_eos: every request runs to its max_tokens, so both methods emit the same count
    by = {(r["method"], r["workload"], r["batch"]): r for r in runs}
    assert by["off", "random", 2]["output_tokens"] == by["ngram", "random", 2]["output_tokens"]
    assert len(result["vs_off"]) == 4 and all(r["method"] == "ngram" for r in result["vs_off"])
    assert "tok/s" in proc.stdout and "against 'off'" in proc.stdout
