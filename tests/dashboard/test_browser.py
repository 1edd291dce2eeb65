"""The dashboard in a real browser (Debian's Chromium driven by Playwright): serve
it on a free 127.0.0.1 port, open the recorded run and move the step scrubber with
the keyboard; open the GPU sample run from the "No GPU here?" button and look at a
graph replay, an eager step's layers and kernels, and the device lane. (A live run
from the start strip: test_browser_shell.py.) Screenshots go to test-output/screenshots/ (the gpu-* ones from the real
GPU sample when samples/h100-smollm2-full.sqlite exists, else from the
GPU-shaped copy of the fixture run). Every page at 1440x900 and 1920x1080, clicks on
every chart, lesson links and the readability checks: test_browser_pages.py."""
import os
import re

import pytest

from tests.dashboard.browser import SHOTS, new_page, settle, streamlit_server
from tests.dashboard.conftest import GPU_SAMPLE_NAME, GPU_SAMPLE

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def browser_samples(samples, tmp_path_factory):
    """The samples directory the server sees: the real GPU sample if it is there, else the
    GPU-shaped fixture run. {"dir", "name", "graph_step", "eager_step"}"""
    from tests.dashboard.gpu_run import copy_run, pick_steps
    sdir = str(tmp_path_factory.mktemp("browser_samples"))
    src = GPU_SAMPLE if os.path.exists(GPU_SAMPLE) else samples["gpu"]
    name = os.path.basename(src) if src == GPU_SAMPLE else GPU_SAMPLE_NAME
    copy_run(src, os.path.join(sdir, name))
    return {"dir": sdir, "name": name, **pick_steps(os.path.join(sdir, name))}


@pytest.fixture(scope="module")
def server(recorded_run, browser_samples, tmp_path_factory):
    trace_dir, path = recorded_run
    with streamlit_server(trace_dir, browser_samples["dir"], tmp_path_factory.mktemp("server")) as base:
        yield base, os.path.basename(path)


@pytest.fixture(scope="module")
def page(browser):
    _, pg = new_page(browser, 1500, 1000)
    yield pg


def _settle(pg) -> None:
    settle(pg, 500, 700, timeout_ms=60_000)


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


def _worker_tab(pg) -> None:
    pg.get_by_role("tab", name="Worker (model runner)").click()
    _settle(pg)


def test_gpu_sample_from_a_cpu_machine(server, browser_samples, page):
    base, _ = server
    name = browser_samples["name"]
    page.set_viewport_size({"width": 1500, "height": 2300})   # the Worker tab is long: shoot it whole
    try:
        _gpu_sample_pages(page, base, name, browser_samples)
    finally:
        page.set_viewport_size({"width": 1500, "height": 1000})


def _gpu_sample_pages(page, base, name, browser_samples) -> None:
    page.goto(f"{base}/")
    button = page.get_by_role("button", name=re.compile(r"No GPU here\? Open the .* sample run")).last
    button.wait_for()
    _settle(page)
    page.screenshot(path=os.path.join(SHOTS, "live-gpu-sample-hint.png"), full_page=True)
    button.click()
    page.get_by_role("heading", name="Step inspector").wait_for()
    page.get_by_text(re.compile(r"Forward pass: CUDA graph replay")).first.wait_for()
    _settle(page)
    assert f"step={browser_samples['graph_step']}" in page.url and f"run={name}" in page.url
    _worker_tab(page)
    page.get_by_text(re.compile(r"Device lane · step \d+")).wait_for()
    assert page.locator("[data-testid='stException']").count() == 0
    page.screenshot(path=os.path.join(SHOTS, "gpu-inspector-graph-replay.png"), full_page=True)

    page.goto(f"{base}/inspector?run={name}&step={browser_samples['eager_step']}")
    page.get_by_text(re.compile(r"Forward pass: eager")).first.wait_for()
    _settle(page)
    _worker_tab(page)
    page.get_by_text(re.compile(r"Kernel launches")).wait_for()
    assert page.locator("[data-testid='stException']").count() == 0
    page.screenshot(path=os.path.join(SHOTS, "gpu-inspector-eager-kernels.png"), full_page=True)

    page.goto(f"{base}/timeline?run={name}&step={browser_samples['timeline_step']}")
    page.get_by_role("heading", name="Timeline").wait_for()
    _settle(page)
    page.get_by_text(re.compile(r"Start-up: \d+ spans")).click()
    _settle(page)
    assert page.locator("[data-testid='stException']").count() == 0
    page.screenshot(path=os.path.join(SHOTS, "gpu-timeline-device-lane.png"), full_page=True)

    page.set_viewport_size({"width": 1500, "height": 1000})
    page.get_by_test_id("stSidebar").get_by_role("combobox").first.click()
    page.get_by_role("option", name=re.compile(r"sample · ")).first.wait_for()
    page.screenshot(path=os.path.join(SHOTS, "run-picker-samples.png"), full_page=False)
    page.keyboard.press("Escape")
