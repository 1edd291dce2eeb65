"""bench/prefill_attention.py on the CPU: its --tiny smoke mode end to end (Triton interpreter).

Every variant of our prefill kernel (plain, pack_gqa, TMA, warp specialisation,
TMA + warp specialisation), unified_attention and torch SDPA run on the tiny
cases, each checked against the fp32 reference; the JSON and the summary hold them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_prefill_attention_tiny_end_to_end(tmp_path):
    out = tmp_path / "prefill.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "prefill_attention.py"), "--tiny",
                           "--out", str(out)], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "summary" in proc.stdout and "WRONG" not in proc.stdout
    result = json.loads(out.read_text())
    assert result["tiny"] and result["matmul_ceiling"]["flop_per_s"] > 0 and result["compile_failed"] == {}
    assert [(c["num_seqs"], c["seq_len"]) for c in result["cases"]] == [(1, 20), (2, 17)]
    for case in result["cases"]:
        names = [e["name"] for e in case["ours"]]
        assert names[0] == "default" and not case["skipped"]
        assert {n.split()[0] for n in names[1:]} == {"plain", "pack_gqa", "tma", "ws", "tma+ws"}
        assert [e["name"] for e in case["sdpa"]] == ["sdpa_flash", "sdpa_cudnn", "sdpa_cudnn_views"]
        for e in case["ours"] + [case["unified"], *case["sdpa"]]:
            assert "error" not in e, e
            assert e["ok"] and e["max_err"] < 1e-4 and e["ms"] > 0 and 0 < e["fraction"]
        assert case["best"]["name"] in names
    assert [r["case"] for r in result["summary"]] == ["1x20", "2x17"]
    assert all(r["speedup_vs_unified"] > 0 for r in result["summary"])
