"""bench/serve_vs_vllm.py: its knee and verdict from fabricated rows, and the CPU smoke run end to end
(our server on both sides: no vLLM here)."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import module_from_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")


@pytest.fixture(scope="module")
def svv():
    saved = list(sys.path)
    sys.path.insert(0, BENCH)
    try:
        import serve_vs_vllm
        yield serve_vs_vllm
    finally:
        sys.path[:] = saved
        for name in ("serve_vs_vllm", "serve", "side_by_side", "throughput", "kernel_bench"):
            sys.modules.pop(name, None)


def row(rate, attainment, ttft_p99, tpot_p99, failed=0):
    return {"offered_rate": rate, "slo_attainment": attainment, "failed": failed,
            "ttft_ms": {"p99": ttft_p99}, "tpot_ms": {"p99": tpot_p99}}


def test_knee_is_the_last_rate_meeting_the_slo(svv):
    assert svv.knee([row(8, 1.0, 1, 1), row(16, 0.95, 1, 1), row(32, 0.5, 1, 1)]) == 16
    assert svv.knee([row(8, 0.2, 1, 1)]) is None
    assert svv.knee([row(8, 1.0, 1, 1, failed=1)]) is None      # a failed request is never within the SLO


def test_summary_computes_tpot_goodput_and_window(svv):
    recs = [{"ok": True, "sent": 100.0, "ttft": 0.1, "e2e": 1.1, "itl": [0.1] * 10, "output_tokens": 11},
            {"ok": True, "sent": 100.5, "ttft": 0.9, "e2e": 1.5, "itl": [0.06] * 10, "output_tokens": 11},
            {"ok": False, "sent": 101.0, "error": "HTTP 500"}]
    s = svv.summarize(2.0, recs, slo_ttft_s=0.5, slo_tpot_s=0.2)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 500"]
    assert s["window_s"] == pytest.approx(2.0)                   # 100.0 -> 100.5 + 1.5
    assert s["output_tok_per_s"] == pytest.approx(11.0)
    assert s["slo_attainment"] == pytest.approx(1 / 3)            # the second misses TTFT, the third failed
    assert s["tpot_ms"]["p50"] in (pytest.approx(100.0), pytest.approx(60.0))


def test_verdict_compares_p99_up_to_vllms_knee(svv):
    vllm = {"rows": [row(8, 1, 100, 10), row(16, 1, 200, 12), row(32, 0.1, 900, 40)], "knee": 16}
    ours = {"rows": [row(8, 1, 90, 9), row(16, 1, 150, 13), row(32, 0.2, 990, 90)], "knee": 16}
    v = svv.verdict({"vllm": vllm, "ours": ours})
    assert [r["rate"] for r in v["per_rate_up_to_vllm_knee"]] == [8, 16]
    assert not v["p99_latency_at_or_below_vllm"] and v["knee_at_least_vllm"] and not v["met"]
    ours["rows"][1]["tpot_ms"]["p99"] = 12
    assert svv.verdict({"vllm": vllm, "ours": ours})["met"]


@pytest.mark.slow
def test_cpu_smoke_run_writes_both_servers(tmp_path):
    out = tmp_path / "svv.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "serve_vs_vllm.py"), "--tiny", "--rates", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in ("vllm", "ours"):
        (r,) = result["servers"][name]["rows"]
        assert r["completed"] == r["requests"] >= 2 and r["output_tok_per_s"] > 0
        assert r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"] > 0
    assert result["verdict"]["complete"]
    assert "verdict on cpu" in proc.stdout


def test_plot_serve_draws_each_servers_p99s_goodput_and_knee(tmp_path):
    """bench/plot_serve.py: the series it draws come from the JSON's rows (sorted by rate), servers
    without rows are left out, and the PNG is written when matplotlib is there."""
    plot_serve = module_from_file("plot_serve", os.path.join(BENCH, "plot_serve.py"))

    def row(rate, ttft, tpot, goodput):
        return {"offered_rate": rate, "ttft_ms": {"p99": ttft}, "tpot_ms": {"p99": tpot},
                "goodput_req_per_s": goodput}
    result = {"device": "X", "workload": {"slo_ttft_ms": 500.0, "slo_tpot_ms": 25.0},
              "servers": {"vllm": {"knee": 8.0, "rows": [row(16.0, 900.0, 30.0, 2.0), row(8.0, 70.0, 3.0, 7.5)]},
                          "ours": {"knee": None, "rows": [row(8.0, 40.0, 1.5, 7.8)]},
                          "broken": {"knee": None, "rows": []}}}
    got = plot_serve.series(result)
    assert set(got) == {"vllm", "ours"}
    assert got["vllm"] == {"rate": [8.0, 16.0], "ttft_ms": [70.0, 900.0], "tpot_ms": [3.0, 30.0],
                           "goodput_req_per_s": [7.5, 2.0], "knee": [8.0]}
    assert got["ours"]["knee"] == []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return                                  # (not a dependency: the PNG is made where it is installed)
    out = tmp_path / "serve.png"
    plot_serve.plot(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
