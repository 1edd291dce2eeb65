"""Compare two runs in a real browser (Debian's Chromium driven by Playwright): a shipped pair opened by
its URL shows the five accounts side by side with deltas, one sentence per account naming the knob's
mechanism, and both runs' steps aligned; the page's own pair (the same prompts, prefix caching off then
on) runs one after the other and lands on the comparison; the speculative-decoding pair, picked in the pair
selector, names the article's trade-off (fewer steps per token, each step longer), and the Self-test's Q5 quotes
it and opens it. Screenshots: test-output/screenshots/compare-*.png.
"""
import json
import os
import re
import shutil

import pytest

from tests.dashboard.browser import SHOTS, settle_drawn, streamlit_server
from tests.dashboard.conftest import ROOT

COMPARE = os.path.join(ROOT, "samples", "compare")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not os.path.exists(os.path.join(COMPARE, "pairs.json")),
                                                   reason="no compare pairs shipped")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    samples = tmp_path_factory.mktemp("cmp_samples")
    shutil.copytree(COMPARE, samples / "compare")
    trace = tmp_path_factory.mktemp("cmp_traces")
    with streamlit_server(trace, samples, tmp_path_factory.mktemp("cmp_server"), VLLM_ANATOMY_PREWARM="0") as base:
        yield base


def _accounts(pg) -> dict[str, str]:
    items = pg.locator("[data-testid=stMain] li").all_inner_texts()
    return {m[1]: m[2] for t in items if (m := re.match(r"(Time|Memory|Communication|CPU|Request): (.*)", t))}


def test_a_shipped_pair_side_by_side(server, page):
    pair = next(p for p in json.load(open(os.path.join(COMPARE, "pairs.json")))["pairs"] if p["knob"] == "max_num_seqs")
    page.goto(f"{server}/compare?a={pair['a']['file']}&b={pair['b']['file']}")
    page.get_by_role("heading", name="Compare two runs", exact=True).wait_for()
    page.get_by_text("What moved, and why").wait_for()
    settle_drawn(page)
    assert page.locator("[data-testid='stException']").count() == 0
    text = " ".join(page.locator("[data-testid=stMain]").inner_text().split())
    assert "max_num_seqs = 2" in text and "max_num_seqs = 8" in text          # each run's value of the knob
    lines = _accounts(page)
    assert set(lines) == {"Time", "Memory", "Communication", "CPU", "Request"}, lines
    assert "share that cost" in lines["Time"] or "unchanged" in lines["Time"], lines["Time"]
    assert re.search(r"→ .* \([+-]\d+%\)", lines["Time"]), lines["Time"]       # the move, with its size
    rows = page.locator("[data-testid=stTable] tbody tr").count()
    from dashboard.compare import METRICS, SPEC_ONLY
    assert rows == len([m for m in METRICS if m[1] not in SPEC_ONLY]) == 23, rows   # every metric but speculation's
    legend = page.evaluate("() => [...document.querySelectorAll('.st-key-cmp_aligned .legendtext')]"
                           ".map(t => t.textContent)")
    assert legend == ["run A", "run B"], legend
    titles = page.evaluate("() => [...document.querySelectorAll('.st-key-cmp_aligned .annotation-text')]"
                           ".map(t => t.textContent)")
    assert {"step time (ms)", "tokens scheduled per step", "KV usage (%)", "preemptions so far"} <= set(titles)
    page.screenshot(path=os.path.join(SHOTS, "compare-shipped-pair.png"), full_page=False)


@pytest.mark.model
def test_start_a_pair_runs_both_and_compares_them(server, page):
    page.goto(f"{server}/compare")
    page.get_by_role("heading", name="Compare two runs", exact=True).wait_for()
    settle_drawn(page)
    page.get_by_text("Start a pair").click()
    settle_drawn(page)
    knob = page.locator("[data-testid=stMain] [aria-label='Change one knob']")
    knob.wait_for()
    knob.click()
    page.get_by_role("option", name=re.compile("prefix caching")).click()
    settle_drawn(page)
    page.get_by_role("button", name=re.compile("Start the pair")).click()
    page.get_by_text("What moved, and why").wait_for(timeout=600_000)
    settle_drawn(page)
    lines = _accounts(page)
    assert re.search(r"prefix-cache hit tokens 0 tokens → \d+ tokens", lines["Request"]), lines["Request"]
    assert "system prompt" in lines["Request"]
    page.screenshot(path=os.path.join(SHOTS, "compare-started-pair.png"), full_page=False)


