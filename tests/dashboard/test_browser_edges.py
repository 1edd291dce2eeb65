"""Issue 33's ten rough edges, each in a real browser (Debian's Chromium driven by Playwright, one
Streamlit server for the module, the shipped samples): each test failed on the tree before the fix.

 1 the three-process guided tour runs to its end: no traceback, the page and the sidebar on one step
 2 a request id reads the same on the chips and in the tables
 3 async scheduling is explained on the Timeline (§五), the sync point where it moved
 4 the block trail reaches reshape_and_cache: its launches, or why a step has none
 5 the Processes chain table agrees with itself (② found, ⑧ says why), nothing clipped, run_busy_loop()
 6 a deep link / "Show me" lands on the tab it names, and the request it names is outlined
 7 tensor parallelism reads: the inspector says it, 61 = 2 × 30 + 1 against the article's 160, lanes
 8 the WAITING → RUNNING card opens a step that lights that edge
 9 no text under 12 px (inline code, the state machine), sample runs told apart in the picker
10 the first live minute: a pause per step, a drawn budget bar, the self-test never a dead end

Screenshots: test-output/screenshots/edges-*.png.
"""
import os
import re
import shutil
import time

import pytest

from tests.dashboard.browser import SHOTS, settle_drawn, streamlit_server
from tests.dashboard.conftest import GPU_SAMPLE

SAMPLES = os.path.dirname(GPU_SAMPLE)
P1 = os.path.basename(GPU_SAMPLE)                       # one process, async scheduling on
P3 = "h100-smollm2-full-3proc.sqlite"                    # three processes
TP = "cpu-smollm2-tp3-full.sqlite"                       # TP=3 on a CPU
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not all(os.path.exists(os.path.join(SAMPLES, n)) for n in (P1, P3, TP)), reason="the shipped samples are missing")]
EDGE = "#b0303f"        # a lit state-machine edge (components/queues.py: ACTIVE_EDGE)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    samples = tmp_path_factory.mktemp("edge_samples")
    for n in (P1, P3, TP):
        shutil.copy(os.path.join(SAMPLES, n), samples / n)
    trace = tmp_path_factory.mktemp("edge_traces")
    with streamlit_server(trace, samples, tmp_path_factory.mktemp("edge_server"), VLLM_ANATOMY_PREWARM="0") as base:
        yield base


def _open(pg, url: str, heading: str | None) -> None:
    pg.goto(url)
    if heading:
        pg.get_by_role("heading", name=heading, exact=True).wait_for()
    settle_drawn(pg)
    exc = pg.locator("[data-testid='stException']")
    assert exc.count() == 0, exc.first.inner_text()[:2000]


def _main_text(pg) -> str:
    return " ".join(pg.locator("[data-testid=stMain]").inner_text().split())


def _shot(pg, name: str) -> None:
    pg.screenshot(path=os.path.join(SHOTS, f"edges-{name}.png"))


def _ticks(pg, key: str | None = None) -> list[str]:
    sel = f".st-key-{key} .ytick text" if key else ".ytick text"
    return pg.evaluate(f"() => [...document.querySelectorAll('{sel}')]"
                       ".sort((a, b) => a.getBoundingClientRect().y - b.getBoundingClientRect().y)"
                       ".map(t => t.textContent)")


# -- 1 ------------------------------------------------------------------------------------------
@pytest.mark.model
def test_1_three_process_tour_runs_to_its_end_without_a_traceback(server, page):
    _open(page, f"{server}/", None)
    page.get_by_text("three processes, as").first.click()
    slider = page.get_by_role("slider").first          # the pause between steps: none, to keep the test short
    slider.focus()
    slider.press("Home")
    page.get_by_role("button", name=re.compile("Start live run")).click()
    page.get_by_text(re.compile(r"engine (done|error|crashed|stopped)")).first.wait_for(timeout=480_000)
    page.wait_for_timeout(3000)        # the last full render (views/live.py: live_final)
    settle_drawn(page)
    _shot(page, "1-three-process-tour-done")
    text = _main_text(page)
    assert "engine done" in text, text[:3000]
    assert "Traceback" not in text and "400 Bad Request" not in text and "refused" not in text, text[:3000]
    assert page.locator("[data-testid='stException']").count() == 0
    shown, committed = map(int, re.search(r"Step (\d+) of (\d+) committed", text).groups())
    side = page.get_by_test_id("stSidebar").get_by_text(re.compile(r"Live engine: .*step \d+")).first.inner_text()
    assert shown == committed == int(re.search(r"step (\d+)", side)[1]), (shown, committed, side)
    assert committed >= 30, committed       # the whole tour, not a stop at step 28


