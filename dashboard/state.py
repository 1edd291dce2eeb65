"""Session state of the dashboard: which run is open, the step cursor, playing /
following, and the URL that makes every view a deep link.

Runs are opened by *name* only (a file name such as `run-20250101-120000-ab12.sqlite`),
looked up in the dashboard's run directories, in this order:
    the trace directory    VLLM_ANATOMY_TRACE_DIR (default ./vllm_anatomy_traces)
    its lessons folder     VLLM_ANATOMY_LESSON_TRACE_DIR (default <trace dir>/lessons)
    the samples directory  VLLM_ANATOMY_SAMPLES_DIR (default <repo>/samples: runs shipped
                           with the repository, e.g. one recorded on an H200)
    its compare folder     <samples>/compare: the pairs the Compare page ships (not in the sidebar)
Anything else in `?run=` (a path elsewhere, `..`, a name that is no run store) is
refused with one message that says nothing about the file system. A path that
names a file directly inside one of these directories (links printed by older
lessons) is read as its file name.

Deep links. The URL carries
    run      the open run's name
    page     the page's url path (timeline, inspector, journey, metrics, lessons, ...)
    step     the step cursor
    tab      the tab a page opens on (the tab's label, as st.tabs(bind="query-params") writes it)
    request  the request a page opens on (a request id)
`?run=&page=&step=` links made before tab/request existed keep working.
Helpers for pages:
    link(page=, step=, tab=, request=, run=)  a relative URL ("inspector?run=...") that
                                              lands there: for markdown links
    goto(step, page=, tab=, request=)         on_click callback: open a step (page, tab, request)
    wanted("tab") / wanted("request")         what the URL asked this page to open on (or None);
                                              a page using st.tabs(key="tab", bind="query-params")
                                              or a widget with key="request" and bind gets it itself
    current() / current_step_table()          the open run, or a message saying why there is none

Only the cursor lives in st.session_state; run data comes from the cached loaders
in dashboard/data.py. Buttons change state in on_click callbacks (they run before
the rerun), so a click is never "one rerun late".
"""
from __future__ import annotations

import os
import re
import time
import urllib.parse

import streamlit as st
from streamlit.errors import StreamlitAPIException

from dashboard import data
from dashboard.words import agree, n_of
from vllm_anatomy.tracing.factory import DEFAULT_TRACE_DIR

TRACE_DIR_ENV = "VLLM_ANATOMY_TRACE_DIR"
LESSON_DIR_ENV = "VLLM_ANATOMY_LESSON_TRACE_DIR"
SAMPLES_DIR_ENV = "VLLM_ANATOMY_SAMPLES_DIR"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
URL_KEYS = ("run", "page", "step", "tab", "request")   # the order they appear in a link
# A run name: a plain file name ending in .sqlite (no separator, no leading dot).
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}\.sqlite")
REFUSED = ("This run cannot be opened. The dashboard opens runs by name only, from its run list "
           "(the trace directory and the shipped samples): pick one in the sidebar.")
ss = st.session_state


def trace_dir() -> str:
    return os.environ.get(TRACE_DIR_ENV) or DEFAULT_TRACE_DIR


def lessons_dir() -> str:
    """Where the CLI lessons record (lessons/_common.py: LESSON_TRACE_DIR)."""
    return os.environ.get(LESSON_DIR_ENV) or os.path.join(trace_dir(), "lessons")


def samples_dir() -> str:
    """Run stores shipped with the repository (read-only examples, e.g. a run recorded on a GPU)."""
    return os.environ.get(SAMPLES_DIR_ENV) or os.path.join(REPO_ROOT, "samples")


def compare_dir() -> str:
    """The pairs of runs shipped for the Compare page (samples/compare, pairs.json names them)."""
    return os.path.join(samples_dir(), "compare")


def run_dirs() -> list[str]:
    """The directories runs are opened from, in lookup order (absolute, without repeats)."""
    out: list[str] = []
    for d in (trace_dir(), lessons_dir(), samples_dir(), compare_dir()):
        d = os.path.abspath(d)
        if d not in out:
            out.append(d)
    return out


