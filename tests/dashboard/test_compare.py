"""Compare two runs (dashboard/compare.py), without a browser: the knob two runs differ in, the five
accounts of a real run, one sentence per account naming what moved and the knob's mechanism, pair specs
that differ in the knob alone, and the shipped pairs' manifest."""
from __future__ import annotations

import json
import os

import pytest

from dashboard import compare as cmp
from dashboard.scenarios import pair_specs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARE_DIR = os.path.join(ROOT, "samples", "compare")


def _meta(**sched) -> dict:
    return {"model": "m", "config": {"scheduler_config": {"max_num_seqs": 8, "max_num_batched_tokens": 64,
                                                          "async_scheduling": False, **sched},
                                     "cache_config": {"enable_prefix_caching": True},
                                     "compilation_config": {"cudagraph_mode": "NONE"},
                                     "parallel_config": {"tensor_parallel_size": 1}}}


def test_the_knob_is_the_one_setting_that_differs():
    [(knob, a, b)] = cmp.knob_of(_meta(max_num_seqs=2), _meta())
    assert knob.arg == "max_num_seqs" and (a, b) == (2, 8)
    assert cmp.knob_of(_meta(), _meta()) == []
    assert len(cmp.knob_of(_meta(max_num_seqs=2, max_num_batched_tokens=16), _meta())) == 2
    # CUDA graphs are recorded as the resolved mode
    graphs = _meta()
    graphs["config"]["compilation_config"]["cudagraph_mode"] = "FULL_AND_PIECEWISE"
    [(knob, a, b)] = cmp.knob_of(_meta(), graphs)
    assert knob.arg == "enforce_eager" and (a, b) == (True, False)


def test_a_sentence_per_account_names_the_biggest_move_and_the_mechanism():
    a = {"wall_s": 10.0, "steps": 40, "ttft_ms": 100.0, "peak_blocks": 10, "preemptions": 0, "host_ms": 50.0,
         "host_ms_per_step": 1.25, "all_reduces": 0, "shm_messages": 0, "requests": 7}
    b = {"wall_s": 6.0, "steps": 20, "ttft_ms": 110.0, "peak_blocks": 30, "preemptions": 2, "host_ms": 30.0,
         "host_ms_per_step": 1.5, "all_reduces": 0, "shm_messages": 0, "requests": 7}
    knobs = cmp.knob_of(_meta(max_num_seqs=2), _meta())
    lines = cmp.sentences(a, b, knobs)
    assert set(lines) == set(cmp.ACCOUNTS)
    # the metric the knob is about leads; the account's move the other way is named beside it (the trade-off)
    assert lines["time"].startswith("wall time, first arrival to last finish 10.00 s → 6.00 s (-40%), while "
                                    "TTFT, median 100 ms → 110 ms (+10%)") and "share that cost" in lines["time"]
    assert lines["memory"].startswith("KV blocks held at the peak 10 blocks → 30 blocks (+200%)")
    assert lines["request"].startswith("preemptions 0 → 2") and "preempted" in lines["request"]
    assert lines["communication"].startswith("unchanged within noise")
    # two knobs changed: the numbers, but no cause
    two = cmp.sentences(a, b, cmp.knob_of(_meta(max_num_seqs=2, max_num_batched_tokens=16), _meta()))
    assert "share that cost" not in two["time"]


def test_pair_specs_differ_in_the_knob_alone():
    a, b = pair_specs("enable_prefix_caching", False, True)
    assert a["prompts"] == b["prompts"] and a["max_tokens"] == b["max_tokens"]
    assert {k: v for k, v in a["engine_args"].items() if k != "enable_prefix_caching"} == \
        {k: v for k, v in b["engine_args"].items() if k != "enable_prefix_caching"}
    assert a["engine_args"]["enable_prefix_caching"] is False and b["engine_args"]["enable_prefix_caching"] is True
    assert (a["pair"]["side"], b["pair"]["side"]) == ("a", "b")
    speculative = cmp.BY_ARG["speculative_config"]
    assert not speculative.available           # a place kept for it, not offered as if it worked


@pytest.mark.model
def test_the_five_accounts_of_a_real_run(recorded_run):
    import pandas as pd

    from dashboard import data
    from dashboard.spans import _request_row
    from vllm_anatomy.tracing.reader import open_run
    _, path = recorded_run
    with open_run(path) as run:
        steps = run.steps()
        reqs = [_request_row(s) for s in run.requests()]
        recs = {i: run.snapshot(i)["scheduler"] for i in steps}
    rows = [data._step_row(i, 0, recs[i]["step_record"], recs[i]["kv_cache"]["usage"], [], [])
            for i in steps]
    s = cmp.summary(path, pd.DataFrame(rows), reqs)
    assert s["steps"] == len(steps) and s["requests"] == 4 and s["preemptions"] >= 1
    assert s["hit_tokens"] > 0 and s["peak_blocks"] >= 1 and s["wall_s"] > 0 and s["ttft_ms"] > 0
    assert s["ranks"] == 1 and s["all_reduces"] == 0 and s["host_ms_per_step"] > 0


def test_the_shipped_pairs_are_listed_with_both_runs():
    path = os.path.join(COMPARE_DIR, "pairs.json")
    if not os.path.exists(path):
        pytest.skip("no compare pairs shipped")
    pairs = json.load(open(path))["pairs"]
    assert pairs
    for p in pairs:
        assert p["knob"] in cmp.BY_ARG and p["a"]["value"] != p["b"]["value"]
        for side in ("a", "b"):
            f = os.path.join(COMPARE_DIR, p[side]["file"])
            assert os.path.isfile(f) and os.path.getsize(f) < 2_000_000, f       # small
