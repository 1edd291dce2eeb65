"""The dashboard's pages in a real browser (Debian's Chromium driven by Playwright), on
the shipped GPU sample run, one Streamlit server for the module:

* every chart that invites a click is clicked (the Timeline's step strip and spans,
  the Journey's steps, every Metrics chart): the point under the mouse is read from
  Plotly's hover label first, and the page must land on that step (no exception);
* every lesson card's link is followed: the page, step, inspector tab and request it
  lands on are the ones the link names, and the card's idea is on screen;
* every page (and every inspector tab) at 1440×900 and 1920×1080: screenshots of the whole
  page under test-output/screenshots/pages-<view>-<size>.png, and the readability rules of issue 15 — no
  chart text under 12 px (Plotly and the state-machine SVG, whose text is dark), no
  two chart labels overlapping, every coloured chip's text at contrast ≥ 4.5, and the
  tables with key columns (block_ids, new_block_ids) without a horizontal scroll;
* no request leaves 127.0.0.1.
"""
from __future__ import annotations

import os
import re
import sqlite3
import urllib.parse

import pytest

from tests.dashboard.browser import SHOTS, new_page, settle, streamlit_server
from tests.dashboard.conftest import GPU_SAMPLE

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not os.path.exists(GPU_SAMPLE),
                                                   reason="samples/h100-smollm2-full.sqlite not shipped")]
RUN = os.path.basename(GPU_SAMPLE)
SIZES = [(1440, 900), (1920, 1080)]
TITLES = {"timeline": "Timeline", "inspector": "Step inspector", "journey": "Request journey",
          "metrics": "Metrics over time", "lessons": "Lessons", "mapping": None}
# The views of the readability pass: (name, path and query).
VIEWS = [("timeline", "timeline?run={run}"),
         ("inspector-scheduler", "inspector?run={run}&step=15&tab=Scheduler"),
         ("inspector-kv", "inspector?run={run}&step=15&tab=KV+cache"),
         ("inspector-worker", "inspector?run={run}&step=14&tab=Worker+%28model+runner%29"),
         ("journey", "journey?run={run}&step=15&request=7"),
         ("metrics", "metrics?run={run}&step=15"),
         ("lessons", "lessons?run={run}"),
         ("mapping", "mapping?run={run}")]