def _spec_pair() -> dict:
    pair = next((p for p in json.load(open(os.path.join(COMPARE, "pairs.json")))["pairs"]
                 if p["knob"] == "speculative_config"), None)
    if pair is None:
        pytest.skip("no speculative-decoding pair shipped")
    return pair


def test_the_spec_pair_from_the_pair_selector(server, page):
    pair = _spec_pair()
    page.goto(f"{server}/compare")
    page.get_by_role("heading", name="Compare two runs", exact=True).wait_for()
    settle_drawn(page)
    page.locator("[data-testid=stMain] [aria-label^='Selected'][aria-label*='Pair'], "
                 "[data-testid=stMain] [data-testid=stSelectbox] [role=combobox]").first.click()
    page.get_by_role("option", name=re.compile(re.escape(f"{pair['title']} ({pair['device']})"))).click()
    page.get_by_text("What moved, and why").wait_for()
    settle_drawn(page)
    assert page.locator("[data-testid='stException']").count() == 0
    text = " ".join(page.locator("[data-testid=stMain]").inner_text().split())
    assert "speculative_config = off" in text and "speculative_config = ngram, K = 3, prompt lookup 2–4" in text
    lines = _accounts(page)
    assert re.search(r"^engine steps per output token \(rounds\) [\d.]+ → [\d.]+ \(-\d+%\), while step time, median "
                     r"[\d.]+ ms → [\d.]+ ms \([+-]\d+%\)", lines["Time"]), lines["Time"]
    assert "投机解码省轮次但涨每步时间" in lines["Time"]
    assert re.search(r"mean acceptance length\) 1\.00 tokens → [23]\.\d\d tokens", lines["Request"]), lines["Request"]
    from dashboard.compare import METRICS
    assert page.locator("[data-testid=stTable] tbody tr").count() == len(METRICS)    # speculation's rows too
    page.get_by_text("What moved, and why").scroll_into_view_if_needed()
    page.screenshot(path=os.path.join(SHOTS, "compare-spec-pair.png"), full_page=False)
    page.get_by_text("The five accounts, side by side").scroll_into_view_if_needed()
    page.screenshot(path=os.path.join(SHOTS, "compare-spec-pair-table.png"), full_page=False)


def test_selftest_q5_quotes_the_spec_pair_and_opens_it(server, page):
    pair = _spec_pair()
    page.goto(f"{server}/selftest?run={pair['b']['file']}")
    quote = page.get_by_text("The article's trade-off, measured:")
    quote.wait_for(timeout=120_000)
    settle_drawn(page)
    assert page.locator("[data-testid='stException']").count() == 0
    quote.scroll_into_view_if_needed()
    page.screenshot(path=os.path.join(SHOTS, "compare-selftest-q5-tradeoff.png"), full_page=False)
    para = " ".join(page.locator("[data-testid=stMarkdownContainer]", has_text="trade-off, measured").last
                    .inner_text().split())
    assert re.search(r"engine steps per output token from [\d.]+ to [\d.]+ \(-\d+%", para), para
    href = page.get_by_role("link", name=pair["title"]).get_attribute("href")
    assert href == f"compare?a={pair['a']['file']}&b={pair['b']['file']}", href
    page.locator(".st-key-st_fa_spec_pair button:visible").click()      # (a hidden copy sits beside it)
    page.get_by_role("heading", name="Compare two runs", exact=True).wait_for()
    page.get_by_text("What moved, and why").wait_for()
    settle_drawn(page)
    text = " ".join(page.locator("[data-testid=stMain]").inner_text().split())
    assert pair["title"] in text and "engine steps per output token (rounds)" in text
    page.screenshot(path=os.path.join(SHOTS, "compare-from-selftest.png"), full_page=False)