# -- 2 ------------------------------------------------------------------------------------------
def test_2_request_ids_read_the_same_on_chips_and_in_tables(server, page):
    _open(page, f"{server}/inspector?run={P3}&page=inspector&step=1&tab=Scheduler", "Step inspector")
    # (a dataframe draws on a canvas; its cells are also an accessible table of zero size: attached, not visible)
    page.locator("[data-testid=stDataFrame] td").first.wait_for(state="attached")
    chips = set(re.findall(r"req (\S+)", " ".join(page.locator("span[title^='request ']").all_inner_texts())))
    cells = page.evaluate("() => [...document.querySelectorAll('[data-testid=stDataFrame]')[0]"
                          ".querySelectorAll('td')].map(t => t.textContent)")
    ids = [c for c in cells if c.startswith("chatcmpl")]
    assert ids and all(c in chips for c in ids), (ids, chips)
    _open(page, f"{server}/processes?run={P3}&page=processes&step=1", "Processes")
    hops = " ".join(page.locator("[data-testid=stTable]").first.inner_text().split())
    assert any(f"EngineCoreRequest {c}" in hops for c in chips), (hops[:600], chips)


# -- 3 ------------------------------------------------------------------------------------------
def test_3_async_scheduling_is_explained_on_the_timeline(server, page):
    _open(page, f"{server}/timeline?run={P1}&page=timeline", "Timeline")
    note = page.locator(".st-key-async_note")
    note.wait_for()
    text = " ".join(note.inner_text().split())
    assert "Async scheduling is on" in text and "§五" in text and "get_output" in text and "one step later" in text
    main = _main_text(page)
    assert "total wait 0.00 ms" not in main and re.search(r"sync points in AsyncGPUModelRunnerOutput.get_output", main)
    legend = page.evaluate("() => [...document.querySelectorAll('.st-key-timeline_chart .legendtext')]"
                           ".map(t => t.textContent)")
    assert "sync point (async: get_output)" in legend and "sync point (CPU waits for the GPU)" not in legend, legend
    _shot(page, "3-timeline-async")


# -- 4 ------------------------------------------------------------------------------------------
def test_4_the_block_trail_reaches_reshape_and_cache(server, page):
    worker = "Worker+%28model+runner%29"
    _open(page, f"{server}/inspector?run={P1}&page=inspector&step=1&tab={worker}", "Step inspector")
    page.get_by_text(re.compile(r"reshape_and_cache writes each token")).first.wait_for()
    assert re.search(r"reshape_and_cache writes each token's K and V to its slot, in every layer: 30 launches",
                     _main_text(page)), "eager step 1: its 30 launches"
    _open(page, f"{server}/inspector?run={P1}&page=inspector&step=5&tab={worker}", "Step inspector")
    page.get_by_text(re.compile(r"reshape_and_cache writes each token")).first.wait_for()
    assert "it ran inside this step's CUDA graph replay" in _main_text(page)
    _open(page, f"{server}/selftest?run={P1}&page=selftest", "Self-test")
    q3 = " ".join(page.locator(".st-key-q_q3").inner_text().split())
    row = re.search(r"reshape_and_cache \(Attention.do_kv_cache_update\)(.*?)unified_attention", q3)
    assert row and "slot" in row[1] and re.search(r"launches of reshape_and_cache|CUDA graph|graph piece", row[1]), q3
    _shot(page, "4-selftest-q3")


# -- 5 ------------------------------------------------------------------------------------------
def test_5_the_processes_chain_table_agrees_with_itself(server, page):
    _open(page, f"{server}/processes?run={P3}&page=processes&step=1", "Processes")
    rows = {}
    for tr in page.locator("[data-testid=stTable]").nth(1).locator("tbody tr").all():
        cells = [" ".join(c.split()) for c in tr.locator("th, td").all_inner_texts()]
        rows[cells[0]] = cells
    assert "AsyncLLM.add_request" in " ".join(rows["②"]), rows["②"]       # ① and ③ found it: so does ②
    assert "not in this run" not in " ".join(rows["⑧"]), rows["⑧"]        # a CUDA run
    last = page.locator("[data-testid=stTable]").nth(1).locator("tbody tr").last
    assert "⑪" in last.inner_text() and last.bounding_box()["height"] > 10
    ticks = _ticks(page, "proc_fig")
    assert any("EngineCoreProc" in t and "run_busy_loop()" in t for t in ticks), ticks
    _shot(page, "5-processes-3proc")


