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


def test_speculative_decoding_is_a_knob_with_its_own_workload():
    from dashboard.scenarios import NGRAM_K3, PAIR_WORKLOAD, SPEC_PAIR_WORKLOAD
    knob = cmp.BY_ARG["speculative_config"]
    assert knob.available and knob.values == (None, NGRAM_K3)
    a, b = pair_specs("speculative_config", None, NGRAM_K3)
    assert a["prompts"] == b["prompts"] == SPEC_PAIR_WORKLOAD["prompts"] != PAIR_WORKLOAD["prompts"]
    assert a["engine_args"]["speculative_config"] is None and b["engine_args"]["speculative_config"] == NGRAM_K3
    assert {k: v for k, v in a["engine_args"].items() if k != "speculative_config"} == \
        {k: v for k, v in b["engine_args"].items() if k != "speculative_config"}
    # the run meta records the resolved SpeculativeConfig (model "ngram", no draft config): the knob reads
    # the fields that choose the drafts, and the section is not listed again as "also different"
    on = _meta()
    on["config"]["speculative_config"] = {**NGRAM_K3, "model": "ngram", "draft_model_config": None}
    off = _meta()
    off["config"]["speculative_config"] = None
    [(k, va, vb)] = cmp.knob_of(off, on)
    assert k is knob and va is None and vb == NGRAM_K3
    assert (cmp.value_text(k, va), cmp.value_text(k, vb)) == ("off", "ngram, K = 3, prompt lookup 2–4")
    assert cmp.other_differences(off, on) == []


def test_the_speculation_sentence_names_both_sides_of_the_trade():
    """Time: the rounds saved, with the step time that pays for them (the knob's `cost`)."""
    a = {"steps": 40, "steps_per_token": 0.3, "step_ms": 100.0, "acceptance_length": 1.0, "rolled_back_slots": 0,
         "peak_kv_mb": 10.0}
    b = {"steps": 28, "steps_per_token": 0.21, "step_ms": 115.0, "acceptance_length": 3.0, "rolled_back_slots": 20,
         "peak_kv_mb": 9.0}
    off, on = _meta(), _meta()
    on["config"]["speculative_config"] = dict(cmp.BY_ARG["speculative_config"].values[1])
    lines = cmp.sentences(a, b, cmp.knob_of(off, on))
    assert lines["time"].startswith("engine steps per output token (rounds) 0.300 → 0.210 (-30%), while step time, "
                                    "median 100 ms → 115 ms (+15%)") and "投机解码省轮次但涨每步时间" in lines["time"]
    assert lines["request"].startswith("tokens a request gains per step it decodes (mean acceptance length) "
                                       "1.00 tokens → 3.00 tokens (+200%)")
    assert "0 slots → 20 slots" in lines["memory"] and "allocate_slots" in lines["memory"]


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
            # small (the largest: an eager GPU run, whose every step carries per-kernel device spans)
            assert os.path.isfile(f) and os.path.getsize(f) < 3_000_000, f


def _shipped_spec_pair():
    from dashboard.answers.q5_tradeoff import spec_pair
    pair = spec_pair(COMPARE_DIR)
    if pair is None:
        pytest.skip("no speculative-decoding pair shipped")
    return pair


def _greedy_tokens(path: str) -> dict[str, list[int]]:
    """Each request's output token ids, from the worker's snapshots alone (sampled_token_ids per row, the
    rows of discarded partial prefills left out), cut at the request span's output token count."""
    from vllm_anatomy.tracing.reader import open_run
    out: dict[str, list[int]] = {}
    with open_run(path) as run:
        n = {s.request_id: s.attributes["gen_ai.usage.output_tokens"] for s in run.requests()}
        for i in run.steps():
            mr = run.snapshot(i, "model_runner") or {}
            pi = mr.get("prepare_inputs") or {}
            for j, (r, ids) in enumerate(zip(pi.get("req_ids") or [], mr.get("sampled_token_ids") or [])):
                if j not in (pi.get("discard_request_indices") or []):
                    out.setdefault(r, []).extend(ids)
    return {r: t[:n[r]] for r, t in out.items()}


