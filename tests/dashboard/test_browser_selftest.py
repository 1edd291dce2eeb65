"""The Self-test page and the Processes view in a real browser (Debian's Chromium driven by
Playwright; one Streamlit server for the module): every "show me" button of the Self-test
page (the GPU sample) lands on the step, inspector tab and request its link promises; the
Processes view of a three-process live run (recorded here by the dashboard's launcher) draws
the process lanes and hops, and a click on a hop opens its step in the inspector; the
one-process sample is labelled as one process. Chart text 12 px or more; nothing requested
from another host. Screenshots: test-output/screenshots/selftest-*.png, processes-*.png."""
import os
import re
import shutil
import time
import urllib.parse

import pytest

from tests.dashboard.browser import SHOTS, new_page, settle, streamlit_server
from tests.dashboard.conftest import FIXTURE_SPEC, GPU_SAMPLE

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(GPU_SAMPLE), reason="samples/h100-smollm2-full.sqlite not shipped")]
SAMPLE = os.path.basename(GPU_SAMPLE)
TP_SAMPLE = os.path.join(os.path.dirname(GPU_SAMPLE), "cpu-smollm2-tp3-full.sqlite")
TITLES = {"inspector": "Step inspector", "journey": "Request journey", "processes": "Processes"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, name of a three-process run in its trace dir, its path)."""
    from dashboard.live import LiveRun
    samples = tmp_path_factory.mktemp("st_samples")
    shutil.copy(GPU_SAMPLE, samples / SAMPLE)
    if os.path.exists(TP_SAMPLE):
        shutil.copy(TP_SAMPLE, samples / os.path.basename(TP_SAMPLE))
    trace = tmp_path_factory.mktemp("st_traces")
    live = LiveRun.start({**FIXTURE_SPEC, "processes": 3}, str(trace))     # recorded while the server starts
    try:
        with streamlit_server(trace, samples, tmp_path_factory.mktemp("st_server"), VLLM_ANATOMY_PREWARM="0") as base:
            deadline = time.monotonic() + 300
            while (st := live.status())["state"] not in ("done", "error", "crashed", "stopped") \
                    and time.monotonic() < deadline:
                time.sleep(0.5)
            assert st["state"] == "done", (st.get("error"), live.log_tail())
            yield base, os.path.basename(st["run_path"]), st["run_path"]
    finally:
        live.stop()


def _page(browser, w=1440, h=900):
    return new_page(browser, w, h)


def _settle(pg) -> None:
    settle(pg, 300, 300)


def _open(pg, url: str, title: str) -> None:
    pg.goto(url)
    pg.get_by_role("heading", name=title, exact=True).wait_for()
    _settle(pg)
    exc = pg.locator("[data-testid='stException']")
    assert exc.count() == 0, exc.first.inner_text()[:2000]


def _query(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlparse(url).query).items()}


def _small_chart_text(pg) -> list[str]:
    return pg.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot svg text')]
        .filter(t => t.textContent.trim() && t.getBoundingClientRect().width > 0)
        .map(t => [t.textContent.trim().slice(0, 30), parseFloat(getComputedStyle(t).fontSize)])
        .filter(([_, px]) => px < 12).map(([s, px]) => s + ' @' + px)""")


def _show_me_pairs(pg) -> list[tuple[str, str]]:
    """(key of a "show me" button, the href of the link beside it), in page order."""
    return pg.evaluate("""() => {
        const out = [];
        for (const q of document.querySelectorAll('[class*="st-key-q_q"]')) {
          const keys = [...q.querySelectorAll('[class*="st-key-show_q"]')]
            .map(e => e.className.match(/st-key-(show_q\\w+)/)[1]);
          const links = [...q.querySelectorAll('a[href*="page="]')].map(a => a.getAttribute('href'));
          keys.forEach((k, i) => out.push([k, links[i] || null]));
        }
        return out;
    }""")


