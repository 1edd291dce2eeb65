"""bench/ttft_host.py (gpu_breakdown.py --workload ttft:N --host-profile) on the CPU: the sync log, the
cProfile table, and the three passes end to end over a tiny model (its real run needs a GPU)."""
from __future__ import annotations

import cProfile
import os
import pstats
import traceback
import warnings

import pytest

from tests.helpers import imported_from

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")


@pytest.fixture(scope="module")
def th():
    with imported_from(BENCH, ("ttft_host", "host_stalls", "step_overhead", "side_by_side", "gpu_breakdown",
                               "vs_vllm", "throughput")):
        import ttft_host
        yield ttft_host


@pytest.mark.fast
def test_sync_log_keeps_cuda_sync_warnings_with_their_vllm_anatomy_frame(th):
    """What torch.cuda.set_sync_debug_mode("warn") raises is recorded with the innermost engine frame
    that made it (here a fake one, compiled as if it were a file of vllm_anatomy); any other warning
    still reaches the user."""
    code = compile("def item():\n    warnings.warn(MSG)\n", "/x/vllm_anatomy/worker/fake_runner.py", "exec")
    scope = {"warnings": warnings, "MSG": f"{th.SYNC_WARNING} (aten::item)"}
    exec(code, scope)
    with th.SyncLog() as log:
        scope["item"]()
        scope["item"]()
        with pytest.warns(UserWarning, match="something else"):
            warnings.warn("something else")
    assert [s["site"] for s in log.syncs] == ["vllm_anatomy/worker/fake_runner.py:2 item"] * 2
    assert all(th.SYNC_WARNING in s["op"] for s in log.syncs)
    with warnings.catch_warnings(record=True) as after:       # the log is detached on exit
        warnings.simplefilter("always")
        scope["item"]()
    assert len(after) == 1 and len(log.syncs) == 2
    assert th.sync_site(traceback.StackSummary.from_list([])) == "?"


@pytest.mark.fast
def test_top_functions_are_per_call_and_sorted_by_own_time(th):
    def busy(n: int) -> int:
        return sum(i * i for i in range(n))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(4):
        busy(20000)
    profiler.disable()
    rows = th.top_functions(pstats.Stats(profiler), calls=4, n=5)
    assert len(rows) <= 5 and rows == sorted(rows, key=lambda r: -r["own_ms"])
    mine = next(r for r in rows if r["function"].endswith(" busy") or "<genexpr>" in r["function"])
    assert mine["own_ms"] > 0 and mine["cum_ms"] >= mine["own_ms"]
    busy_row = next((r for r in th.top_functions(pstats.Stats(profiler), calls=4, n=50)
                     if r["function"].endswith(" busy")), None)
    assert busy_row is not None and busy_row["calls"] == pytest.approx(1.0)   # 4 calls over 4 runs


@pytest.mark.slow
def test_host_profile_end_to_end_on_a_tiny_model(th, tmp_path, capsys):
    """The three passes over a tiny CPU model: every call's wall, each call's engine steps and their
    phases (no CUDA: no sync), and the cProfile table naming the engine's own functions."""
    import side_by_side
    side_by_side.write_models(str(tmp_path / "m"), str(tmp_path / "v"), tiny=True)
    engine = side_by_side.Engine("ours", str(tmp_path / "m"), max_model_len=256)
    try:
        prompts = [[[7 + i + 3 * s] * 40 for i in range(2)] for s in range(3)]
        host = th.host_profile(engine, prompts)
    finally:
        engine.shutdown()
    assert len(host["walls_ms"]) == 2 and all(w > 0 for w in host["walls_ms"])
    assert len(host["phases"]) == 2
    for call in host["phases"]:
        assert call["syncs"] == [] and call["allocator"] == {} and call["steps"], call   # (no CUDA here)
        assert any("forward_launch" in s["phases_ms"] and "schedule" in s["phases_ms"] for s in call["steps"])
        assert sum(s["ms"] for s in call["steps"]) <= call["wall_ms"] * 1.05
    assert host["cprofile_top"] and any("vllm_anatomy" in r["function"] for r in host["cprofile_top"])
    th.print_host_profile(host, first_call_ms=12.5)
    out = capsys.readouterr().out
    assert "first call of this length 12.50 ms" in out and "CUDA syncs over 2 calls: none" in out
    assert "allocator events over 2 calls: none" in out
    assert "own time per call" in out


@pytest.mark.fast
def test_the_table_sums_each_calls_allocator_events_and_syncs(th, capsys):
    """What the device run prints from its calls: the allocator's events summed over the calls (a
    retry is a device-wide sync), each sync site counted, the median call's steps."""
    def call(wall: float, allocator: dict, syncs: list) -> dict:
        return {"wall_ms": wall, "steps": [{"ms": wall - 1, "phases_ms": {"forward_launch": wall - 2}}],
                "syncs": syncs, "allocator": allocator}
    sync = {"op": f"{th.SYNC_WARNING} (aten::item)", "site": "vllm_anatomy/worker/x.py:3 f"}
    host = {"walls_ms": [33.0, 41.0, 42.0], "median_wall_ms": 41.0, "cprofile_wall_ms_per_call": 90.0,
            "cprofile_top": [{"function": "x.py:1 f", "own_ms": 1.0, "cum_ms": 2.0, "calls": 3.0}],
            "phases": [call(41.0, {"num_alloc_retries": 1, "num_device_alloc": 2}, [sync]),
                       call(42.0, {"num_alloc_retries": 1}, [sync]), call(33.0, {}, [])]}
    th.print_host_profile(host, first_call_ms=33.3)
    out = capsys.readouterr().out
    assert "allocator events over 3 calls: num_alloc_retries +2, num_device_alloc +2" in out
    assert "  2 x vllm_anatomy/worker/x.py:3 f :: " in out
    assert "a median call under the phase clock (41.00 ms)" in out and "forward_launch 39.00" in out
