"""bench/launch_overhead.py off a GPU: the timing loop's arithmetic on a fake clock, the table
(a failed direct launch is printed as its error, and the JIT path's extra cost only when both
paths ran), and the refusal to run without CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from tests.helpers import imported_from

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture(scope="module")
def lo():
    with imported_from(BENCH, ("launch_overhead",)):
        import launch_overhead
        yield launch_overhead


@pytest.mark.fast
def test_per_launch_us_divides_each_loop_by_its_launches(lo, monkeypatch):
    ticks = iter([0.0, 0.010, 1.0, 1.030, 2.0, 2.020])      # three loops: 10, 30, 20 ms
    monkeypatch.setattr(lo, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    monkeypatch.setattr(lo.torch.cuda, "synchronize", lambda: None)
    calls = []
    r = lo.per_launch_us(lambda: calls.append(1), launches=1000, repeats=3)
    assert len(calls) == 200 + 3 * 1000                     # warm-up, then the timed loops
    assert r["best_us"] == pytest.approx(10.0) and r["median_us"] == pytest.approx(20.0)


@pytest.mark.fast
def test_table_says_what_failed_and_the_jit_cost(lo, capsys):
    lo.print_table({"triton_jit": {"best_us": 30.0, "median_us": 32.0},
                    "triton_compiled": {"best_us": 9.0, "median_us": 10.5}})
    out = capsys.readouterr().out
    assert "triton_jit" in out and "JIT path over the direct launch: 21.50 us a launch" in out
    lo.print_table({"triton_jit": {"best_us": 30.0, "median_us": 32.0},
                    "triton_compiled": {"error": "TypeError: bad args"}})
    out = capsys.readouterr().out
    assert "TypeError: bad args" in out and "JIT path over" not in out


@pytest.mark.fast
def test_refuses_without_cuda():
    r = subprocess.run([sys.executable, os.path.join(BENCH, "launch_overhead.py")], capture_output=True, text=True,
                       env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode != 0 and "needs a GPU" in r.stderr
