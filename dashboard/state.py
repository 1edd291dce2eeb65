"""Session state of the dashboard: which run is open, the step cursor, playing /
following, and the URL query (run, page, step) that makes every view a deep link.
Runs are found in the trace directory (VLLM_ANATOMY_TRACE_DIR) and in the samples
directory (VLLM_ANATOMY_SAMPLES_DIR, default <repo>/samples: runs shipped with the
repository, e.g. one recorded on an H200); `?run=<file name>` looks in both.

Only the cursor lives in st.session_state; run data comes from the cached loaders
in dashboard/data.py. Buttons change state in on_click callbacks (they run before
the rerun), so a click is never "one rerun late".
"""
from __future__ import annotations

import os

import streamlit as st

from dashboard import data
from vllm_anatomy.tracing.factory import DEFAULT_TRACE_DIR

TRACE_DIR_ENV = "VLLM_ANATOMY_TRACE_DIR"
SAMPLES_DIR_ENV = "VLLM_ANATOMY_SAMPLES_DIR"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ss = st.session_state


def trace_dir() -> str:
    return os.environ.get(TRACE_DIR_ENV) or DEFAULT_TRACE_DIR


def samples_dir() -> str:
    """Run stores shipped with the repository (read-only examples, e.g. a run recorded on a GPU)."""
    return os.environ.get(SAMPLES_DIR_ENV) or os.path.join(REPO_ROOT, "samples")


def resolve_run(name: str | None) -> str | None:
    """A run named in the URL: a file name under trace_dir (else under samples_dir), or a
    path (relative paths are also tried from the repository root: `samples/x.sqlite`)."""
    if not name:
        return None
    if os.path.sep in name:
        if not os.path.isabs(name) and not os.path.exists(name) and \
                os.path.exists(os.path.join(REPO_ROOT, name)):
            return os.path.join(REPO_ROOT, name)
        return name
    recorded = os.path.join(trace_dir(), name)
    sample = os.path.join(samples_dir(), name)
    return sample if not os.path.exists(recorded) and os.path.exists(sample) else recorded


def boot_from_query() -> None:
    """First script run of a session: take run and step from the URL."""
    qp = st.query_params
    if qp.get("run"):
        ss.run_path = resolve_run(qp["run"])
    step = qp.get("step", "")
    if step.isdigit():
        ss.cursor = int(step)


def sync_query(page: str) -> None:
    """Write the current view into the URL (no rerun)."""
    params = {"page": page}
    if ss.get("run_path"):
        params["run"] = os.path.basename(ss.run_path)
        if ss.get("cursor") is not None:
            params["step"] = str(ss.cursor)
    if dict(st.query_params) != params:
        st.query_params.from_dict(params)


def open_run(path: str | None, step: int | None = None) -> None:
    ss.run_path = path
    ss.cursor = step
    ss.playing = False


def current() -> tuple[str, dict] | None:
    """(path, run info) of the open run, or None after showing why there is none."""
    path = ss.get("run_path")
    if not path:
        st.info("No run is open. Start a live run on the **Live run** page, or pick a recorded "
                "run in the sidebar.")
        return None
    info = data.run_info(path, data.file_version(path))
    if isinstance(info, data.RunError):
        show_error(info)
        return None
    if not info["steps"]:
        st.info(f"`{os.path.basename(path)}` has no committed step yet (the engine may still be loading).")
        return None
    return path, info


def current_step_table():
    """(path, run info, the run's per-step table) of the open run, or None after showing why not."""
    cur = current()
    if cur is None:
        return None
    path, info = cur
    df = data.step_table(path, data.file_version(path))
    if isinstance(df, data.RunError):
        show_error(df)
        return None
    return path, info, df


def show_error(err: data.RunError) -> None:
    st.error(err.message, icon=":material/warning:")


# -- the step cursor ----------------------------------------------------------------------------
def cursor_index(steps: list[int]) -> int:
    """Index of the cursor in steps, clamped (a stale or missing cursor goes to the last step)."""
    cur = ss.get("cursor")
    if cur is None or cur not in steps:
        idx = len(steps) - 1 if cur is None else min(range(len(steps)), key=lambda i: abs(steps[i] - cur))
        ss.cursor = steps[idx]
        return idx
    return steps.index(cur)


def move(steps: list[int], delta: int) -> None:
    """Callback: move the cursor by delta steps (stops playing at either end)."""
    idx = cursor_index(steps) + delta
    if idx < 0 or idx >= len(steps):
        ss.playing = False
    ss.cursor = steps[max(0, min(idx, len(steps) - 1))]


def goto(step: int, page: str | None = None) -> None:
    """Callback: open a step (and a page) of the current run."""
    ss.cursor = int(step)
    ss.playing = False
    if page:
        ss.goto_page = page


def on_scrub() -> None:
    ss.cursor = int(ss.scrub)


def toggle(key: str) -> None:
    ss[key] = not ss.get(key, False)