def test_selftest_show_me_buttons_land(server, browser):
    base = server[0]
    url = f"{base}/selftest?run={SAMPLE}&page=selftest"
    ctx, pg = _page(browser)
    try:
        _open(pg, url, "Self-test")
        assert pg.get_by_text(re.compile(r"^Answer, from this run")).count() == 5
        assert pg.get_by_text("从 Scheduler.schedule() 到 KV 块被分配", exact=False).count() >= 1
        pg.screenshot(path=os.path.join(SHOTS, "selftest-1440.png"))
        pairs = _show_me_pairs(pg)
        assert len(pairs) >= 6, pairs
        # the article's reference answer opens on a click
        pg.get_by_text("The article's reference answer (答案)").first.click()
        pg.get_by_text("KVCacheManager.get_computed_blocks（查 prefix cache 命中的块）", exact=False).first.wait_for()
        for where, href in pairs:
            assert href, where
            want = _query(href)
            _open(pg, url, "Self-test")
            pg.locator(f".st-key-{where} button").first.click()
            page_title = TITLES[want["page"]]
            pg.get_by_role("heading", name=page_title, exact=True).wait_for()
            pg.wait_for_function(f"location.search.includes('step={want['step']}')")
            _settle(pg)
            got = _query(pg.url)
            for k in ("page", "step", "tab", "request"):
                if k == "tab" and got.get(k) is None and want.get(k) == "Scheduler":
                    continue        # the first tab is the default: a bound st.tabs leaves it out of the URL
                assert got.get(k) == want.get(k), (where, k, got, want)
            if want["page"] == "inspector":
                shown = pg.get_by_text(re.compile(r"of \d+ committed")).first.inner_text()
                assert re.search(rf"step {want['step']} · ", shown), shown
                tab = pg.get_by_role("tab", selected=True).first.inner_text()
                assert tab.strip() == want["tab"], (tab, want)
            if where == pairs[0][0]:
                pg.screenshot(path=os.path.join(SHOTS, "selftest-show-me-q1-landed.png"))
    finally:
        external = list(pg.external)
        ctx.close()
    assert not external, external[:5]


def test_selftest_readable_at_two_sizes(server, browser):
    base = server[0]
    for w, h in ((1440, 900), (1920, 1080)):
        ctx, pg = _page(browser, w, h)
        try:
            _open(pg, f"{base}/selftest?run={SAMPLE}&page=selftest", "Self-test")
            pg.locator('[class*="st-key-q_q5"]').scroll_into_view_if_needed()
            pg.wait_for_timeout(300)
            pg.screenshot(path=os.path.join(SHOTS, f"selftest-q5-{w}.png"))
            small = pg.evaluate("""() => [...document.querySelectorAll('[data-testid="stMain"] p, '
                + '[data-testid="stMain"] td, [data-testid="stMain"] li, [data-testid="stMain"] h3')]
                .filter(e => e.innerText.trim() && e.getBoundingClientRect().width > 0)
                .map(e => parseFloat(getComputedStyle(e).fontSize)).filter(px => px < 12)""")
            assert not small, small[:5]
        finally:
            ctx.close()


def test_processes_view_three_processes_and_hop_click(server, browser):
    base, run3, path = server
    from dashboard.answers.source import RunSource
    from dashboard.processes import step_view
    src = RunSource(path)
    first = min(s for s in src.steps if (src.snap(s) or {}).get("scheduler_output", {}).get("scheduled_new_reqs"))
    hops = step_view(src, first)["hops"]
    assert {h.marker for h in hops} >= {"③", "⑤", "⑩", "⑪"}
    for w, h in ((1440, 900), (1920, 1080)):
        ctx, pg = _page(browser, w, h)
        try:
            _open(pg, f"{base}/processes?run={run3}&page=processes&step={first}", "Processes")
            pg.locator(".st-key-proc_fig").scroll_into_view_if_needed()
            for _ in range(40):
                pg.wait_for_timeout(250)
                if pg.locator(".st-key-proc_fig path.point").count():
                    break
            pg.screenshot(path=os.path.join(SHOTS, f"processes-three-{w}.png"))
            ticks = pg.evaluate("() => [...document.querySelectorAll('.st-key-proc_fig .ytick text')].map(t => t.textContent)")
            for want in ("API server", "input thread", "run_busy_loop()", "output thread", "worker_busy_loop()"):
                assert any(want in t for t in ticks), (want, ticks)
            assert not _small_chart_text(pg), _small_chart_text(pg)
            if w == 1440:
                _click_a_hop(pg, first, "processes-hop-click-landed.png")
        finally:
            external = list(pg.external)
            ctx.close()
        assert not external, external[:5]


