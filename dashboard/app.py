"""vllm_anatomy dashboard: `streamlit run dashboard/app.py` (or `vllm-anatomy dashboard`).

The entrypoint is a frame: it puts the repository root on sys.path (the dashboard
is not an installed package), declares the pages with st.navigation, draws the
shared sidebar (run picker, live-run status), the run header above every page
(dashboard/components/run_header.py), and keeps the URL (run, page, step, tab,
request: dashboard/state.py) in sync so every view is a deep link.

Offline: the page icon is a file served by this app (Streamlit would fetch a
`:material/...:` page icon from a font CDN); the icons inside the pages come from
the Material Symbols font bundled with Streamlit. The toolbar (Deploy button) is
hidden by .streamlit/config.toml.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import streamlit as st  # noqa: E402
from streamlit.errors import StreamlitAPIException  # noqa: E402

from dashboard import data, state  # noqa: E402
from dashboard.components.run_header import run_header  # noqa: E402
from dashboard.components.run_picker import live_status, run_picker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE_ICON = os.path.join(HERE, "static", "favicon.png")
PAGES = [  # (file under views/, title, icon, url_path, section)
    ("live", "Start · live run", ":material/bolt:", "live", "Run"),
    ("timeline", "Timeline", ":material/view_timeline:", "timeline", "Explore"),
    ("inspector", "Step inspector", ":material/search:", "inspector", "Explore"),
    ("journey", "Request journey", ":material/route:", "journey", "Explore"),
    ("metrics", "Metrics over time", ":material/monitoring:", "metrics", "Explore"),
    ("processes", "Processes", ":material/lan:", "processes", "Explore"),
    ("compare", "Compare two runs", ":material/compare_arrows:", "compare", "Explore"),
    ("lessons", "Lessons", ":material/school:", "lessons", "Learn"),
    ("selftest", "Self-test", ":material/quiz:", "selftest", "Learn"),
    ("mapping", "Code map", ":material/map:", "mapping", "Learn"),
]
NO_RUN_HEADER = ("mapping", "compare")    # about the code, or about two runs (each gets its header there)


def build_pages() -> dict[str, st.Page]:
    return {url: st.Page(os.path.join(HERE, "views", f"{file}.py"), title=title, icon=icon, url_path=url,
                         default=(url == "live"))
            for file, title, icon, url, _ in PAGES}


def _switch(pages: dict, pg, want: str | None) -> None:
    """Go to page `want` (if it is another page), keeping the tab and request asked for.

    NOTE: the query is always given (a dict, maybe empty): switch_page without one
    clears the URL, which Streamlit refuses while a widget is bound to a parameter.
    A parameter bound to a widget cannot be passed either: that widget gets its
    value from session state (state.goto sets it)."""
    if want in pages and pages[want].url_path != pg.url_path:
        ss = st.session_state
        keep = {k: v for k, v in ss.get("wanted", {}).items() if v and (k != "tab" or ss.get("wanted_page") == want)}
        for query in (keep, {k: v for k, v in keep.items() if k != "tab"},
                      {k: v for k, v in keep.items() if k != "request"}, {}):
            try:
                st.switch_page(pages[want], query_params=query)
            except StreamlitAPIException:
                continue


def main() -> None:
    st.set_page_config(page_title="vllm_anatomy", page_icon=PAGE_ICON if os.path.exists(PAGE_ICON) else "🔬",
                       layout="wide")
    pages = build_pages()
    sections: dict[str, list] = {}
    for _, _, _, url, section in PAGES:
        sections.setdefault(section, []).append(pages[url])
    pg = st.navigation(sections)
    # Less empty space above each page (Streamlit's default is 6rem): the landing page's
    # start strip and its one primary action fit above the fold at 1440x900.
    # Inline code never under 12 px (in a caption Streamlit draws it at 0.75 em: 10.5 px).
    st.markdown("<style>[data-testid='stMainBlockContainer']{padding-top:3rem}"
                "[data-testid='stMarkdownContainer'] code, [data-testid='stCaptionContainer'] code"
                "{font-size:max(0.85em, 12px) !important}</style>", unsafe_allow_html=True)
    ss = st.session_state
    if not ss.get("booted") or state.query_changed():
        first = not ss.get("booted")
        ss.booted = True
        state.apply_query()
        if first or st.query_params.get("page"):
            _switch(pages, pg, st.query_params.get("page"))
    _switch(pages, pg, ss.pop("goto_page", None))
    page = pg.url_path or "live"
    with st.sidebar:
        run_picker()
        live_status()
    state.sync_query(page)
    if page not in NO_RUN_HEADER:
        run_header()
    # A finished run's tables (one pass per snapshot kind) are built in the background
    # while this page draws, so the next page switch finds them ready (data.prefetch).
    path = ss.get("run_path")
    if path and os.path.exists(path) and not os.path.exists(path + "-wal"):
        data.prefetch(path)
    pg.run()


main()
