"""Self-test Q5 quotes the article's trade-off — "投机解码省轮次但涨每步时间" — with the shipped
speculative-decoding pair's own numbers (dashboard/answers/q5_tradeoff.py), headless (AppTest).
The numbers this test expects are computed here from the two run stores with the reader; the
"Show me" button opens that pair on the Compare page; without the pair the page says how to get
one. The open run is the pair's B side (a run with drafts): Q5 answers it like any run."""
from __future__ import annotations

import os
import shutil
import statistics

import pytest

from tests.dashboard.conftest import APP, ROOT

COMPARE = os.path.join(ROOT, "samples", "compare")


def _pair() -> dict:
    from dashboard.answers.q5_tradeoff import spec_pair
    pair = spec_pair(COMPARE)
    if pair is None:
        pytest.skip("no speculative-decoding pair shipped")
    return pair


def _side(path: str) -> dict:
    from vllm_anatomy.tracing.reader import open_run
    with open_run(path) as run:
        spans = run.spans("EngineCore.step")
        steps, tokens = len(run.steps()), sum(s.attributes["gen_ai.usage.output_tokens"] for s in run.requests())
    drafts = sum(s.attributes.get("vllm_anatomy.spec_decode.num_drafts", 0) for s in spans)
    accepted = sum(s.attributes.get("vllm_anatomy.spec_decode.num_accepted_tokens", 0) for s in spans)
    return {"steps": steps, "tokens": tokens, "step_ms": statistics.median(s.duration_ns / 1e6 for s in spans),
            "length": 1 + accepted / drafts if drafts else None}


def _page(tmp_path, with_pair: bool):
    from streamlit.testing.v1 import AppTest
    pair = _pair()
    trace, samples = tmp_path / "trace", tmp_path / "samples"
    trace.mkdir()
    samples.mkdir()
    shutil.copyfile(pair["path_b"], trace / "spec-run.sqlite")
    if with_pair:
        shutil.copytree(COMPARE, samples / "compare")
    os.environ["VLLM_ANATOMY_TRACE_DIR"] = str(trace)
    os.environ["VLLM_ANATOMY_SAMPLES_DIR"] = str(samples)
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"run": "spec-run.sqlite", "page": "selftest"})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at, pair


def test_q5_quotes_the_spec_pair_numbers_and_shows_the_pair(tmp_path):
    at, pair = _page(tmp_path, with_pair=True)
    a, b = _side(pair["path_a"]), _side(pair["path_b"])
    assert b["steps"] / b["tokens"] < a["steps"] / a["tokens"]
    md = "\n".join(m.value for m in at.markdown)
    quote = next(m.value for m in at.markdown if m.value.startswith("**The article's trade-off, measured:**"))
    assert "投机解码省轮次但涨每步时间" in quote
    rounds = (b["steps"] / b["tokens"]) / (a["steps"] / a["tokens"]) - 1
    per_step = b["step_ms"] / a["step_ms"] - 1
    assert (f"from {a['steps'] / a['tokens']:.3f} to {b['steps'] / b['tokens']:.3f} ({rounds:+.0%}: "
            f"{a['steps']} → {b['steps']} steps for {b['tokens']} tokens)") in quote, quote
    assert f"from {a['step_ms']:.0f} to {b['step_ms']:.0f} ms ({per_step:+.0%})" in quote, quote
    assert f"gained {b['length']:.2f} tokens per step" in quote, quote
    assert f"compare?a={pair['a']['file']}&b={pair['b']['file']}" in md          # the deep link
    # Show me: the Compare page, on this pair
    at = at.button(key="st_fa_spec_pair").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Compare two runs"
    assert at.session_state["cmp_pair"] == pair["name"]
    lines = [m.value for m in at.markdown if m.value.startswith("- **Time**")]
    assert lines and "engine steps per output token (rounds)" in lines[0] and "step time, median" in lines[0], lines


def test_without_the_pair_q5_says_how_to_get_it(tmp_path):
    at, _ = _page(tmp_path, with_pair=False)
    quote = next(m.value for m in at.markdown if m.value.startswith("**The article's trade-off, measured:**"))
    assert "is not here" in quote and "record_compare_pairs.py --only spec-decode" in quote
    assert all(b.key != "st_fa_spec_pair" for b in at.button)


def test_spec_tradeoff_needs_both_runs(tmp_path):
    from dashboard.answers.q5_tradeoff import spec_tradeoff
    pair = _pair()
    shutil.copyfile(os.path.join(COMPARE, "pairs.json"), tmp_path / "pairs.json")
    shutil.copyfile(pair["path_a"], tmp_path / pair["a"]["file"])
    assert spec_tradeoff(str(tmp_path)) is None                 # B missing: nothing quoted
    shutil.copyfile(pair["path_b"], tmp_path / pair["b"]["file"])
    t = spec_tradeoff(str(tmp_path))
    assert t is not None and t["steps_per_token_change"] < 0 and t["pair"] == pair["name"]