def test_the_shipped_spec_pair_saves_rounds_and_keeps_the_greedy_text():
    """The shipped pair itself (read with the reader, not the dashboard): the same requests and token ids
    with and without drafts, fewer engine steps per output token with them, drafts verified and accepted."""
    import statistics

    from vllm_anatomy.tracing.reader import open_run
    pair = _shipped_spec_pair()
    assert pair["a"]["value"] is None and pair["b"]["value"]["method"] == "ngram"
    runs = {}
    for side in ("a", "b"):
        path = pair[f"path_{side}"]
        assert os.path.getsize(path) <= 1_250_000, path                  # as small as the other samples
        with open_run(path) as run:
            spans = run.spans("EngineCore.step")
            runs[side] = {"steps": len(run.steps()), "meta": run.meta,
                          "tokens": sum(s.attributes["gen_ai.usage.output_tokens"] for s in run.requests()),
                          "step_ms": statistics.median(s.duration_ns / 1e6 for s in spans),
                          "drafts": sum(s.attributes.get("vllm_anatomy.spec_decode.num_draft_tokens", 0) for s in spans),
                          "accepted": sum(s.attributes.get("vllm_anatomy.spec_decode.num_accepted_tokens", 0)
                                          for s in spans)}
    a, b = runs["a"], runs["b"]
    assert a["meta"]["config"]["speculative_config"] is None
    assert b["meta"]["config"]["speculative_config"]["num_speculative_tokens"] == 3
    ta, tb = _greedy_tokens(pair["path_a"]), _greedy_tokens(pair["path_b"])
    assert len(ta) == 4 and ta == tb                                       # the same greedy tokens
    assert a["tokens"] == b["tokens"] == sum(map(len, ta.values()))
    assert b["steps"] / b["tokens"] < 0.85 * a["steps"] / a["tokens"]     # fewer rounds per token
    assert a["drafts"] == 0 and b["drafts"] > 0 and 0 < b["accepted"] <= b["drafts"]


def test_the_form_offers_speculative_decoding(tmp_path):
    """Start a pair → speculative decoding: A off, B ngram K = 3 (prompt lookup 2–4), the copy workload named,
    and the start button enabled (the knob is no longer a placeholder)."""
    from streamlit.testing.v1 import AppTest

    from tests.dashboard.conftest import APP
    os.environ["VLLM_ANATOMY_TRACE_DIR"] = str(tmp_path)
    os.environ["VLLM_ANATOMY_SAMPLES_DIR"] = str(tmp_path)
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"page": "compare"})
    at.run()
    at.radio(key="cmp_mode").set_value("Start a pair").run()
    at.selectbox(key="cmp_knob").set_value("speculative_config").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="cmp_va_spec").value == "off"
    assert at.selectbox(key="cmp_vb_spec").value == "ngram, K = 3, prompt lookup 2–4"
    assert "off" in at.selectbox(key="cmp_vb_spec").options and len(at.selectbox(key="cmp_vb_spec").options) == 4
    assert any("copy and edit tasks" in c.value for c in at.caption)
    assert not at.button(key="cmp_start").disabled
    assert not [i.value for i in at.info if "not in this engine" in i.value]


def test_the_spec_pair_changes_one_knob_on_a_gpu_too():
    """Speculative decoding runs synchronously (the engine turns async scheduling off for ngram, as
    v0.27.1): both sides pin async scheduling off, or on a GPU side A would differ in two knobs."""
    from dashboard.scenarios import NGRAM_K3, pair_specs
    a, b = pair_specs("speculative_config", None, NGRAM_K3)
    assert a["engine_args"]["async_scheduling"] is False and b["engine_args"]["async_scheduling"] is False
    assert a["engine_args"]["speculative_config"] is None and b["engine_args"]["speculative_config"] == NGRAM_K3
    assert {k: v for k, v in a["engine_args"].items() if k != "speculative_config"} == \
        {k: v for k, v in b["engine_args"].items() if k != "speculative_config"}