def _click_a_hop(pg, step: int, shot: str) -> None:
    """Click a hop's marker in view: it opens its step in the inspector."""
    pts = pg.evaluate("""() => [...document.querySelectorAll('.st-key-proc_fig path.point')]
        .map(e => e.getBoundingClientRect()).filter(r => r.width > 1 && r.top >= 0 && r.bottom <= innerHeight)
        .map(r => ({x: r.x + r.width / 2, y: r.y + r.height / 2}))""")
    assert pts
    clicked: int | None = None
    for pt in pts:
        pg.mouse.move(pt["x"] - 20, pt["y"] - 20)
        pg.mouse.move(pt["x"], pt["y"], steps=3)
        pg.wait_for_timeout(300)
        label = pg.evaluate("() => [...document.querySelectorAll('.hoverlayer text')].map(t => t.textContent).join(' ')")
        m = re.search(r"open step (\d+)", label)
        if m:
            pg.mouse.click(pt["x"], pt["y"])
            clicked = int(m[1])
            break
    assert clicked == step, (clicked, step)
    pg.get_by_role("heading", name="Step inspector", exact=True).wait_for()
    pg.wait_for_function(f"location.search.includes('step={step}')")
    _settle(pg)
    assert _query(pg.url)["page"] == "inspector" and _query(pg.url)["step"] == str(step)
    pg.screenshot(path=os.path.join(SHOTS, shot))


