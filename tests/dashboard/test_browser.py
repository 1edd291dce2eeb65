"""The dashboard in a real browser (Debian's Chromium driven by Playwright): serve
it on a free 127.0.0.1 port, open the recorded run, move the step scrubber with
the keyboard, visit every page, then start a short live run on the default model
and watch its steps arrive. Screenshots go to test-output/screenshots/."""
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.dashboard.conftest import APP, ROOT

pytestmark = [pytest.mark.model, pytest.mark.slow]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
SHOTS = os.path.join(ROOT, "test-output", "screenshots")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(recorded_run, tmp_path_factory):
    trace_dir, path = recorded_run
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "streamlit.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", APP, "--server.headless", "true",
                             "--server.address", "127.0.0.1", "--server.port", str(port),
                             "--browser.gatherUsageStats", "false"],
                            env={**os.environ, "VLLM_ANATOMY_TRACE_DIR": trace_dir}, stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            if urllib.request.urlopen(base + "/_stcore/health", timeout=1).read() == b"ok":
                break
        except OSError:
            time.sleep(0.5)
    yield base, os.path.basename(path)
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture(scope="module")
def page():
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian chromium is not installed at /usr/bin/chromium")
    from playwright.sync_api import sync_playwright
    os.makedirs(SHOTS, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page(viewport={"width": 1500, "height": 1000})
        pg.set_default_timeout(60_000)
        yield pg
        browser.close()


def _settle(pg) -> None:
    """Wait until the script run is over (Streamlit's "running" widget is gone)."""
    pg.wait_for_timeout(500)
    pg.wait_for_function("!document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
    pg.wait_for_timeout(700)


def test_scrubber_moves_the_inspector(server, page):
    base, run = server
    page.goto(f"{base}/inspector?run={run}&step=1")
    page.get_by_text(re.compile(r"step 1 · 1 of \d+ committed")).wait_for()
    _settle(page)
    before = page.get_by_text("total_num_scheduled_tokens").first.inner_text()
    page.screenshot(path=os.path.join(SHOTS, "inspector-step1.png"), full_page=True)
    page.get_by_role("slider").first.focus()
    page.keyboard.press("ArrowRight")
    page.get_by_text(re.compile(r"step 2 · 2 of \d+ committed")).wait_for()
    _settle(page)
    after = page.get_by_text("total_num_scheduled_tokens").first.inner_text()
    assert before != after and "step 2" in after
    assert "step=2" in page.url
    page.screenshot(path=os.path.join(SHOTS, "inspector-step2.png"), full_page=True)


@pytest.mark.parametrize("name,title", [("timeline", "Timeline"), ("journey", "Request journey"),
                                        ("metrics", "Metrics over time"), ("lessons", "Lessons")])
def test_pages_render(server, page, name, title):
    base, run = server
    page.goto(f"{base}/{name}?run={run}&step=5")
    page.get_by_role("heading", name=title).wait_for()
    _settle(page)
    assert page.locator("[data-testid='stException']").count() == 0
    page.screenshot(path=os.path.join(SHOTS, f"{name}.png"), full_page=True)


def test_live_run_streams_steps(server, page):
    base, _ = server
    page.goto(f"{base}/")   # the default page lives at /
    page.get_by_role("heading", name="Live run").wait_for()
    _settle(page)
    page.get_by_label("Shared system prompt").fill("")
    page.locator("textarea").first.fill("What is 2 + 2?\n[+2] Name a colour.")
    page.get_by_label("max_tokens").fill("4")
    page.screenshot(path=os.path.join(SHOTS, "live-form.png"), full_page=True)
    page.get_by_role("button", name=re.compile("Start live run")).click()
    page.get_by_text(re.compile(r"Step \d+ of \d+ committed")).wait_for(timeout=240_000)
    first = int(re.search(r"of (\d+)", page.get_by_text(re.compile(r"Step \d+ of \d+ committed")).inner_text())[1])
    try:
        page.get_by_text(re.compile(r"engine done")).wait_for(timeout=240_000)
    finally:
        page.screenshot(path=os.path.join(SHOTS, "live-run.png"), full_page=True)
    _settle(page)
    last = int(re.search(r"of (\d+)", page.get_by_text(re.compile(r"Step \d+ of \d+ committed")).inner_text())[1])
    assert last > first >= 1
    page.screenshot(path=os.path.join(SHOTS, "live-run.png"), full_page=True)
