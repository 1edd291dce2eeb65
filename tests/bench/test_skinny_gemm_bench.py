"""bench/skinny_gemm.py on the CPU: its --tiny smoke mode end to end (Triton interpreter, two
compile processes), each GEMM alone, --in-context and --pdl; what each mode launches inside a
timed graph; the GPU sweep's candidate lists and failure handling without a GPU; on a GPU
(marked gpu), --pdl's table in context."""
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
    # each GEMM alone: the mode said, nothing of --in-context or --pdl in the JSON or the printout
    assert r["in_context"] is False and r["pdl"] is False and "(each GEMM alone, PDL off)" in stdout
    assert not {"pdl_effective", "pdl_bit_equal", "producer", "producer_us", "context_note"} & set(r)
    assert "--pdl" not in stdout and "--in-context" not in stdout
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


def check_in_context_run(r: dict, stdout: str) -> None:
    """A --tiny run in context (--in-context or --pdl): the producer alone timed once per (M, K)
    (and graph size: 10 launches with one W here) and subtracted from every GEMM of that size,
    in the sweep and the table, cuBLAS too; the rows chosen from those times. (On the CPU the
    difference of two interpreter timings is mostly noise: no sign is asserted for cuBLAS.)"""
    assert r["in_context"] is True and "rms_norm" in r["producer"]
    assert f"pdl={r['pdl']})" in r["producer"] and r["compile_failed"] == {}
    shapes, ms = list(r["shapes"]), r["ms"]
    assert all(p["per_graph"] == 10 for p in r["producer_us"])
    producer = {(p["m"], p["k"]): p["us"] for p in r["producer_us"]}
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


@pytest.mark.slow
def test_skinny_gemm_tiny_in_context_end_to_end(tmp_path):
    """--in-context on the CPU: every GEMM timed after its producer with PDL off everywhere (the
    default engine's launches), the producer's time recorded and subtracted, the rows chosen
    from those times and said to be; paste_tuned_rows.py takes them as they are."""
    r, stdout = run_bench(tmp_path, "--tiny", "--in-context", "--jobs", "2")
    assert r["in_context"] is True and r["pdl"] is False and r["producer"].endswith("pdl=False) -> x [M, K]")
    assert not {"pdl_effective", "pdl_bit_equal"} & set(r) and "PDL" not in r["producer"]
    assert "nothing launched with PDL (the default engine" in r["context_note"] and "--pdl" not in stdout
    assert "--in-context: each GEMM timed after its producer" in stdout
    assert "(in context, --in-context: PDL off, for the default engine)" in stdout
    check_in_context_run(r, stdout)
    # the device stage pastes these rows into TUNED_CONFIGS: the JSON as it is
    kernel = tmp_path / "skinny_gemm.py"
    kernel.write_text(open(os.path.join(ROOT, "vllm_anatomy", "kernels", "skinny_gemm.py")).read())
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers", "paste_tuned_rows.py"),
                           str(tmp_path / "skinny.json"), str(kernel)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and f"pasted {len(r['tuned_rows'])} rows" in proc.stdout, proc.stderr
    assert "chosen in context, PDL off" in proc.stdout
    pasted = kernel.read_text()
    assert all(t["literal"] in pasted for t in r["tuned_rows"]) and "(4096, 1024, 16)" not in pasted


@pytest.mark.slow
def test_skinny_gemm_tiny_pdl_end_to_end(tmp_path):
    """--pdl on the CPU: in context as --in-context, the producer and ours asked for PDL; PDL
    cannot run in the interpreter, and the run says so rather than pretend."""
    r, stdout = run_bench(tmp_path, "--tiny", "--pdl", "--jobs", "2")
    assert r["in_context"] is True and r["pdl"] is True and r["producer"].endswith("pdl=True) -> x [M, K]")
    assert r["pdl_effective"] is False and "NOT effective" in r["context_note"]
    assert "PDL NOT effective" in stdout and "(in context, --pdl)" in stdout and "--in-context" not in stdout
    # ours with PDL vs without, one config per shape, bit for bit (trivially here: both without)
    shapes, ms = list(r["shapes"]), r["ms"]
    assert [(b["shape"], b["m"]) for b in r["pdl_bit_equal"]] == [(s, ms[0]) for s in shapes]
    assert all(b["equal"] for b in r["pdl_bit_equal"]) and "DIFFERENT" not in stdout
    check_in_context_run(r, stdout)


