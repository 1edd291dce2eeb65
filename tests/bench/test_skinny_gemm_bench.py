"""bench/skinny_gemm.py on the CPU: its --tiny smoke mode end to end (Triton interpreter, two
compile processes), with and without --pdl, and the GPU sweep's candidate lists and failure
handling without a GPU; on a GPU (marked gpu), --pdl's table in context."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")


def run_bench(tmp_path, *flags: str, env: dict = ENV) -> tuple[dict, str]:
    """bench/skinny_gemm.py with flags: (its JSON, its stdout)."""
    out = tmp_path / "skinny.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "skinny_gemm.py"), *flags, "--out", str(out)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "per step" in proc.stdout and "WRONG" not in proc.stdout and "pool failed" not in proc.stdout
    return json.loads(out.read_text()), proc.stdout


def check_tuned_rows(r: dict, stdout: str) -> None:
    """One TUNED_CONFIGS row per swept (shape, bucket), its literal as the engine's table holds
    them, a config exactly where ours took less time than cuBLAS over the bucket's Ms."""
    assert len(r["tuned_rows"]) == len(r["sweep"])
    for t in r["tuned_rows"]:
        n, k = r["shapes"][t["shape"]]
        assert t["ms_in_table"] == [m for m in r["ms"] if (m <= 16) == (t["bucket"] == 16)]
        body = "SkinnyGemmConfig(" if t["wins"] else "None,"
        assert t["literal"].strip().startswith(f"({n}, {k}, {t['bucket']}): {body}")
        assert t["wins"] == (t["ours_us"] < t["cublas_us"])
    assert "rows for TUNED_CONFIGS" in stdout
    assert all(t["literal"] in stdout for t in r["tuned_rows"])


@pytest.mark.slow
def test_skinny_gemm_tiny_end_to_end(tmp_path):
    r, stdout = run_bench(tmp_path, "--tiny", "--jobs", "2")
    # without --pdl: nothing of it in the JSON or the printout (the output as before --pdl existed)
    assert not {"pdl", "pdl_effective", "pdl_bit_equal"} & set(r) and "--pdl" not in stdout
    assert not any("producer_us" in t or "producer_us" in t["cublas"] for t in r["table"])
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
    check_tuned_rows(r, stdout)


def check_in_context(e: dict, producer_us: float) -> None:
    """An entry timed after its producer: both times kept, the producer's (its case's) subtracted."""
    assert e["producer_us"] == producer_us and e["in_context_us"] > 0
    assert e["us"] == pytest.approx(e["in_context_us"] - e["producer_us"])


@pytest.mark.slow
def test_skinny_gemm_tiny_pdl_end_to_end(tmp_path):
    """--pdl on the CPU: PDL cannot run in the interpreter, and the run says so rather than
    pretend; every GEMM is still timed after its producer (rms_norm over K), whose time alone
    is recorded and subtracted, and the rows are chosen from those times. (On the CPU the
    difference of two interpreter timings is mostly noise: no sign is asserted for cuBLAS.)"""
    r, stdout = run_bench(tmp_path, "--tiny", "--pdl", "--jobs", "2")
    assert r["pdl"] is True and r["pdl_effective"] is False and "NOT effective" in r["pdl_note"]
    assert "rms_norm" in r["pdl_producer"] and "PDL NOT effective" in stdout and "(in context, --pdl)" in stdout
    assert r["compile_failed"] == {}
    shapes, ms = list(r["shapes"]), r["ms"]
    # ours with PDL vs without, one config per shape, bit for bit (trivially here: both without)
    assert [(b["shape"], b["m"]) for b in r["pdl_bit_equal"]] == [(s, ms[0]) for s in shapes]
    assert all(b["equal"] for b in r["pdl_bit_equal"]) and "DIFFERENT" not in stdout
    # the producer alone: timed once per (M, K) (and graph size: 10 launches with one W here),
    # subtracted from every GEMM of that size
    assert all(p["per_graph"] == 10 for p in r["pdl_producer_us"])
    producer = {(p["m"], p["k"]): p["us"] for p in r["pdl_producer_us"]}
    assert all(us > 0 and f"K={k} M={m} x10 {us:.2f}" in stdout for (m, k), us in producer.items())
    assert set(producer) == {(m, k) for m in ms for n, k in r["shapes"].values()}  # the sweep times at 5 and 20
    for s in r["sweep"]:
        assert s["best"] and s["entries"]
        for e in s["entries"]:
            check_in_context(e, producer[(s["m"], r["shapes"][s["shape"]][1])])
            assert e["ok"]
        assert s["best"]["us"] == min(e["us"] for e in s["entries"])    # chosen in context
    assert [(t["shape"], t["m"]) for t in r["table"]] == [(s, m) for s in shapes for m in ms]
    for t in r["table"]:
        assert t["producer_us"] == producer[(t["m"], t["k"])]
        for label in ("cublas", "default", "best"):
            e = t[label]
            check_in_context(e, t["producer_us"])
            assert e["ok"] and e["max_err"] < 1e-4 and e["deterministic"], (t["shape"], t["m"], e)
    for step in r["per_step"]:
        at = {t["shape"]: t for t in r["table"] if t["m"] == step["m"]}
        assert step["cublas_us"] == pytest.approx(sum((1 if s == "lm_head" else 28) * at[s]["cublas"]["us"]
                                                      for s in shapes))
    check_tuned_rows(r, stdout)


@pytest.mark.gpu
@pytest.mark.slow
def test_skinny_gemm_pdl_on_gpu(tmp_path):
    """On an sm_90+ GPU: --pdl launches with PDL, ours with and without it bit-equal, and every
    GEMM's time after subtracting its producer is positive (the table only: --no-sweep)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA GPU of sm_90+")
    env = {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"}
    r, stdout = run_bench(tmp_path, "--pdl", "--no-sweep", "--budget-s", "5", env=env)
    assert r["pdl"] is True and r["pdl_effective"] is True and "NOT effective" not in stdout
    assert len(r["pdl_bit_equal"]) == 5 and all(b["equal"] for b in r["pdl_bit_equal"])
    for t in r["table"]:
        for label in ("cublas", "default"):
            check_in_context(t[label], t["producer_us"])
            assert t[label]["ok"] and t[label]["us"] > 0, (t["shape"], t["m"], t[label])


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
