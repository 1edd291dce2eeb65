"""bench/pdl_chain.py and bench/pdl_layers.py without a GPU: their --tiny modes end to end in
Triton's interpreter (results against a torch or F.linear reference; PDL variants are left out or
reported as skipped, not faked), and pdl_chain's kernels compiled offline for sm_90: with USE_PDL
the GEMV prefetches its weight into L2 before griddepcontrol.wait and loads or stores nothing of
global memory before it; without, no PDL instruction at all. (Subprocesses: this session may
hold the kernels interpreted.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tiny(script: str, out) -> subprocess.CompletedProcess:
    """bench/<script> --tiny --out OUT in the interpreter; its stdout, after a clean exit."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--tiny", "--out", str(out)],
                          cwd=str(out.parent), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_pdl_chain_tiny_end_to_end(tmp_path):
    out = tmp_path / "pdl.json"
    proc = run_tiny("pdl_chain.py", out)
    r = json.loads(out.read_text())
    assert r["tiny"] and [row["m"] for row in r["rows"]] == [1, 4]
    for row in r["rows"]:
        assert row["finite"] and row["rel_err_vs_torch"] < 1e-4, row
        assert row["variants"]["plain"]["us"] > 0 and row["variants"]["plain"]["bit_equal_to_plain"]
        assert all("skipped" in row["variants"][v] for v in ("pdl", "pdl+prefetch"))
    assert "us/layer" in proc.stdout


AOT = r"""
import json, sys
sys.path.insert(0, "bench")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import pdl_chain as pc

def ptx_lines(fn, constexprs, types):
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return k.asm["ptx"].splitlines()

def first(lines, pat):
    return next((i for i, l in enumerate(lines) if pat in l), None)

out = {}
for use, pre in ((False, False), (True, False), (True, True)):
    lines = ptx_lines(pc._gemv_kernel, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "USE_PDL": use, "PREFETCH": pre},
                      {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"})
    out[f"gemv {use} {pre}"] = {p: first(lines, p) for p in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                                            "prefetch.global.L2", "ld.global", "cp.async", "st.global")}
lines = ptx_lines(pc._row_norm_kernel, {"BLOCK_H": 1024, "USE_PDL": True}, {"x_ptr": "*bf16", "y_ptr": "*bf16", "eps": "fp32"})
out["norm"] = {p: first(lines, p) for p in ("griddepcontrol.wait", "griddepcontrol.launch_dependents", "ld.global", "st.global")}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_pdl_chain_kernels_compile_for_sm90_with_the_wait_first():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", AOT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    plain = r["gemv False False"]
    assert plain["griddepcontrol.wait"] is None and plain["griddepcontrol.launch_dependents"] is None
    assert plain["prefetch.global.L2"] is None
    for key in ("gemv True False", "gemv True True", "norm"):
        g = r[key]
        wait = g["griddepcontrol.wait"]
        assert wait is not None and g["griddepcontrol.launch_dependents"] > wait, (key, g)
        loads = [g[p] for p in ("ld.global", "cp.async") if g.get(p) is not None]
        assert loads and min(loads) > wait and g["st.global"] > g["griddepcontrol.launch_dependents"], (key, g)
    pre = r["gemv True True"]
    assert pre["prefetch.global.L2"] is not None and pre["prefetch.global.L2"] < pre["griddepcontrol.wait"]
    assert r["gemv True False"]["prefetch.global.L2"] is None


@pytest.mark.slow
def test_pdl_layers_tiny_end_to_end(tmp_path):
    """bench/pdl_layers.py's CPU mode: the engine's own kernels (rms_norm, silu_and_mul, the
    split-K GEMM) in a layer's chain, each GEMM choice (0, tuned, 1) against F.linear's result."""
    out = tmp_path / "layers.json"
    run_tiny("pdl_layers.py", out)
    r = json.loads(out.read_text())
    assert r["tiny"] and list(r["variants"]) == ["cublas", "tuned", "skinny"]
    assert [row["m"] for row in r["rows"]] == [1, 3]
    for row in r["rows"]:
        assert set(row["us_per_layer"]) == set(r["variants"]) and all(v > 0 for v in row["us_per_layer"].values())
        assert all(err < 1e-5 for err in row["rel_err_vs_cublas"].values()), row
        assert row["best"] in r["variants"]