LAUNCHES = r"""
import json, sys
sys.path.insert(0, 'bench')
import skinny_gemm as b
from vllm_anatomy.kernels import skinny_gemm as sg
log, timed, last = [], [], {}             # every launch; those of each timed call; the producer's last x
norm, gemm, linear = b.rms_norm, sg.skinny_gemm, b.F.linear
def traced_norm(x, w, eps, residual=None, *, pdl=False):
    last['x'] = norm(x, w, eps, residual, pdl=pdl)
    log.append(('norm', pdl, None))
    return last['x']
def traced_gemm(x, w, bias=None, **kw):   # on the producer's output?
    log.append(('ours', kw['pdl'], x is last['x'] if 'x' in last else None))
    return gemm(x, w, bias, **kw)
def traced_linear(x, w, bias=None):
    log.append(('cublas', None, x is last['x'] if 'x' in last else None))
    return linear(x, w, bias)
b.rms_norm, sg.skinny_gemm, b.F.linear = traced_norm, traced_gemm, traced_linear
out = {}
for mode, kw in (('alone', {}), ('in_context', {'in_context': True}), ('pdl', {'pdl': True})):
    s = b.Setup(True, **kw)
    def timing(fn, per_graph, time_us=s.time_us):   # each call of a timed function: what it launched
        def call():
            start = len(log)
            fn()
            timed.append(log[start:])
        return time_us(call, per_graph)
    s.time_us = timing
    last.clear()
    b.PRODUCER_US.clear()                          # one mode a run: its producer times
    case = b.Case(s, 'qkv_proj', 5)
    del timed[:]
    case.ours('dflt', sg.pick_config(5, 96, 64, s.dtype, s.num_sms))
    case.cublas()
    out[mode] = {'calls': list(timed), 'in_context': s.in_context, 'pdl': s.pdl}
print(json.dumps(out))
"""


def test_in_context_launches_the_producer_before_every_gemm():
    """What each mode launches in one timed graph's function: alone, the GEMM only; in context
    (--in-context, --pdl), the producer, then the GEMM on the producer's output, for ours and for
    cuBLAS alike, plus the producer alone (the time subtracted); PDL asked for by the producer
    and ours only with --pdl (--in-context: pdl=False everywhere, the default engine's launches).
    A run that silently dropped the producer, or launched anything with PDL under --in-context,
    fails here. (A subprocess: the kernels must import interpreted.)"""
    proc = subprocess.run([sys.executable, "-c", LAUNCHES], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["alone"]["in_context"], r["alone"]["pdl"]) == (False, False)
    assert (r["in_context"]["in_context"], r["in_context"]["pdl"]) == (True, False)
    assert (r["pdl"]["in_context"], r["pdl"]["pdl"]) == (True, True)
    alone = [[tuple(c) for c in call] for call in r["alone"]["calls"]]
    assert alone == [[("ours", False, None)]] * 2 + [[("cublas", None, None)]] * 2   # warm-up + 1 timed each
    for mode, pdl in (("in_context", False), ("pdl", True)):
        calls = [[tuple(c) for c in call] for call in r[mode]["calls"]]
        norm = ("norm", pdl, None)
        # ours: a warm-up and REPEATS timed calls, then the producer alone (as many), then cuBLAS
        want = ([[norm, ("ours", pdl, True)]] * 6 + [[norm]] * 6 + [[norm, ("cublas", None, True)]] * 6)
        assert calls == want, (mode, calls)
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
