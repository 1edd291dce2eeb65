"""bench/skinny_gemm.py on the CPU: its --tiny smoke mode end to end (Triton interpreter, two
compile processes), and the GPU sweep's candidate lists and failure handling without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")


@pytest.mark.slow
def test_skinny_gemm_tiny_end_to_end(tmp_path):
    out = tmp_path / "skinny.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "skinny_gemm.py"), "--tiny", "--jobs", "2",
                           "--out", str(out)], cwd=str(tmp_path), env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "per step" in proc.stdout and "WRONG" not in proc.stdout and "pool failed" not in proc.stdout
    r = json.loads(out.read_text())
    assert r["tiny"] and r["compile_failed"] == {} and r["copy_ceiling"]["bytes_per_s"] > 0
    shapes, ms = list(r["shapes"]), r["ms"]
    assert shapes == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"] and ms == [1, 5, 20]
    assert [(s["shape"], s["bucket"]) for s in r["sweep"]] == [(s, b) for s in shapes for b in (16, 32)]
    for s in r["sweep"]:
        names = [e["name"] for e in s["entries"]]
        assert len(names) == len(set(names)) >= 5 and not s["skipped"]
        assert s["best"]["name"] in names and all(e["ok"] for e in s["entries"])
        # phase B tried the other reduction and TMA on the best of phase A
        assert any(e["config"]["reduce"] == "kernel" and e["config"]["split_k"] > 1 for e in s["entries"])
        assert any(e["config"]["tma"] for e in s["entries"])
    assert [(t["shape"], t["m"]) for t in r["table"]] == [(s, m) for s in shapes for m in ms]
    for t in r["table"]:
        for label in ("cublas", "default", "best"):
            e = t[label]
            assert e["ok"] and e["max_err"] < 1e-4 and e["us"] > 0 and e["deterministic"], (t["shape"], t["m"], e)
            assert e["copy_fraction"] > 0 and e["matmul_fraction"] > 0
        assert t["best"]["speedup_vs_cublas"] == pytest.approx(t["cublas"]["us"] / t["best"]["us"])
    for step in r["per_step"]:
        at = {t["shape"]: t for t in r["table"] if t["m"] == step["m"]}
        want = sum((1 if s == "lm_head" else 28) * at[s]["cublas"]["us"] for s in shapes)
        assert step["cublas_us"] == pytest.approx(want)
        assert step["dispatch_us"] <= min(step["cublas_us"], step["best_us"]) + 1e-6
    assert len(r["tuned_rows"]) == len(r["sweep"])
    for t in r["tuned_rows"]:
        n, k = r["shapes"][t["shape"]]
        assert t["ms_in_table"] == [m for m in ms if (m <= 16) == (t["bucket"] == 16)]
        body = "SkinnyGemmConfig(" if t["wins"] else "None,"
        assert t["literal"].strip().startswith(f"({n}, {k}, {t['bucket']}): {body}")
        assert t["wins"] == (t["ours_us"] < t["cublas_us"])
    assert "rows for TUNED_CONFIGS" in proc.stdout
    assert all(t["literal"] in proc.stdout for t in r["tuned_rows"])


GPU_PLAN = r"""
import json, sys
sys.path.insert(0, 'bench')
import skinny_gemm as b
from vllm_anatomy.kernels import skinny_gemm as sg
s = b.Setup.__new__(b.Setup)
s.tiny, s.shapes, s.ms, s.dtype, s.device, s.num_sms = False, b.SHAPES, b.MS, b.torch.bfloat16, 'cpu', 132
plans = {f'{n} {k}': [c.name for c in b.phase_a(s, n, k)] for n, k in b.sweep_cases(s)}
best = b.phase_a(s, 'o_proj', 16)[3]
phase_b = [c.name for c in b.phase_b(s, 'o_proj', 16, best)]
smem = max(b.smem_bytes(c, 2) for n, k in b.sweep_cases(s) for c in b.phase_a(s, n, k))
# a config that fails to launch is listed once, by its compiled variant, and skipped
bad = b.phase_a(s, 'qkv_proj', 16)[1]
real = sg.skinny_gemm
def refuse(x, w, bias=None, config=None, **kw):
    if config == bad:
        raise RuntimeError('out of resource: shared memory')
    return real(x, w, bias, config=config, **kw)
sg.skinny_gemm = refuse
s.shapes, s.dtype, s.tiny = {'qkv_proj': (48, 32)}, b.torch.float32, True     # CPU timing from here
failed = {}
b.RATES.update(copy=1e9, matmul=1e9)
compiled = b.precompile(s, [((48, 32), 3, bad), ((48, 32), 3, best)], None, failed)
entries, skipped = b.time_candidates(s, 'qkv_proj', 16, [best, bad], failed, float('inf'))
print(json.dumps({'plans': plans, 'phase_b': phase_b, 'best': best.name, 'smem': smem, 'compiled': compiled,
                  'failed': failed, 'bad': b.variant_key(bad, 32), 'timed': [e['name'] for e in entries]}))
"""


def test_gpu_sweep_plan_and_failures():
    """The GPU sweep (not run here): every (shape, bucket) starts with its default and sweeps
    tile shapes within Hopper's shared memory, swapped and not; phase B varies the split,
    warps x stages, TMA and the reduction; a config that fails is recorded under its
    compiled variant and skipped. (A subprocess: the kernels must import interpreted.)"""
    proc = subprocess.run([sys.executable, "-c", GPU_PLAN], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    plans = r["plans"]
    assert len(plans) == 5 * 5                                          # shapes x buckets 16 .. 256
    for key, names in plans.items():
        assert len(names) == len(set(names)) and 10 <= len(names) <= 25, key
        assert any(" swap" in n for n in names) and any(" swap" not in n for n in names)
    assert r["smem"] <= 227 * 1024
    assert plans["lm_head 16"][0].startswith("m16n128k128 s1 ") and plans["o_proj 256"][0].startswith("m128n64k128 s4 ")
    pb = r["phase_b"]
    assert r["best"] not in pb and len(pb) == len(set(pb)) >= 10
    assert any(" tma" in n for n in pb) and any(n.endswith(" kernel") for n in pb)
    assert {n.split()[1] for n in pb} >= {"s1", "s2", "s4", "s8", "s16"}
    assert r["compiled"] == 2 and list(r["failed"]) == [r["bad"]], r["failed"]
    assert "out of resource" in r["failed"][r["bad"]] and r["timed"] == [r["best"]]