def resolve_run(name: str | None) -> str | data.RunError | None:
    """The path of the run named `name` (None for no name), or a RunError.

    NOTE: the refusal is the same text whatever was asked (a path elsewhere,
    a file that exists or not, a directory): the URL is an input anyone can
    type, and its answer must not tell what is on this machine."""
    if not name:
        return None
    if "/" in name or os.sep in name:
        # A link printed by an older lesson: the absolute path of a run in one of our directories.
        parent, base = os.path.split(os.path.normpath(name))
        if not os.path.isabs(name) or os.path.abspath(parent) not in run_dirs():
            return data.RunError(REFUSED)
        name = base
    if not RUN_NAME.fullmatch(name) or ".." in name:
        return data.RunError(REFUSED)
    for d in run_dirs():
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    return data.RunError(f"`{name}`: no such run store file in the run list (the trace directory, "
                         "its lessons folder and the samples). It may have been deleted: pick a run in the sidebar.")


def run_name(path: str | None) -> str | None:
    return os.path.basename(path) if path else None


# -- the URL ------------------------------------------------------------------------------------
def _query() -> dict[str, str]:
    return {k: st.query_params[k] for k in URL_KEYS if k in st.query_params}


def apply_query() -> None:
    """Take run, step, tab and request from the URL: at the first script run of a session,
    and whenever a link inside the app (st.page_link, switch_page) changed run or step."""
    qp = _query()
    if qp.get("run"):
        resolved = resolve_run(qp["run"])
        if isinstance(resolved, data.RunError):
            ss.run_path, ss.run_error = None, resolved
        else:
            ss.run_path, ss.run_error = resolved, None
    step = qp.get("step", "")
    ss.cursor = int(step) if step.isdigit() else None
    ss.playing = False
    ss.wanted = {k: qp[k] for k in ("tab", "request") if qp.get(k)}
    ss.wanted_page = qp.get("page")
    if ss.wanted:
        ss.scroll_to = qp.get("page") or "*"      # a link that names a tab or a request lands on it (components/focus.py)
    ss.synced = _mine(qp)


def boot_from_query() -> None:   # (the name app.py and older tests use)
    apply_query()


def _mine(qp: dict) -> dict:
    return {k: qp[k] for k in ("run", "step") if k in qp}


def query_changed() -> bool:
    """Did run or step in the URL change since we last wrote them (an in-app link)? A URL
    without either (the sidebar's page links drop the query) changes nothing."""
    mine = _mine(_query())
    return bool(mine) and mine != ss.get("synced", {})


def sync_query(page: str) -> None:
    """Write the current view into the URL (no rerun). Only run, page and step are ours;
    tab and request stay as the page (or its bound widgets) left them, except that a
    tab is dropped when another page opens without asking for one."""
    want: dict[str, str | None] = {"page": page, "run": None, "step": None}
    if ss.get("run_path"):
        want["run"] = run_name(ss.run_path)
        if ss.get("cursor") is not None:
            want["step"] = str(ss.cursor)
    if ss.get("last_page") not in (None, page) and ss.get("wanted_page") != page:
        want["tab"] = None            # a tab belongs to the page it was asked for
        ss.wanted = {k: v for k, v in ss.get("wanted", {}).items() if k != "tab"}
    ss.last_page = page
    if ss.get("scroll_to") not in (None, page, "*"):
        ss.pop("scroll_to")            # asked for another page: never scroll this one later
    for k, v in want.items():
        if v is None:
            if k in st.query_params:
                _set_param(k, None)
        elif st.query_params.get(k) != v:
            _set_param(k, v)
    ss.synced = _mine(_query())


def set_param(key: str, value: str | None) -> bool:
    """Set (or delete) a URL parameter from a page or component (False when a widget owns it)."""
    return _set_param(key, value)


def _set_param(key: str, value: str | None) -> bool:
    """Set (or, for None, delete) one URL parameter; False when a widget owns it
    (bind="query-params": Streamlit keeps that one in step with the widget)."""
    try:
        if value is None:
            del st.query_params[key]
        else:
            st.query_params[key] = value
        return True
    except StreamlitAPIException:
        return False


def link(page: str | None = None, step: int | None = None, tab: str | None = None,
         request: str | None = None, run: str | None = None) -> str:
    """A relative URL that opens `page` of the run (default: the open one) at `step`, on
    `tab` (a tab label), with `request` selected. Relative (`inspector?run=...`), so it
    lands on the dashboard that serves the page, whatever its host, port or base path."""
    query = {"run": run or run_name(ss.get("run_path")), "page": page,
             "step": None if step is None else str(int(step)), "tab": tab,
             "request": None if request is None else str(request)}
    q = urllib.parse.urlencode({k: v for k, v in query.items() if v})
    return f"{page or ''}?{q}" if q else (page or "./")


