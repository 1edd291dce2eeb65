"""vllm_anatomy dashboard: `streamlit run dashboard/app.py` (or `vllm-anatomy dashboard`).

The entrypoint is a frame: it puts the repository root on sys.path (the dashboard
is not an installed package), declares the pages with st.navigation, draws the
shared sidebar (run picker, live-run status) and keeps the URL query (run, page,
step) in sync so every view is a deep link.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import streamlit as st  # noqa: E402

from dashboard import state  # noqa: E402
from dashboard.components.run_picker import run_picker  # noqa: E402

PAGES = [  # (file under views/, title, icon, url_path, section)
    ("live", "Live run", ":material/bolt:", "live", "Run"),
    ("timeline", "Timeline", ":material/view_timeline:", "timeline", "Explore"),
    ("inspector", "Step inspector", ":material/search:", "inspector", "Explore"),
    ("journey", "Request journey", ":material/route:", "journey", "Explore"),
    ("metrics", "Metrics over time", ":material/monitoring:", "metrics", "Explore"),
    ("lessons", "Lessons", ":material/school:", "lessons", "Learn"),
    ("mapping", "Code map", ":material/map:", "mapping", "Learn"),
]


def build_pages() -> dict[str, st.Page]:
    here = os.path.dirname(os.path.abspath(__file__))
    return {url: st.Page(os.path.join(here, "views", f"{file}.py"), title=title, icon=icon, url_path=url,
                         default=(url == "live"))
            for file, title, icon, url, _ in PAGES}


def main() -> None:
    st.set_page_config(page_title="vllm_anatomy", page_icon=":material/biotech:", layout="wide")
    pages = build_pages()
    sections: dict[str, list] = {}
    for _, _, _, url, section in PAGES:
        sections.setdefault(section, []).append(pages[url])
    pg = st.navigation(sections)
    ss = st.session_state
    if not ss.get("booted"):
        ss.booted = True
        state.boot_from_query()
        want = st.query_params.get("page")
        if want in pages and pages[want].url_path != pg.url_path:
            st.switch_page(pages[want])
    goto = ss.pop("goto_page", None)
    if goto in pages and pages[goto].url_path != pg.url_path:
        st.switch_page(pages[goto])
    with st.sidebar:
        run_picker()
    state.sync_query(pg.url_path or "live")
    pg.run()


main()