def test_the_kv_pool_reads_the_same_in_the_run_header_and_the_table(monkeypatch, tmp_path):
    """Found at 1440x900: the run header said "KV blocks 18 (12.7 MB)" and the table "KV pool (MB) 11.95"
    (the table leaves out the null block) with nothing saying why. The table now names the usable blocks,
    and the header's tooltip says block 0 is the null block."""
    from streamlit.testing.v1 import AppTest

    from dashboard.components.run_header import header_fields
    from dashboard.components.kv_memory import MB
    from tests.dashboard.conftest import APP
    pair = os.path.join(COMPARE_DIR, "cpu-chunk-size-a.sqlite")
    if not os.path.exists(pair):
        pytest.skip("no compare pairs shipped")
    from vllm_anatomy.tracing.reader import open_run
    with open_run(pair) as run:
        meta = run.meta
    blocks, per_block = meta["config"]["cache_config"]["num_gpu_blocks"], meta["kv_cache_bytes_per_block"]
    kv = dict((label, (value, why)) for label, value, why in header_fields(meta))["KV blocks"]
    assert kv[0].startswith(f"{blocks} ") and "null block" in kv[1], kv
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", os.path.dirname(COMPARE_DIR))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"page": "compare", "a": "cpu-chunk-size-a.sqlite", "b": "cpu-chunk-size-b.sqlite"})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    table = at.table[0].value
    rows = {m: r for m, r in zip(table["metric"], table.to_dict("records"))}
    pool = [m for m in rows if m.startswith("KV pool")]
    usable = next(m for m in pool if m.startswith("KV pool, usable blocks (num_gpu_blocks"))
    assert rows[usable]["A"] == str(blocks - 1) and "null block" in usable, rows[usable]
    in_mb = next(m for m in pool if m.endswith("(MB)"))
    assert "usable" in in_mb and rows[in_mb]["A"] == f"{(blocks - 1) * per_block / MB:.2f}", (in_mb, rows[in_mb])


def test_a_delta_of_thousands_is_not_written_in_e_notation():
    """Found on the cpu-max-num-seqs pair at 1440x900: the TTFT row's Δ B − A read '-2.55e+03' (ms)."""
    assert cmp.delta_text(-2552.4) == "-2,552"
    assert cmp.delta_text(-979.2) == "-979" and cmp.delta_text(4.72) == "+4.72"
    assert cmp.delta_text(-0.0595) == "-0.0595" and cmp.delta_text(0) == "0" and cmp.delta_text(None) == "—"
    assert cmp.delta_text(12345678) == "+12,345,678" and "e" not in cmp.delta_text(1.5e-5)


def test_enforce_eager_reads_as_its_own_value():
    """Found on the h100-cuda-graphs pair at 1440x900: run A (CUDA graphs NONE, enforce_eager True) was
    headed "`enforce_eager` = off (eager)" and run B (graphs on) "`enforce_eager` = on": the words were
    the graphs' state under the argument's name."""
    k = cmp.BY_ARG["enforce_eager"]
    assert cmp.value_text(k, True) == "on (eager: CUDA graphs off)"
    assert cmp.value_text(k, False) == "off (CUDA graphs on)"
    pair = os.path.join(COMPARE_DIR, "h100-cuda-graphs-a.sqlite")
    if os.path.exists(pair):
        from vllm_anatomy.tracing.reader import open_run
        with open_run(pair) as a, open_run(pair.replace("-a.", "-b.")) as b:
            [(knob, va, vb)] = cmp.knob_of(a.meta, b.meta)
        assert knob is k and cmp.value_text(k, va).startswith("on") and cmp.value_text(k, vb).startswith("off")


def _compare_by_url(monkeypatch, tmp_path, a: str, b: str):
    """Compare opened by a link naming the two runs (compare?a=…&b=…). AppTest opens the page through the
    app's `page` parameter, whose page switch drops the other parameters: the link's a and b come on the
    next run, as a link followed on the open page."""
    from streamlit.testing.v1 import AppTest

    from tests.dashboard.conftest import APP
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", os.path.dirname(COMPARE_DIR))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"page": "compare"})
    at.run()
    at.query_params.update({"a": a, "b": b})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _shipped(name: str) -> dict:
    with open(os.path.join(COMPARE_DIR, "pairs.json")) as f:
        pair = next((p for p in json.load(f)["pairs"] if p["name"] == name), None)
    if pair is None or not all(os.path.exists(os.path.join(COMPARE_DIR, pair[s]["file"])) for s in "ab"):
        pytest.skip(f"the {name} pair is not shipped")
    return pair


