"""The dashboard's shell in a real browser (Debian's Chromium driven by Playwright):
nothing is requested from another host on any page (the test fails on the first
such request), no Deploy button, the run header on every page, the landing page's
one primary action above the fold at 1440x900, deep links that land (run, page,
step, tab) and a refused path, and a live run from the start strip: its start-up
stages, then its first step, with the sidebar on the same step.

Uses the GPU sample shipped in samples/ (no recording needed) and, for the live
run, the default model. Screenshots: test-output/screenshots/shell-*.png.
"""
import os
import re
import shutil
import time
import urllib.parse

import pytest

from tests.dashboard.browser import SHOTS, new_page, settle, streamlit_server
from tests.dashboard.conftest import GPU_SAMPLE

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(GPU_SAMPLE), reason="samples/h100-smollm2-full.sqlite not shipped")]
SAMPLE = os.path.basename(GPU_SAMPLE)
PAGES = [("live", None), ("timeline", "Timeline"), ("inspector", "Step inspector"), ("journey", "Request journey"),
         ("metrics", "Metrics over time"), ("lessons", "Lessons"), ("mapping", None)]


def _sample_async() -> str:
    """What the header must say of the sample's async scheduling, from its own meta."""
    import json
    import sqlite3
    conn = sqlite3.connect(f"file:{GPU_SAMPLE}?immutable=1", uri=True)
    config = json.loads(conn.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()[0])
    conn.close()
    value = config["scheduler_config"].get("async_scheduling")
    return "not recorded" if value is None else ("on" if value else "off")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    samples = tmp_path_factory.mktemp("shell_samples")
    shutil.copy(GPU_SAMPLE, samples / SAMPLE)
    trace = tmp_path_factory.mktemp("shell_traces")
    with streamlit_server(trace, samples, tmp_path_factory.mktemp("shell_server")) as base:
        yield base


@pytest.fixture
def page(browser):
    """A page at 1440x900 that refuses (and records) every request to another host."""
    ctx, pg = new_page(browser, timeout_ms=90_000, block=True)
    yield pg
    ctx.close()


def _settle(pg) -> None:
    settle(pg, 600, 600)


def test_every_page_is_offline_with_a_run_header_and_no_deploy_button(server, page):
    for name, title in PAGES:
        page.goto(f"{server}/{name}?run={SAMPLE}&page={name}&step=40")
        if title:
            page.get_by_role("heading", name=title).first.wait_for()
        _settle(page)
        assert page.locator("[data-testid='stException']").count() == 0, name
        if name != "mapping":
            header = page.get_by_test_id("va-run-header")
            header.wait_for()
            text = header.inner_text()
            for needle in (f"run {SAMPLE}", "model SmolLM2-135M-Instruct", "device cuda", "dtype bfloat16",
                           "CUDA graphs FULL_AND_PIECEWISE (sizes 1–64)", "block size 16 tokens", "KV blocks 24",
                           "token budget 128 / step", "max_num_seqs 8", "trace full",
                           f"async scheduling {_sample_async()}"):
                assert needle in " ".join(text.split()), (name, needle, text)
        assert page.get_by_test_id("stAppDeployButton").count() == 0
        assert page.get_by_role("button", name="Deploy").count() == 0
        page.screenshot(path=os.path.join(SHOTS, f"shell-{name}-1440.png"), full_page=False)
    assert page.external == [], page.external


def test_landing_has_one_primary_action_above_the_fold(server, page):
    for width, height in ((1440, 900), (1920, 1080)):
        page.set_viewport_size({"width": width, "height": height})
        page.goto(f"{server}/")
        page.get_by_role("button", name="Start the guided tour").wait_for()
        _settle(page)
        primary = page.locator("[data-testid='stBaseButton-primary']:visible, "
                               "[data-testid='stBaseButton-primaryFormSubmit']:visible")
        assert primary.count() == 1, [primary.nth(i).inner_text() for i in range(primary.count())]
        box = primary.first.bounding_box()
        assert box["y"] + box["height"] <= height, box
        assert primary.first.inner_text().strip().endswith("Start the guided tour")
        for way in ("Watch a live run", "Open the GPU sample", "Follow the lessons"):
            assert page.get_by_text(re.compile(way)).first.is_visible()
        # Found at 1440x900: the compare link's one-line label was cut mid-word ("speculative c").
        link = page.locator("[data-testid='stPageLink-NavLink']").filter(has_text="compare two runs").first
        assert link.is_visible()
        clipped = link.evaluate("a => [...a.querySelectorAll('*')].concat([a]).filter("
                                "e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)")
        assert clipped == [], (width, clipped)
        page.screenshot(path=os.path.join(SHOTS, f"shell-landing-{width}.png"), full_page=False)
    assert page.external == [], page.external