KEY_TABLES = ["sched_new", "sched_cached", "input_batch_rows", "journey_steps"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One Streamlit server: an empty trace dir, a samples dir holding a copy of the GPU sample."""
    samples, traces = tmp_path_factory.mktemp("samples"), tmp_path_factory.mktemp("traces")
    src, dst = sqlite3.connect(f"file:{GPU_SAMPLE}?immutable=1", uri=True), sqlite3.connect(samples / RUN)
    src.backup(dst)
    src.close()
    dst.close()
    with streamlit_server(traces, samples, tmp_path_factory.mktemp("server")) as base:
        yield base


@pytest.fixture
def page(browser):
    """A fresh page (its own Streamlit session) that records every request to a non-local host."""
    ctx, pg = new_page(browser)
    yield pg
    external = list(pg.external)
    ctx.close()
    assert not external, f"requests left the machine: {external[:5]}"


def _settle(pg) -> None:
    settle(pg, 300, 400)


def _open(pg, base: str, path: str, title: str | None) -> None:
    pg.goto(f"{base}/{path}")
    if title:
        pg.get_by_role("heading", name=title, exact=True).wait_for()
    else:
        pg.wait_for_selector("h1")
    _settle(pg)
    _no_exception(pg)


def _no_exception(pg) -> None:
    exc = pg.locator("[data-testid='stException']")
    assert exc.count() == 0, exc.first.inner_text()[:2000]


def _query(pg) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlparse(pg.url).query).items()}


def _inspector_step(pg) -> int:
    text = pg.get_by_text(re.compile(r"of \d+ committed")).first.inner_text()
    m = re.search(r"step (\d+) · \d+ of \d+ committed", text)
    assert m, text
    return int(m[1])


# -- clicking charts ----------------------------------------------------------------------------
def _points(pg, key: str, selector: str) -> list[dict]:
    """Boxes (viewport coordinates) of the drawn points of the chart keyed `key`, widest first."""
    return pg.evaluate("""([key, sel]) => {
        const root = document.querySelector('.st-key-' + key);
        if (!root) return [];
        return [...root.querySelectorAll(sel)].map(e => e.getBoundingClientRect())
          .filter(r => r.width > 1 && r.height > 1 && r.top >= 0 && r.bottom <= innerHeight)
          .map(r => ({x: r.x + r.width / 2, y: r.y + r.height / 2, w: r.width}))
          .sort((a, b) => b.w - a.w);
    }""", [key, selector])


def _click_step(pg, key: str, selector: str, pick=lambda pts: pts[len(pts) // 2]) -> int:
    """Hover a point of the chart keyed `key`, read its step from the hover label, click it; the step."""
    pg.locator(f".st-key-{key}").evaluate("e => e.scrollIntoView({block: 'center'})")
    pts = []
    for _ in range(40):           # the chart draws after the script run is over
        pg.wait_for_timeout(250)
        pts = _points(pg, key, selector)
        if pts:
            break
    assert pts, f"no point drawn in the chart {key}"
    _settle(pg)                   # (a widget bound to the URL may rerun the page once more)
    pg.locator(f".st-key-{key}").evaluate("e => e.scrollIntoView({block: 'center'})")
    pg.wait_for_timeout(200)
    pts = _points(pg, key, selector) or pts
    seen = []
    for pt in ([pick(pts)] + pts)[:30]:
        pg.mouse.move(pt["x"] - 30, pt["y"] - 30)
        pg.mouse.move(pt["x"], pt["y"], steps=3)
        pg.wait_for_timeout(300)
        label = pg.evaluate("() => [...document.querySelectorAll('.hoverlayer text')].map(t => t.textContent).join(' ')")
        seen.append(label[:60])
        m = re.search(r"step (\d+)", label) or re.search(r"^\(?(\d+),", label.strip())
        if m:
            pg.mouse.click(pt["x"], pt["y"])
            return int(m[1])
    pg.screenshot(path=os.path.join(SHOTS, f"failed-click-{key}.png"))
    raise AssertionError(f"no hover label with a step in the chart {key}: {seen[:10]} at {pts[:3]}")


def test_timeline_strip_and_spans_are_clickable(server, page):
    _open(page, server, f"timeline?run={RUN}", "Timeline")
    # the strip: a click moves the window to that step, on this page
    step = _click_step(page, "step_durations", "path.point", pick=lambda pts: pts[len(pts) * 3 // 4])
    page.wait_for_function(f"location.search.includes('step={step}')")
    _settle(page)
    _no_exception(page)
    caption = page.get_by_text(re.compile(r"spans in steps \d+–\d+")).first.inner_text()
    a, b = map(int, re.search(r"steps (\d+)–(\d+)", caption).groups())
    assert a <= step <= b and page.get_by_role("heading", name="Timeline").count() == 1
    # the spans: a click opens that step in the inspector
    step = _click_step(page, "timeline_chart", "g.point path", pick=lambda pts: pts[0])
    page.get_by_role("heading", name="Step inspector").wait_for()
    _settle(page)
    _no_exception(page)
    assert _inspector_step(page) == step and _query(page)["step"] == str(step)


def test_journey_steps_are_clickable(server, page):
    _open(page, server, f"journey?run={RUN}&request=7&step=15", "Request journey")
    step = _click_step(page, "journey_fig", "path.point")
    page.get_by_role("heading", name="Step inspector").wait_for()
    _settle(page)
    _no_exception(page)
    assert _inspector_step(page) == step and _query(page)["step"] == str(step)


@pytest.mark.parametrize("chart", ["tokens", "queues", "kv", "preemptions", "throughput"])
def test_metrics_charts_are_clickable(server, page, chart):
    _open(page, server, f"metrics?run={RUN}&step=15", "Metrics over time")
    selector = "g.point path" if chart == "tokens" else "path.point"
    step = _click_step(page, f"metric_{chart}", selector,
                       pick=(lambda pts: pts[0]) if chart == "tokens" else (lambda pts: pts[len(pts) // 3]))
    page.get_by_role("heading", name="Step inspector").wait_for()
    _settle(page)
    _no_exception(page)
    assert _inspector_step(page) == step


# -- lesson links -------------------------------------------------------------------------------
def test_every_lesson_link_lands(server, page):
    from dashboard.components.tabs import TABS
    from dashboard.lessons import BY_KEY
    _open(page, server, f"lessons?run={RUN}", "Lessons")
    cards = page.evaluate("""() => [...document.querySelectorAll('[class*="st-key-card_"]')].map(c => {
        const a = c.querySelector('a[href*="?run="]');
        return [c.className.match(/st-key-card_(\\w+)/)[1], a ? a.getAttribute('href') : null];
    })""")
    linked = [(k, href) for k, href in cards if href]
    assert len(linked) >= 12, cards        # the GPU sample shows (nearly) every concept
    for key, href in linked:
        lesson = BY_KEY[key]
        path, _, qs = href.partition("?")
        q = {k: v[0] for k, v in urllib.parse.parse_qs(qs).items()}
        assert path.strip("/") == lesson.page == q["page"] and q.get("tab") == (TABS[lesson.tab] if lesson.tab else None)
        _open(page, server, href.lstrip("/"), TITLES[lesson.page])
        landed = _query(page)
        assert landed.get("step") == q["step"] and landed.get("run") == RUN, (key, page.url)
        if lesson.page == "inspector":
            assert _inspector_step(page) == int(q["step"]), key
            selected = page.locator("[role=tab][aria-selected=true]").first.inner_text()
            assert selected == TABS[lesson.tab], (key, selected)
        if lesson.page == "timeline":
            caption = page.get_by_text(re.compile(r"spans in steps \d+–\d+")).first.inner_text()
            a, b = map(int, re.search(r"steps (\d+)–(\d+)", caption).groups())
            assert a <= int(q["step"]) <= b, key
        body = page.locator("[data-testid=stMain]").inner_text()
        if key == "preempt":
            assert f"req {q['request']}: RUNNING → PREEMPTED" in body and "KV block pool" in body
        if key == "finish":
            assert re.search(rf"req {q['request']}: RUNNING → FINISHED_\w+", body) and "free" in body
        if key == "prefix":
            assert f"prefix-cache hit: req {q['request']}" in body.replace("\n", " ")
    # a card's button lands where its link does
    _open(page, server, f"lessons?run={RUN}", "Lessons")
    page.locator(".st-key-lesson_preempt button").first.click()
    page.get_by_role("heading", name="Step inspector").wait_for()
    _settle(page)
    assert page.locator("[role=tab][aria-selected=true]").first.inner_text() == TABS["kv"]
    assert _query(page).get("tab") == TABS["kv"]


# -- the readability pass -----------------------------------------------------------------------
READABILITY_JS = """(keyTables) => {
  const bad = [];
  const visible = el => { const r = el.getBoundingClientRect(); const cs = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && cs.display !== 'none' && cs.visibility !== 'hidden'
      && parseFloat(cs.opacity || '1') > 0.05 && parseFloat(el.getAttribute('opacity') ?? '1') > 0.05; };
  const rgb = s => { const m = s.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const v = m[1].split(',').map(x => parseFloat(x)); return v.length > 3 && v[3] < 0.5 ? null : v.slice(0, 3); };
  const hex = s => { const m = (s || '').match(/^#([0-9a-f]{6})$/i); if (!m) return null;
    return [0, 2, 4].map(i => parseInt(m[1].slice(i, i + 2), 16)); };
  const lum = c => { const l = c.map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * l[0] + 0.7152 * l[1] + 0.0722 * l[2]; };
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  // Plotly: every visible text at 12 px or more, and no two texts of a chart overlapping
  for (const plot of document.querySelectorAll('.js-plotly-plot')) {
    const texts = [...plot.querySelectorAll('text')].filter(t => t.textContent.trim() && visible(t));
    const boxes = [];
    for (const t of texts) {
      const px = parseFloat(getComputedStyle(t).fontSize);
      if (px < 11.5) bad.push(['plotly text under 12 px', t.textContent.slice(0, 40), px]);
      if (t.closest('.hoverlayer')) continue;
      const r = t.getBoundingClientRect();
      boxes.push([t.textContent.slice(0, 30), r]);
    }
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
      const [a, r] = boxes[i], [b, s] = boxes[j];
      const w = Math.min(r.right, s.right) - Math.max(r.left, s.left), h = Math.min(r.bottom, s.bottom) - Math.max(r.top, s.top);
      if (w > 2 && h > 2) bad.push(['overlapping chart labels', a, b]);
    }
  }
  // the state machine (Graphviz SVG, scaled to its column): text at 12 px or more, dark on light
  for (const svg of document.querySelectorAll('[data-testid="stGraphVizChart"] svg')) {
    const vb = svg.viewBox.baseVal, w = svg.getBoundingClientRect().width;
    const scale = vb && vb.width ? w / vb.width : 1;
    for (const t of svg.querySelectorAll('text')) {
      const px = parseFloat(t.getAttribute('font-size')) * scale;
      if (px < 11.5) bad.push(['state-machine text under 12 px', t.textContent, px]);
      const fill = hex(t.getAttribute('fill'));
      const node = t.closest('g.node'), shape = node && node.querySelector('path, polygon, ellipse');
      const bg = (shape && hex(shape.getAttribute('fill'))) || [255, 255, 255];
      if (fill && ratio(fill, bg) < 4.5) bad.push(['state-machine text contrast', t.textContent, ratio(fill, bg).toFixed(2)]);
    }
  }
  // coloured chips (inline background): text contrast 4.5 or more
  for (const el of document.querySelectorAll('[data-testid=stMain] span[style*="background"], [data-testid=stMain] div[style*="background:#"]')) {
    if (!visible(el) || !el.textContent.trim() || (el.getAttribute('style') || '').includes('gradient')) continue;
    const fg = rgb(getComputedStyle(el).color), bg = rgb(getComputedStyle(el).backgroundColor);
    if (fg && bg && ratio(fg, bg) < 4.5) bad.push(['chip contrast', el.textContent.slice(0, 30), ratio(fg, bg).toFixed(2)]);
  }
  // tables with key columns: every column visible, no horizontal scroll
  for (const key of keyTables) {
    const el = document.querySelector('.st-key-' + key + ' .dvn-scroller');
    if (el && el.scrollWidth > el.clientWidth + 2) bad.push(['table scrolls sideways', key, el.scrollWidth, el.clientWidth]);
  }
  return bad;
}"""


@pytest.mark.parametrize("width,height", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_every_page_is_readable(server, page, width, height):
    page.set_viewport_size({"width": width, "height": height})
    problems = {}
    for name, path in VIEWS:
        _open(page, server, path.format(run=RUN), TITLES.get(name.split("-")[0]))
        # the whole page: a viewport as tall as the content (the app scrolls inside its own container)
        full = page.evaluate("Math.max(...[...document.querySelectorAll('[data-testid=stMain], section')]"
                             ".map(e => e.scrollHeight))")
        page.set_viewport_size({"width": width, "height": max(height, min(int(full) + 40, 12000))})
        _settle(page)
        page.screenshot(path=os.path.join(SHOTS, f"pages-{name}-{width}x{height}.png"))
        bad = page.evaluate(READABILITY_JS, KEY_TABLES)
        if bad:
            problems[name] = bad[:8]
        page.set_viewport_size({"width": width, "height": height})
    assert not problems, problems