def test_a_link_to_a_shipped_pair_shows_its_description(monkeypatch, tmp_path):
    """Found at 1440x900: Compare opened by its URL (compare?a=…&b=… naming a shipped pair) showed the
    two runs as "Any two runs", without the description the in-app picker shows for the same pair."""
    pair = _shipped("h100-async-scheduling")
    at = _compare_by_url(monkeypatch, tmp_path, pair["a"]["file"], pair["b"]["file"])
    assert pair["description"] in [c.value for c in at.caption]
    assert at.radio(key="cmp_mode").value == "A shipped pair" and at.selectbox(key="cmp_pair").value == pair["name"]
    assert f"`{pair['a']['file']}`" in "\n".join(m.value for m in at.markdown)
    # "Any two runs" starts from the same two runs (found in Chromium: it jumped to two unrelated samples),
    # and they are still that pair: its description is there too.
    at.radio(key="cmp_mode").set_value("Any two runs").run()
    assert [at.selectbox(key=k).value for k in ("cmp_a", "cmp_b")] == \
        [os.path.join(COMPARE_DIR, pair[s]["file"]) for s in "ab"]
    assert pair["description"] in [c.value for c in at.caption]


def test_async_scheduling_says_what_it_does_then_shows_the_overlap(monkeypatch, tmp_path):
    """Found at 1440x900 on the h100-async-scheduling pair: the Time line's "why" began with the overlap it
    sees, not with what async scheduling does. It now leads with the mechanism (v0.27.1:
    EngineCore.step_with_batch_queue keeps the scheduler one step ahead, placeholders standing in for the
    tokens step N has not sampled yet, so the GPU waits less for the host), then points at the overlapping
    EngineCore.step spans as the evidence, with this pair's own counts."""
    knob = cmp.BY_ARG["async_scheduling"]
    why = knob.why["time"]
    mech = why.index("schedules step N+1")
    assert why.startswith("async scheduling") and mech < why.index("GPU runs step N") < why.index("waits less") \
        < why.index("the evidence") < why.index("overlap")
    assert "placeholder" in why and "step_with_batch_queue" in why
    pair = _shipped("h100-async-scheduling")
    at = _compare_by_url(monkeypatch, tmp_path, pair["a"]["file"], pair["b"]["file"])
    md = "\n".join(m.value for m in at.markdown)
    line = next(ln for ln in md.splitlines() if ln.startswith("- **Time**"))
    from vllm_anatomy.tracing.reader import open_run
    counts = []
    for side in "ab":
        with open_run(os.path.join(COMPARE_DIR, pair[side]["file"])) as run:
            spans = sorted(run.spans("EngineCore.step"), key=lambda s: s.start_ns)
        pairs = list(zip(spans, spans[1:]))
        counts.append((sum(1 for x, y in pairs if y.start_ns < x.end_ns), len(pairs)))
    (oa, na), (ob, nb) = counts
    assert oa == 0 and ob > 0, counts                   # off: no overlap; on: step N+1 starts inside step N
    assert f"{ob} of {nb} consecutive step pairs overlap in B, {oa} of {na} in A" in line, line
    assert line.index("schedules step N+1") < line.index(f"{ob} of {nb}"), line


def test_a_figure_neither_run_recorded_is_said_in_words(monkeypatch, tmp_path):
    """Found at 1440x900 on the h100-async-scheduling pair: the table's "weights (one rank) (MB)" row read
    — — — — (the runs' meta has no model_weight_bytes and their model files stayed on the recording
    machine). A run's missing figure reads "not recorded"; a delta that cannot be taken stays a dash."""
    from dashboard.answers.source import weight_bytes_of
    pair = _shipped("h100-async-scheduling")
    from vllm_anatomy.tracing.reader import open_run
    with open_run(os.path.join(COMPARE_DIR, pair["a"]["file"])) as run:
        if weight_bytes_of(run.meta)[0] is not None:
            pytest.skip("this machine has the pair's model files: its weights are known")
    at = _compare_by_url(monkeypatch, tmp_path, pair["a"]["file"], pair["b"]["file"])
    table = at.table[0].value
    row = next(r for r in table.to_dict("records") if r["metric"].startswith("weights"))
    assert (row["A"], row["B"], row["Δ B − A"]) == ("not recorded", "not recorded", "—"), row


def test_a_run_whose_meta_has_its_weights_shows_them(monkeypatch, tmp_path):
    """The engine records model_weight_bytes (one rank's loaded weights) in the run meta: the table's
    "weights (one rank) (MB)" row shows it, from the meta alone (the model's files are nowhere here).
    The shipped pair is copied and its meta given the figure (SmolLM2-135M's bf16 weights)."""
    import shutil
    import sqlite3
    pair = _shipped("h100-async-scheduling")
    weights = 134_515_008 * 2
    for side in "ab":
        copy = tmp_path / f"weights-{side}.sqlite"
        shutil.copy(os.path.join(COMPARE_DIR, pair[side]["file"]), copy)
        with sqlite3.connect(copy) as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", ("model_weight_bytes", json.dumps(weights)))
            db.execute("UPDATE meta SET value = ? WHERE key = 'model'", (json.dumps("/nowhere/SmolLM2-135M"),))
    at = _compare_by_url(monkeypatch, tmp_path, "weights-a.sqlite", "weights-b.sqlite")
    table = at.table[0].value
    row = next(r for r in table.to_dict("records") if r["metric"].startswith("weights"))
    assert row["metric"] == "weights (one rank) (MB)", row
    assert row["A"] == row["B"] == "257", row            # 256.6 MB, as the table rounds it