def test_deep_links_land_and_paths_are_refused(server, page):
    page.goto(f"{server}/inspector?run={SAMPLE}&page=inspector&step=25&tab=KV+cache")
    page.get_by_text(re.compile(r"step 25 · 25 of \d+ committed")).first.wait_for()
    _settle(page)
    assert page.get_by_role("tab", name="KV cache").get_attribute("aria-selected") == "true"
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(page.url).query)
    assert q["run"] == [SAMPLE] and q["step"] == ["25"] and q["tab"] == ["KV cache"]
    page.screenshot(path=os.path.join(SHOTS, "shell-deep-link-kv-tab.png"), full_page=False)
    for asked in ("/etc/passwd", GPU_SAMPLE, "../samples/" + SAMPLE):
        page.goto(f"{server}/inspector?" + urllib.parse.urlencode({"run": asked, "page": "inspector"}))
        page.get_by_text("This run cannot be opened").first.wait_for()
        _settle(page)
        body = page.locator("body").inner_text()
        assert "passwd" not in body and "no such" not in body.lower()
        assert page.locator("[data-testid='stException']").count() == 0
    page.screenshot(path=os.path.join(SHOTS, "shell-refused-path.png"), full_page=False)
    assert page.external == [], page.external


@pytest.mark.model
def test_live_run_shows_start_up_stages_then_its_first_step(server, page):
    page.goto(f"{server}/")
    start = page.get_by_role("button", name="Start the guided tour")
    start.wait_for()
    _settle(page)
    t0 = time.monotonic()
    start.click()
    # NOTE: visible matches only: the start strip's card (collapsed once a run starts) also
    # says "start-up", and a hidden first match would be waited on until the timeout.
    page.get_by_text("Start-up").locator("visible=true").first.wait_for()
    page.get_by_text("start process").locator("visible=true").first.wait_for()
    page.screenshot(path=os.path.join(SHOTS, "shell-live-starting.png"), full_page=False)
    first = page.get_by_text(re.compile(r"Step \d+ of \d+ committed")).first
    first.wait_for(timeout=240_000)
    seconds = time.monotonic() - t0
    page.get_by_text(re.compile(r"Started in [\d.]+ s: start process")).first.wait_for()
    # the sidebar follows the live step (it said "step 0" while the page moved on)
    page.wait_for_timeout(2500)
    side = page.get_by_test_id("stSidebar").get_by_text(re.compile(r"Live engine: .*step \d+")).first.inner_text()
    shown, committed = map(int, re.search(r"Step (\d+) of (\d+)", first.inner_text()).groups())
    # NOTE: the sidebar shows the engine's step, read here before the page's count of committed
    # steps: it moved on (it used to say "step 0"), and is never ahead of what is committed
    # (the page may rerun between the two reads, so no lower bound from the page's cursor).
    side_step = int(re.search(r"step (\d+)", side)[1])
    assert 1 <= shown <= committed and 1 <= side_step <= committed + 1, (side, shown, committed)
    header = " ".join(page.get_by_test_id("va-run-header").inner_text().split())
    assert "KV blocks 9 (" in header and "device cpu ·" in header and "async scheduling off" in header, header
    page.screenshot(path=os.path.join(SHOTS, "shell-live-first-step.png"), full_page=False)
    page.get_by_role("button", name=re.compile("Stop engine")).click()
    page.get_by_text(re.compile(r"engine (stopped|done)")).first.wait_for(timeout=60_000)
    print(f"click -> first step shown: {seconds:.1f} s")
    assert page.external == [], page.external
