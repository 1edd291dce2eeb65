"""bench/host_stalls.py (GPU-free): the stall finder, the GC / Triton / step logs, and a small
run of the whole host path whose collections land in the steps they happened in."""
from __future__ import annotations

import gc
import os
import types

import pytest

from tests.helpers import imported_from

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
BENCH_MODULES = ("host_stalls", "step_overhead", "throughput", "kernel_bench", "vs_vllm", "side_by_side")


@pytest.fixture(scope="module")
def hs():
    """bench/host_stalls.py as a module, bench/ on sys.path only while this file's tests run."""
    with imported_from(BENCH, BENCH_MODULES):
        import host_stalls
        yield host_stalls


def _step(i: int, host_ms: float, prompt: int = 0, finished: int = 0, gcs=()) -> dict:
    return {"step": i, "host_s": host_ms / 1e3, "phases_s": {"schedule": host_ms / 2e3},
            "scheduled": {"total": 1, "prompt": prompt}, "num_finished": finished,
            "gc": [{"generation": g, "duration_s": ms / 1e3, "collected": 0} for g, ms in gcs]}


@pytest.mark.fast
def test_a_stall_is_a_step_slower_than_its_neighbours_not_than_the_run(hs):
    # Host time shrinking with the batch: 4 ms down to 1 ms over 60 steps, and one step of
    # 2.5 ms extra (with a gen-2 collection) at step 40, where its neighbours take ~2 ms.
    host = [4.0 - 3.0 * i / 59 for i in range(60)]
    steps = [_step(i, h) for i, h in enumerate(host)]
    steps[40] = _step(40, host[40] + 2.5, gcs=[(2, 2.4)])
    stalls = hs.find_stalls(steps, 1e-3)
    assert [s["step"] for s in stalls] == [40]
    assert stalls[0]["excess_s"] == pytest.approx(2.5e-3, abs=1e-4) and stalls[0]["at"] == pytest.approx(40 / 59, abs=1e-3)
    summary = hs.summarize({"steps": steps}, 1e-3)
    assert summary["num_stalls"] == 1 and summary["num_stalls_with_gen2"] == 1
    assert summary["num_over_run_median"] == 10         # steps 0-9: what a run-wide median would call stalls
    assert summary["stalls"][0]["gc"] == [{"generation": 2, "ms": pytest.approx(2.4), "collected": 0}]
    steps[10] = _step(10, host[10], prompt=100)
    steps[20] = _step(20, host[20] + 0.5, finished=2)
    kinds = hs.by_kind(steps)
    assert (kinds["prefill"]["count"], kinds["decode_finishing"]["count"], kinds["decode"]["count"]) == (1, 1, 58)
    assert kinds["decode_finishing"]["median_excess_ms"] == pytest.approx(0.5, abs=0.06)


@pytest.mark.fast
def test_gc_log_puts_each_collection_in_the_step_it_happened_in(hs):
    with hs.GCLog() as log:
        log.step = 3
        gc.collect(1)
        log.step = -1
        gc.collect(0)
    assert log._callback not in gc.callbacks
    assert [(e.generation, e.step) for e in log.events][-2:] == [(1, 3), (0, -1)]
    assert all(e.duration_s >= 0 and e.start_ns > 0 for e in log.events)
    summary = log.summary()
    assert summary["gen1"]["count"] >= 1 and summary["gen0"]["count"] >= 1


@pytest.mark.fast
def test_triton_compile_log_pairs_each_compile_with_its_end_and_restores_the_hooks(hs):
    pytest.importorskip("triton")
    from triton import knobs
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    fn = types.SimpleNamespace(name="mod._kernel")
    with hs.TritonCompileLog() as log:
        assert log.available and knobs.runtime.jit_cache_hook == log._cache_hook
        assert log._cache_hook(fn=fn, key="k") is False          # never skips the compilation
        log._post_compile_hook(fn=fn, key="k")
        log._cache_hook(fn=types.SimpleNamespace(name="mod._other"), key="k2")
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
    assert [(e["kernel"], e["end_ns"] is not None) for e in log.events] == [("mod._kernel", True),
                                                                           ("mod._other", False)]


def test_small_run_of_the_host_path_finishes_every_request_and_attributes_collections(hs, monkeypatch):
    """6 requests through the real engine on the stand-in model; a full collection forced
    inside the run's 3rd update_from_output must appear in that engine step's record."""
    from vllm_anatomy.core.sched.scheduler import Scheduler
    original = Scheduler.update_from_output
    calls = []

    def update_from_output(self, *args, **kwargs):
        if len(self.requests) == 6:          # the run's 6 requests (not the warm-up's one)
            calls.append(1)
            if len(calls) == 3:
                gc.collect(2)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)
    prompts = [[7 + i] * (20 + 30 * i) for i in range(6)]
    max_tokens = [5 + i for i in range(6)]
    result = hs.run_workload(prompts, max_tokens)
    assert result["num_finished"] == 6 and result["output_tokens"] == sum(max_tokens)
    steps = result["steps"]
    assert steps[0]["scheduled"] == {"total": sum(map(len, prompts)), "prompt": sum(map(len, prompts))}
    assert all(s["host_s"] > 0 and "schedule" in s["phases_s"] for s in steps if s["scheduled"])
    forced = [s["step"] for s in steps if any(e["generation"] == 2 for e in s["gc"])]
    # (async scheduling: engine step 0 only launches step 1; engine step k launches step k + 1
    # and then applies step k's output, so the 3rd update_from_output is engine step 3's)
    assert forced and forced[0] == 3
    assert all(e["step"] >= -1 for e in result["gc_events"])
    assert result["gc_summary"]["gen2"]["count"] >= 1


def test_host_step_log_times_every_engine_step_of_generate(hs, tmp_path):
    """HostStepLog (bench/gpu_breakdown.py --gc-log) on the stand-in engine: one record per
    LLMEngine.step() of LLM.generate, in time.time_ns(), with the step's phases."""
    import time

    from vllm_anatomy import SamplingParams
    llm = hs.host_only_llm(str(tmp_path))
    try:
        log = hs.HostStepLog(llm)
        start = time.time_ns()
        outs = llm.generate([{"prompt_token_ids": [5] * 40}, {"prompt_token_ids": [6] * 9}],
                            SamplingParams(max_tokens=4, temperature=0.6, ignore_eos=True), use_tqdm=False)
        end = time.time_ns()
    finally:
        llm.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    steps = log.steps
    assert len(steps) >= 5                                  # 4 tokens each, async: one more step to drain
    assert start <= steps[0]["start_ns"] and steps[-1]["end_ns"] <= end
    assert all(a["end_ns"] <= b["start_ns"] for a, b in zip(steps, steps[1:]))
    assert "schedule" in steps[0]["phases_s"] and sum(s["num_outputs"] for s in steps) == 2
