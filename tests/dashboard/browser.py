"""What the real-browser tests share: a Streamlit server of the dashboard on a free
127.0.0.1 port, Debian's Chromium driven by Playwright (never a downloaded
browser), pages that record every request leaving the machine, and waiting for a
script run to end.

    with streamlit_server(trace_dir, samples_dir) as base:   # "http://127.0.0.1:PORT"
        with chromium() as browser:
            ctx, pg = new_page(browser)
            pg.goto(f"{base}/timeline?run=...")
            settle(pg)
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

from tests.dashboard.conftest import APP, ROOT

CHROMIUM = "/usr/bin/chromium"
# NOTE: without the background-networking flags Chromium keeps trying hosts this
# machine cannot reach (and the offline tests would see them as the page's requests).
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
SHOTS = os.path.join(ROOT, "test-output", "screenshots")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def streamlit_server(trace_dir: str, samples_dir: str, log_dir: str, **env: str) -> Iterator[str]:
    """Serve dashboard/app.py as `vllm-anatomy dashboard` does (the repository's
    .streamlit/config.toml applies) until healthy; yield its base URL; stop it."""
    port = free_port()
    log = open(os.path.join(log_dir, "streamlit.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", APP, "--server.headless", "true",
                             "--server.address", "127.0.0.1", "--server.port", str(port),
                             "--browser.gatherUsageStats", "false"],
                            env={**os.environ, "VLLM_ANATOMY_TRACE_DIR": str(trace_dir),
                                 "VLLM_ANATOMY_SAMPLES_DIR": str(samples_dir), **env},
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if urllib.request.urlopen(base + "/_stcore/health", timeout=1).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def chromium():
    """A headless Chromium (skips the test where Debian's chromium is missing)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Debian chromium is not installed at {CHROMIUM}")
    from playwright.sync_api import sync_playwright
    os.makedirs(SHOTS, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


def is_external(url: str) -> bool:
    return not url.startswith(("data:", "blob:")) and \
        (urllib.parse.urlsplit(url).hostname or "") not in LOCAL_HOSTS


def new_page(browser, width: int = 1440, height: int = 900, timeout_ms: int = 60_000, block: bool = False):
    """(context, page) at width x height; `page.external` lists every request to another
    host (with block=True they are also refused, so a missing font shows on screen)."""
    ctx = browser.new_context(viewport={"width": width, "height": height})
    pg = ctx.new_page()
    pg.set_default_timeout(timeout_ms)
    pg.external = []
    if block:
        def route(r):
            if is_external(r.request.url):
                pg.external.append(r.request.url)
                r.abort()
            else:
                r.continue_()
        ctx.route("**/*", route)
    else:
        pg.on("request", lambda r: pg.external.append(r.url) if is_external(r.url) else None)
    return ctx, pg


def settle(pg, before_ms: int = 400, after_ms: int = 500, timeout_ms: int = 90_000) -> None:
    """Wait until the script run is over (Streamlit's "running" widget is gone) and charts are drawn."""
    pg.wait_for_timeout(before_ms)
    pg.wait_for_function("!document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout_ms)
    pg.wait_for_timeout(after_ms)


def settle_drawn(pg) -> None:
    """settle, then wait until no element is a loading skeleton any more (a slow machine draws late), and
    settle again: the page as a reader sees it."""
    settle(pg, 600, 600, 180_000)
    pg.wait_for_function("!document.querySelector('[data-testid=\"stSkeleton\"]')", timeout=180_000)
    settle(pg, 300, 500, 180_000)