def test_the_async_pair_points_at_what_shows_the_gain(monkeypatch, tmp_path):
    """The h100-async-scheduling pair's description said "Look at: the step time: the host's Python hidden
    behind the device's forward", but its median step span grows with async on (each step's span now also
    covers the next step's scheduling). It points at tokens per second and TPOT, which do improve in the
    pair's own table, and at the overlapping step spans; it says the step time is not where the gain shows."""
    pair = _shipped("h100-async-scheduling")
    look = pair["description"].split("Look at: ", 1)[1]
    assert not look.startswith("the step time")
    assert look.index("output tokens per second and TPOT") < look.index("Not the median step time"), look
    assert "EngineCore.step span starting before the previous one ends" in look, look
    at = _compare_by_url(monkeypatch, tmp_path, pair["a"]["file"], pair["b"]["file"])
    rows = {r["metric"]: r for r in at.table[0].value.to_dict("records")}

    def ab(prefix: str) -> tuple[float, float]:
        r = next(v for k, v in rows.items() if k.startswith(prefix))
        return float(r["A"].replace(",", "")), float(r["B"].replace(",", ""))
    tok_a, tok_b = ab("output tokens per second")
    tpot_a, tpot_b = ab("TPOT")
    step_a, step_b = ab("step time, median")
    assert tok_b > tok_a and tpot_b < tpot_a and step_b > step_a, rows
    assert pair["description"] in [c.value for c in at.caption]


def test_the_async_pair_names_its_price_in_ttft_from_its_own_spans(monkeypatch, tmp_path):
    """The async pair's median TTFT doubles (7.2 -> 14.9 ms), which its text did not say. Its sentence on
    TTFT is held to the pair's own records: run B reads step 1's tokens (AsyncGPUModelRunnerOutput.get_output)
    only after step 2's launch (GPUModelRunner.execute_model, eager and fully traced: about 5 ms of host
    time) has returned, while a decode step's launch takes the host under a millisecond."""
    import sqlite3
    import statistics
    pair = _shipped("h100-async-scheduling")
    look = pair["description"].split("Look at: ", 1)[1]
    assert "the price, TTFT: step N's tokens are read only after step N+1 has been launched" in look, look
    db = sqlite3.connect(os.path.join(COMPARE_DIR, pair["b"]["file"]))

    def span(name: str, step: int) -> tuple[float, float]:
        start, end = db.execute("SELECT start_ns, end_ns FROM spans WHERE name = ? AND step_id = ?",
                                (name, step)).fetchone()
        return start / 1e6, end / 1e6
    launch_2 = span("GPUModelRunner.execute_model", 2)
    assert span("AsyncGPUModelRunnerOutput.get_output", 1)[0] >= launch_2[1]
    assert 3.0 <= launch_2[1] - launch_2[0] <= 8.0                     # "about 5 ms of host time"
    decode = [(e - s) / 1e6 for s, e in db.execute(
        "SELECT start_ns, end_ns FROM spans WHERE name = 'GPUModelRunner.execute_model' AND step_id >= 5 "
        "AND CAST(json_extract(attributes, '$.\"vllm_anatomy.num_scheduled_tokens\"') AS INTEGER) "
        "BETWEEN 1 AND 8")]                                            # decode steps: a token per request
    assert len(decode) > 20 and statistics.median(decode) < 1.0, decode  # "under a millisecond"
    at = _compare_by_url(monkeypatch, tmp_path, pair["a"]["file"], pair["b"]["file"])
    row = next(r for r in at.table[0].value.to_dict("records") if r["metric"].startswith("TTFT"))
    ttft_a, ttft_b = float(row["A"].replace(",", "")), float(row["B"].replace(",", ""))
    assert 1.6 <= ttft_b / ttft_a <= 2.4, row                            # "roughly doubles"
