"""Where a link lands, and what it points at.

A deep link or a "Show me" button that names an inspector tab (`tab=`) or a request
(`request=`) should show that tab and that request, not the top of a long page:

    focus_anchor(key)      above the inspector's tabs: the focused request (if any) with a
                           button to clear it, and the point the page scrolls to once, when a
                           link or a button asked for a tab or a request (state.goto /
                           state.apply_query set ss.scroll_to)
    focused()              the request the link named (None: none)
    focus_css(req)         outlines every chip of that request (chips carry title="request <id>")
    style_focus(df, col)   the rows of a table whose `col` is that request, highlighted

NOTE: Streamlit draws a page top to bottom while charts above the tabs are still being
laid out, so the scroll is repeated until the anchor stops moving (at most a few seconds);
it runs once per link, never on a plain rerun (scrubbing keeps the reader where they are).
"""
from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from dashboard import state
from dashboard.theme import req_chip, short_req_id

ss = st.session_state
FOCUS_COLOR = "#B0303F"


def focused() -> str | None:
    return state.wanted("request")


def focus_css(req: str) -> str:
    """CSS that outlines every chip of request `req` (theme.chip titles: "request <id>" or "request <id>: ...")."""
    q = json.dumps(f"request {req}")
    q_colon = json.dumps(f"request {req}:")
    return (f"<style>span[title={q}], span[title^={q_colon}]{{outline:3px solid {FOCUS_COLOR};outline-offset:1px;"
            f"box-shadow:0 0 0 5px rgba(176,48,63,0.22)}}</style>")


def style_focus(df: pd.DataFrame, col: str = "req"):
    """df with the focused request's rows highlighted (a Styler), or df unchanged."""
    req = focused()
    if req is None or df.empty or col not in df:
        return df
    want = {str(req), short_req_id(req)}
    return df.style.apply(lambda row: ["background-color: #F9D9DD; font-weight: 600" if str(row[col]) in want
                                       else "" for _ in row], axis=1)


def _clear() -> None:
    """Callback: stop focusing the request (session and URL)."""
    ss.wanted = {k: v for k, v in ss.get("wanted", {}).items() if k != "request"}
    ss.pop("request", None)
    state.set_param("request", None)


SCROLL_JS = """<script>
(function () {
  const sel = %s, t0 = Date.now();
  let last = null, still = 0;
  function go() {
    const el = window.parent.document.querySelector(sel) || document.querySelector(sel);
    if (el) {
      el.scrollIntoView({block: "start"});
      const y = el.getBoundingClientRect().top;
      still = (last !== null && Math.abs(y - last) < 2) ? still + 1 : 0;
      last = y;
    }
    if (still < 6 && Date.now() - t0 < 15000) setTimeout(go, 250);
  }
  go();
})();
</script>"""


def focus_anchor(key: str = "va_focus") -> None:
    """The focused request's line (if any) and, once per link, the scroll that brings it and the
    tabs below it into view."""
    req = focused()
    with st.container(key=key):
        if req is not None:
            st.markdown(focus_css(req), unsafe_allow_html=True)
            c1, c2 = st.columns([6, 1], vertical_alignment="center")
            c1.markdown(f":material/my_location: The link named {req_chip(req)}: it is outlined in red wherever it "
                        "appears (queues, block tables, budget chips) and its rows are highlighted in the tables "
                        "below.", unsafe_allow_html=True)
            c2.button("Clear", key=f"{key}_clear", icon=":material/close:", on_click=_clear,
                      help="stop highlighting this request")
    if ss.pop("scroll_to", None) is not None:
        target = f".st-key-{key}" if req is not None else "[data-testid='stTabs']"
        st.html(SCROLL_JS % json.dumps(target), unsafe_allow_javascript=True)