# -- 6 ------------------------------------------------------------------------------------------
def _tabs_in_view(pg, timeout_s: float = 25) -> float:
    deadline, top = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        top = pg.evaluate("() => { const t = document.querySelector('[data-testid=stTabs]');"
                          " return t ? t.getBoundingClientRect().top : null }")
        if top is not None and 0 <= top < 900:
            return top
        pg.wait_for_timeout(300)
    raise AssertionError(f"the tab bar stayed at y={top}, outside the 900 px window")


def test_6_deep_links_land_on_the_tab_and_outline_the_request(server, page):
    _open(page, f"{server}/inspector?run={P1}&page=inspector&step=48&tab=KV+cache&request=7", "Step inspector")
    _tabs_in_view(page)
    assert page.locator("[role=tab][aria-selected=true]").first.inner_text() == "KV cache"
    focus = page.locator(".st-key-va_focus")
    assert "req 7" in focus.inner_text() and -2 <= focus.bounding_box()["y"] < 900
    outlined = page.evaluate("() => [...document.querySelectorAll('span[title]')].filter(s => "
                             "getComputedStyle(s).outlineStyle === 'solid').map(s => s.title)")
    assert outlined and all(t == "request 7" or t.startswith("request 7:") for t in outlined), outlined
    _shot(page, "6-deep-link-landed")
    _open(page, f"{server}/selftest?run={P1}&page=selftest", "Self-test")
    page.locator(".st-key-show_q1_0 button").first.click()
    page.get_by_role("heading", name="Step inspector", exact=True).wait_for()
    settle_drawn(page)
    _tabs_in_view(page)
    _shot(page, "6-show-me-landed")


# -- 7 ------------------------------------------------------------------------------------------
def _overlaps(boxes: list) -> list:
    out = []
    for i, (a, r) in enumerate(boxes):
        for b, s in boxes[i + 1:]:
            if min(r["right"], s["right"]) - max(r["left"], s["left"]) > 2 and \
                    min(r["bottom"], s["bottom"]) - max(r["top"], s["top"]) > 2:
                out.append((a, b))
    return out


def test_7_tensor_parallelism_reads(server, page):
    worker = "Worker+%28model+runner%29"
    _open(page, f"{server}/inspector?run={TP}&page=inspector&step=5&tab={worker}", "Step inspector")
    text = _main_text(page)
    assert "Tensor parallel over 3 ranks" in text and "61 = 2 × 30 layers + 1 (the vocab-parallel embedding)" in text
    assert "160 = 2 × 80 layers" in text, text[:2000]
    _open(page, f"{server}/processes?run={TP}&page=processes&step=5", "Processes")
    page.locator(".st-key-proc_fig .ytick").first.wait_for()
    ticks = _ticks(page, "proc_fig")
    assert [t for t in ticks if t.startswith("WorkerProc") and "collectives" in t], ticks
    labels = page.evaluate("() => [...document.querySelectorAll('.st-key-proc_fig .annotation-text')]"
                           ".filter(t => /ms$/.test(t.textContent.trim()))"
                           ".map(t => [t.textContent, t.getBoundingClientRect().toJSON()])")
    assert labels and not _overlaps(labels), _overlaps(labels)
    llm = next(t for t in ticks if t.startswith("LLM process · pid"))
    pid = re.search(r"pid (\d+)", llm)[1]
    _shot(page, "7-processes-tp3")
    _open(page, f"{server}/timeline?run={TP}&page=timeline&step=5", "Timeline")
    tl = _ticks(page, "timeline_chart")
    assert any(t.startswith(f"LLM process · pid {pid}") for t in tl), tl      # the same name on both pages
    assert any(t.startswith("WorkerProc rank 0") for t in tl), tl


# -- 8 ------------------------------------------------------------------------------------------
def _lit_edges(pg) -> list[str]:
    return pg.evaluate("() => [...document.querySelectorAll('[data-testid=stGraphVizChart] g.edge')]"
                       f".filter(g => (g.querySelector('path')?.getAttribute('stroke') || '').toLowerCase() === '{EDGE}')"
                       ".map(g => g.querySelector('title').textContent)")