def wanted(key: str) -> str | None:
    """What the URL (or the last goto) asked the page to open on: "tab" or "request"."""
    return ss.get("wanted", {}).get(key)


def open_run(path: str | None, step: int | None = None) -> None:
    ss.run_path = path
    ss.run_error = None
    ss.cursor = step
    ss.playing = False


def current() -> tuple[str, dict] | None:
    """(path, run info) of the open run, or None after showing why there is none."""
    if ss.get("run_error") is not None:
        return None          # the refusal is shown above every page (app.py: run_header)
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
    show_bad_rows(df)
    return path, info, df


def show_error(err: data.RunError) -> None:
    st.error(err.message, icon=":material/warning:")


def show_bad_rows(obj) -> None:
    """A warning listing the rows a loader skipped because their JSON is damaged (if any)."""
    bad = data.bad_rows_of(obj)
    if bad:
        with st.expander(f":material/warning: {n_of(len(bad), 'damaged row')} of this run store "
                         f"{agree(len(bad), 'was', 'were')} skipped"):
            st.markdown("\n".join(f"- {b}" for b in bad[:50]) + ("\n- …" if len(bad) > 50 else ""))


# -- the step cursor ----------------------------------------------------------------------------
def cursor_index(steps: list[int]) -> int:
    """Index of the cursor in steps, clamped (a stale or missing cursor goes to the last step)."""
    cur = ss.get("cursor")
    if cur is None or cur not in steps:
        idx = len(steps) - 1 if cur is None else min(range(len(steps)), key=lambda i: abs(steps[i] - cur))
        ss.cursor = steps[idx]
        return idx
    return steps.index(cur)


def pick_on_cursor(key: str, steps: list[int]) -> None:
    """Put the keyed step picker `key` (a selectbox over `steps`, made right after) on the cursor
    whenever the cursor moved since it last did (a button, a chart click, a link).

    NOTE: a keyed widget keeps its own value across reruns and ignores a new `index`, so without
    this a picker stays on the old step while the URL and the cursor show another. A step picked
    in the widget itself is kept until the cursor moves again."""
    cur = steps[cursor_index(steps)]
    mark = f"_{key}_on"
    if ss.get(mark) != cur or ss.get(key) not in steps:
        ss[key] = cur
        ss[mark] = cur


def move(steps: list[int], delta: int) -> None:
    """Callback: move the cursor by delta steps (stops playing at either end)."""
    idx = cursor_index(steps) + delta
    if idx < 0 or idx >= len(steps):
        ss.playing = False
    ss.cursor = steps[max(0, min(idx, len(steps) - 1))]


def goto(step: int, page: str | None = None, tab: str | None = None, request: str | None = None) -> None:
    """Callback: open a step (and a page, a tab of it, a request) of the current run."""
    ss.cursor = int(step)
    ss.playing = False
    asked = {k: str(v) for k, v in (("tab", tab), ("request", request)) if v is not None}
    if asked:
        ss.wanted = {**ss.get("wanted", {}), **asked}
    if page:
        ss.goto_page = page
    if page or asked:
        ss.wanted_page = page or ss.get("last_page")
    if asked:
        ss.scroll_to = page or ss.get("last_page")
    for k, v in asked.items():
        # NOTE: a widget keyed "tab" / "request" (st.tabs(key="tab", bind="query-params"))
        # opens on its session-state value; the URL parameter is for pages that read it
        # (wanted()), and cannot be set while a widget is bound to it.
        ss[k] = v
        _set_param(k, v)


def on_scrub() -> None:
    ss.cursor = int(ss.scrub)


def play(steps: list[int]) -> None:
    """Callback of the scrubber's play / pause: pause, or play — from the first step when the cursor is
    at the last one, as a media player starts again from the beginning.

    NOTE: the ticker's first run comes with this rerun and moves at once when a period has passed since
    its last tick; starting over marks a tick now, so the first step shows for a whole period."""
    if ss.get("playing"):
        ss.playing = False
        return
    ss.playing = True
    if len(steps) > 1 and cursor_index(steps) == len(steps) - 1:
        ss.cursor = steps[0]
        ss._last_tick = time.monotonic()


def toggle(key: str) -> None:
    ss[key] = not ss.get(key, False)