@pytest.mark.skipif(not os.path.exists(TP_SAMPLE), reason="samples/cpu-smollm2-tp3-full.sqlite not shipped")
def test_tensor_parallel_sample_shows_its_ranks(server, browser):
    """The TP=3 sample: Processes names the in-process engine and the three ranks (top to bottom
    in rank order), a hop click lands; the Timeline has a lane per rank, in order, and says so."""
    base = server[0]
    run = os.path.basename(TP_SAMPLE)
    ctx, pg = _page(browser)
    try:
        _open(pg, f"{base}/processes?run={run}&page=processes&step=30", "Processes")
        pg.get_by_text("The engine in the LLM's process, 3 worker processes").wait_for()
        pg.locator(".st-key-proc_fig").scroll_into_view_if_needed()
        for _ in range(40):
            pg.wait_for_timeout(250)
            ticks = pg.evaluate("() => [...document.querySelectorAll('.st-key-proc_fig .ytick text')]"
                                ".sort((a, b) => a.getBoundingClientRect().y - b.getBoundingClientRect().y)"
                                ".map(t => t.textContent)")
            if ticks:
                break
        assert not any("API server" in t for t in ticks), ticks
        assert any("EngineCore.step (in-process)" in t for t in ticks), ticks
        ranks = [int(re.search(r"rank (\d+)", t)[1]) for t in ticks if t.startswith("WorkerProc")]
        assert ranks == [0, 1, 2], ticks
        assert not _small_chart_text(pg), _small_chart_text(pg)
        pg.screenshot(path=os.path.join(SHOTS, "processes-tp3-1440.png"))
        _click_a_hop(pg, 30, "processes-tp3-hop-click-landed.png")

        pg.goto(f"{base}/timeline?run={run}&page=timeline&step=30")
        pg.get_by_role("heading", name="Timeline", exact=True).wait_for()
        _settle(pg)
        assert pg.locator("[data-testid='stException']").count() == 0
        pg.get_by_text(re.compile(r"3 tensor-parallel ranks, each a worker lane")).wait_for()
        # (the chart draws after the caption under it on a loaded machine: wait for its lane names)
        pg.wait_for_function("() => [...document.querySelectorAll('.ytick text')]"
                             ".some(t => t.textContent.includes('WorkerProc rank'))", timeout=120_000)
        ticks = pg.evaluate("() => [...document.querySelectorAll('.ytick text')]"
                            ".sort((a, b) => a.getBoundingClientRect().y - b.getBoundingClientRect().y)"
                            ".map(t => t.textContent)")
        ranks = [int(re.search(r"WorkerProc rank (\d+)", t)[1]) for t in ticks if "WorkerProc rank" in t]
        assert ranks == [0, 1, 2], ticks
        pg.screenshot(path=os.path.join(SHOTS, "timeline-tp3-1440.png"))

        # A run on one device has 0 collectives: its five accounts offer the TP sample, which has them.
        pg.goto(f"{base}/journey?run={SAMPLE}&page=journey&step=15&request=7")
        pg.get_by_role("heading", name="Request journey", exact=True).wait_for()
        _settle(pg)
        pg.get_by_text("The five accounts of this request").click()
        pg.get_by_text("0 collectives").first.wait_for()
        pg.get_by_role("button", name=re.compile("See them in a TP run")).click()
        pg.wait_for_function(f"location.search.includes('run={run}')")
        pg.get_by_role("heading", name="Request journey", exact=True).wait_for()
        _settle(pg)
        assert _query(pg.url)["page"] == "journey"
        pg.get_by_text("The five accounts of this request").click()
        pg.get_by_text(re.compile(r"\d+ all-reduces over \d+ steps, each joined by every rank")).first.wait_for()
        pg.get_by_text("(each per rank)").first.wait_for()
        assert pg.locator("[data-testid='stException']").count() == 0
        pg.screenshot(path=os.path.join(SHOTS, "journey-tp3-five-accounts.png"))

        # The Lessons page of a one-device run: its tensor-parallelism card opens the TP sample's Lessons page,
        # where the card finds the run's busiest step and opens Processes there.
        pg.goto(f"{base}/lessons?run={SAMPLE}&page=lessons")
        pg.get_by_role("heading", name="Lessons", exact=True).wait_for()
        _settle(pg)
        pg.locator(".st-key-card_tp").get_by_role("button", name=re.compile("Open the TP sample")).click()
        pg.wait_for_function(f"location.search.includes('run={run}')")
        pg.get_by_role("heading", name="Lessons", exact=True).wait_for()
        _settle(pg)
        card = pg.locator(".st-key-card_tp")
        card.scroll_into_view_if_needed()
        button = card.get_by_role("button", name=re.compile(r"Open step \d+"))
        step = int(re.search(r"Open step (\d+)", button.inner_text())[1])
        pg.screenshot(path=os.path.join(SHOTS, "lessons-tp3-card.png"))
        button.click()
        pg.get_by_role("heading", name="Processes", exact=True).wait_for()
        pg.wait_for_function(f"location.search.includes('step={step}')")
        _settle(pg)
        assert pg.locator("[data-testid='stException']").count() == 0
        pg.get_by_text("The engine in the LLM's process, 3 worker processes").wait_for()
    finally:
        external = list(pg.external)
        ctx.close()
    assert not external, external[:5]


def test_processes_view_labels_one_process_runs(server, browser):
    base = server[0]
    ctx, pg = _page(browser)
    try:
        _open(pg, f"{base}/processes?run={SAMPLE}&page=processes&step=10", "Processes")
        assert pg.get_by_text(re.compile(r"^One process")).count() == 1
        for _ in range(40):
            pg.wait_for_timeout(250)
            ticks = pg.evaluate("() => [...document.querySelectorAll('.st-key-proc_fig .ytick text')].map(t => t.textContent)")
            if ticks:
                break
        assert ticks and all(t.startswith(("single process", "device")) for t in ticks), ticks
        assert not any(t.startswith("frontend") for t in ticks)
        pg.screenshot(path=os.path.join(SHOTS, "processes-one-process-1440.png"))
    finally:
        ctx.close()
