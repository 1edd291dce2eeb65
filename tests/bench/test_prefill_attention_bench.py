"""bench/prefill_attention.py on the CPU: its --tiny smoke mode end to end (Triton interpreter).

Every named row of our prefill kernel (host and device TMA descriptors, the folded
softmax scale, warp specialisation, plain, pack_gqa), unified_attention and torch SDPA
run on the tiny cases, each checked against the fp32 reference; the JSON, the summary
and the ranking hold them. The GPU sweep's variant table is checked without a GPU.
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
        assert {n.split()[0] for n in names[1:]} == SWITCH_NAMES
        assert [n.split()[0] for n in names[1:5]] == ["host", "host+fold", "host+ws", "host+fold+ws"]
        assert [e["name"] for e in case["sdpa"]] == ["sdpa_flash", "sdpa_cudnn", "sdpa_cudnn_views"]
        for e in case["ours"] + [case["unified"], *case["sdpa"]]:
            assert "error" not in e, e
            assert e["ok"] and e["max_err"] < 1e-4 and e["ms"] > 0 and 0 < e["fraction"]
        assert case["best"]["name"] in names
    assert [r["case"] for r in result["summary"]] == ["1x20", "2x17"]
    assert all(r["speedup_vs_unified"] > 0 for r in result["summary"])
    ranked = {r["name"]: r for r in result["ranking"]}
    assert set(ranked) == set(names) and ranked["default"]["speedup_vs_default"] == 1.0
    assert all(r["cases"] == 2 and r["speedup_vs_default"] > 0 for r in ranked.values())
    assert [v["name"] for v in result["variants"]] == names and result["case_errors"] == {}


SWITCH_NAMES = {"host", "host+fold", "host+ws", "host+fold+ws", "tma", "tma+fold", "tma+ws", "plain",
                "pack_gqa", "ws"}


def test_gpu_variant_table():
    """The GPU sweep (not run here): the default first, then every named row once; host
    descriptors first so that the time budget never cuts them; warp specialisation only
    with 8 warps (4 fail to compile on Hopper); --quick keeps host rows of each kind.
    (A subprocess: importing the bench here would import the kernels outside the interpreter.)"""
    code = ("import json, sys; sys.path.insert(0, 'bench'); import prefill_attention as b; "
            "s = b.Setup.__new__(b.Setup); s.tiny = False; "
            "print(json.dumps({'full': b.ours_variants(s, False), 'quick': b.ours_variants(s, True), "
            "'host_shapes': b.HOST_SHAPES}))")
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads(proc.stdout.strip().splitlines()[-1])
    full, quick = table["full"], table["quick"]
    for variants in (full, quick):
        names = [n for n, _ in variants]
        assert names[0] == "default" and len(set(names)) == len(names)
        assert all(cfg["num_warps"] == 8 for _, cfg in variants if cfg.get("warp_specialize"))
    assert {n.split()[0] for n, _ in full[1:]} == SWITCH_NAMES
    assert [n for n, _ in full[1:17]] == [f"{s} m{m} n{n} w{w} s{st}" for s in ("host", "host+fold")
                                          for m, n, w, st in table["host_shapes"]]
    assert all(cfg["tma"] == "host" for n, cfg in full[1:23] if n.startswith("host"))
    assert "host m128 n128 w8 s3" in dict(quick) and "host+fold+ws m128 n128 w8 s3" in dict(quick)
    assert len(quick) < len(full) <= 40