def test_8_the_waiting_to_running_card_lights_that_edge(server, page):
    _open(page, f"{server}/lessons?run={P1}&page=lessons", "Lessons")
    page.locator(".st-key-lesson_admit button").first.click()
    page.get_by_role("heading", name="Step inspector", exact=True).wait_for()
    settle_drawn(page)
    page.locator("[data-testid=stGraphVizChart] svg").first.wait_for()
    assert "WAITING->RUNNING" in _lit_edges(page), _lit_edges(page)
    assert "ARRIVAL" not in _main_text(page)
    _shot(page, "8-admit-card")
    # a request admitted the step it arrived (the three-process sample's first): both edges it passed light up
    _open(page, f"{server}/inspector?run={P3}&page=inspector&step=1", "Step inspector")
    page.locator("[data-testid=stGraphVizChart] svg").first.wait_for()
    lit = _lit_edges(page)
    assert {"WAITING->RUNNING"} <= set(lit) and any(e.endswith("->WAITING") for e in lit), lit
    assert "arrived → WAITING → RUNNING" in _main_text(page)


# -- 9 ------------------------------------------------------------------------------------------
SIZES_JS = """() => {
  const bad = [];
  for (const c of document.querySelectorAll('[data-testid=stMain] code')) {
    const px = parseFloat(getComputedStyle(c).fontSize);
    if (c.getBoundingClientRect().width > 0 && px < 11.9) bad.push(['code', c.textContent.slice(0, 30), px]);
  }
  for (const svg of document.querySelectorAll('[data-testid="stGraphVizChart"] svg')) {
    const scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
    for (const t of svg.querySelectorAll('text')) {
      const px = parseFloat(t.getAttribute('font-size')) * scale;
      if (px < 11.5) bad.push(['state machine', t.textContent, px]);
    }
  }
  return bad;
}"""


def test_9_no_text_under_12_px_and_samples_told_apart(server, page):
    from dashboard.answers.source import RunSource
    src = RunSource(os.path.join(SAMPLES, P3))
    changes = {s: sum(1 for seen in src.statuses.values() if s in seen and seen.get(src.prev_step(s)) != seen[s])
               for s in src.steps[1:]}
    busy = max(changes, key=changes.get)              # the step that lights the most requests
    _open(page, f"{server}/inspector?run={P3}&page=inspector&step={busy}", "Step inspector")
    page.locator("[data-testid=stGraphVizChart] svg").first.wait_for()
    assert not page.evaluate(SIZES_JS), page.evaluate(SIZES_JS)[:8]
    _open(page, f"{server}/processes?run={P3}&page=processes&step=1", "Processes")
    clipped = page.evaluate("""() => { const svg = document.querySelector('.st-key-proc_fig .main-svg');
        const w = svg.getBoundingClientRect().right;
        return [...document.querySelectorAll('.st-key-proc_fig .annotation-text')]
          .filter(t => t.getBoundingClientRect().right > w + 1).map(t => t.textContent) }""")
    assert not clipped, clipped
    page.get_by_test_id("stSidebar").locator("[data-testid=stSelectbox]").first.click()
    options = [o for o in page.get_by_role("option").all_inner_texts() if o.startswith("sample · ")]
    assert len(options) == 3 and len({o[:28] for o in options}) == 3, options      # what the sidebar shows
    assert any("3 processes" in o for o in options) and any("TP 3" in o for o in options), options
    _shot(page, "9-run-picker")


# -- 10 -----------------------------------------------------------------------------------------
@pytest.mark.model
def test_10_the_first_live_minute(server, page):
    _open(page, f"{server}/", None)
    page.get_by_role("button", name="Open the self-test").click()
    page.get_by_role("heading", name="Self-test", exact=True).wait_for()
    settle_drawn(page)
    assert "Answer, from this run" in _main_text(page)          # a sample's answers, not "No run is open"
    _shot(page, "10-selftest-from-the-start-page")
    _open(page, f"{server}/", None)
    page.get_by_role("button", name="Start the guided tour").click()
    page.get_by_text(re.compile(r"Step \d+ of \d+ committed")).first.wait_for(timeout=240_000)
    t_first = time.monotonic()
    bar = page.locator("[data-testid=va-budget-bar] div").first
    bar.wait_for()
    assert bar.bounding_box()["width"] > 20 and "req" in bar.inner_text()
    _shot(page, "10-live-first-step")
    page.wait_for_timeout(max(0.0, 10.0 - (time.monotonic() - t_first)) * 1000)
    text = _main_text(page)
    assert "engine running" in text, text[:1500]              # still teaching 10 s after its first step
    page.get_by_role("button", name=re.compile("Stop engine")).click()
    page.get_by_text(re.compile(r"engine (stopped|done)")).first.wait_for(timeout=60_000)
