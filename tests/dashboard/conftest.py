"""A run recorded once per session by the real engine (default model, CPU), with
preemption, prefix-cache hits and chunked prefill, driven by the live page's own
engine loop (dashboard/live_engine.py: drive)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SYSTEM = "You are a museum guide. Answer briefly."
# 7 usable blocks of 16 tokens, a 32-token budget: a ~45-token chat prompt is prefilled in
# chunks, the shared system prompt is a prefix hit for the later requests, and four
# growing requests cannot all stay resident: preemption.
FIXTURE_SPEC = {
    "scenario": "fixture",
    "engine_args": {"num_gpu_blocks_override": 8, "max_model_len": 80, "max_num_batched_tokens": 32},
    "max_tokens": 8, "ignore_eos": True, "step_delay_s": 0.0,
    "prompts": [{"text": "What is a CPU?", "arrive_step": 0, "system": SYSTEM},
                {"text": "Who built ENIAC?", "arrive_step": 1, "system": SYSTEM},
                {"text": "What is RAM?", "arrive_step": 1, "system": SYSTEM},
                {"text": "Name an old computer.", "arrive_step": 1, "system": SYSTEM}],
}


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory):
    """(trace_dir, run path) of the fixture run."""
    from dashboard.live_engine import drive
    from vllm_anatomy.entrypoints.llm import LLM
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    trace_dir = str(tmp_path_factory.mktemp("dash_traces"))
    llm = LLM(str(ensure_default_model()), trace_level="full", trace_dir=trace_dir, **FIXTURE_SPEC["engine_args"])
    path = llm.llm_engine.recorder.run_path
    drive(llm, FIXTURE_SPEC)
    llm.llm_engine.shutdown()
    return trace_dir, path


APP = os.path.join(ROOT, "dashboard", "app.py")
# The GPU sample run recorded on a GPU (an H100 since 2026-12-06; an H200 before) (shipped in the repository).
GPU_SAMPLE = os.path.join(ROOT, "samples", "h100-smollm2-full.sqlite")
GPU_SAMPLE_NAME = "synthetic-gpu-full.sqlite"      # GPU-shaped copy of the fixture run (tests/dashboard/gpu_run.py)
CPU_SAMPLE_NAME = "cpu-smollm2-full.sqlite"        # plain copy of the fixture run


@pytest.fixture(scope="session")
def samples(recorded_run, tmp_path_factory):
    """A samples directory (VLLM_ANATOMY_SAMPLES_DIR) holding a copy of the fixture run and its
    GPU-shaped copy: {"dir", "cpu", "gpu", "graph_step", "eager_step", "decisions"}."""
    from tests.dashboard.gpu_run import copy_run, make_gpu_like_run, pick_steps
    _, path = recorded_run
    sdir = str(tmp_path_factory.mktemp("samples"))
    cpu, gpu = os.path.join(sdir, CPU_SAMPLE_NAME), os.path.join(sdir, GPU_SAMPLE_NAME)
    copy_run(path, cpu)
    make_gpu_like_run(path, gpu)
    return {"dir": sdir, "cpu": cpu, "gpu": gpu, **pick_steps(gpu)}


@pytest.fixture(scope="session")
def run_facts(recorded_run):
    """What the pages must show, read straight from the run store."""
    from vllm_anatomy.tracing.reader import open_run
    _, path = recorded_run
    with open_run(path) as run:
        steps = run.steps()
        snaps = {i: run.snapshot(i) for i in steps}
    recs = {i: s["scheduler"]["step_record"] for i, s in snaps.items()}
    first = lambda pred: next(i for i in steps if pred(recs[i]))  # noqa: E731
    return {"steps": steps, "snaps": snaps,
            "preempt_step": first(lambda r: r["preempted_req_ids"]),
            "hit_step": first(lambda r: any(h["num_hit_tokens"] for h in r["prefix_hits"])),
            "chunk_step": first(lambda r: any(s["kind"] == "prefill_chunk" for s in r["scheduled"]))}


@pytest.fixture
def make_app(recorded_run, monkeypatch, tmp_path):
    """AppTest of the dashboard opened on the fixture run (page, step) through the URL
    (samples directory: an empty one, unless a test sets VLLM_ANATOMY_SAMPLES_DIR itself)."""
    from streamlit.testing.v1 import AppTest
    trace_dir, path = recorded_run
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", trace_dir)
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", str(tmp_path / "no-samples"))

    def make(page: str, step: int | None = None, run: str | None = None) -> AppTest:
        at = AppTest.from_file(APP, default_timeout=60)
        at.query_params["run"] = run if run is not None else os.path.basename(path)
        at.query_params["page"] = page
        if step is not None:
            at.query_params["step"] = str(step)
        return at.run()
    return make


@pytest.fixture
def page(browser):
    """A fresh page (its own session) at 1440x900, two minutes for every wait (modules may define their own)."""
    from tests.dashboard.browser import new_page
    ctx, pg = new_page(browser, timeout_ms=120_000)
    yield pg
    ctx.close()


@pytest.fixture(scope="module")
def browser():
    """A headless Debian Chromium for a browser-test module (tests/dashboard/browser.py)."""
    from tests.dashboard.browser import chromium       # (browser.py imports this module)
    with chromium() as b:
        yield b
