"""Where a click lands: open a page of the current run at a step, on an inspector
tab, with a request selected (callbacks for buttons and chart selections), and the
deep link (URL) that lands on the same view.

The URL plumbing is dashboard/state.py's (run, page, step, tab, request: state.goto,
state.link); this module names the inspector's tabs once (TABS: short key -> the
st.tabs label, which is what the URL's `tab` carries) and turns chart clicks into
state.goto calls.

Plotly's selection event (st.plotly_chart(on_select=...)) gives each clicked point's
`customdata`; charts that can be clicked put the step id (and the request id, if any)
there as plain lists. NOTE: a numpy column sent as customdata reaches the browser
as a typed array, and comes back as {"0": 5} rather than [5]: point_data accepts
both.
"""
from __future__ import annotations

import streamlit as st

from dashboard import state
from dashboard.components.tabs import TABS

ss = st.session_state
TAB_KEY = "tab"            # the inspector's st.tabs key, bound to the URL's `tab`
REQUEST_KEY = "request"    # the journey's request selectbox key, bound to the URL's `request`


def open_view(page: str | None = None, step: int | None = None, tab: str | None = None,
              request: str | None = None) -> None:
    """Callback: open `step` (default: the cursor) on `page` (None: stay), on the inspector
    tab `tab` (a key of TABS), with `request` selected."""
    if step is None:
        step = ss.get("cursor")
    label = TABS.get(tab) if tab else None
    if step is None:
        if page:
            ss.goto_page = page
        return
    asked = {k: v for k, v in (("tab", label), ("request", None if request is None else str(request))) if v}
    state.goto(int(step), page, **asked)


def link(page: str, step: int | None = None, tab: str | None = None, request: str | None = None,
         run: str | None = None) -> str:
    """The relative deep link of a view (state.link, with the tab named by its TABS key)."""
    return state.link(page=page, step=step, tab=TABS.get(tab) if tab else None, request=request, run=run)


# -- clicks on charts ---------------------------------------------------------------------------
def point_data(point: dict) -> list:
    """A clicked point's customdata as a list: [..] stays, {"0": a, "1": b} (a typed array
    serialised by the browser) becomes [a, b], a scalar becomes [scalar], none becomes []."""
    cd = point.get("customdata") if isinstance(point, dict) else None
    if cd is None:
        return []
    if isinstance(cd, dict):
        return [cd[k] for k in sorted(cd, key=lambda k: int(k) if str(k).isdigit() else 0)]
    if isinstance(cd, (list, tuple)):
        return list(cd)
    return [cd]


def selected_points(key: str) -> list[dict]:
    """The points of the last selection event of the chart keyed `key`."""
    sel = ss.get(key)
    if sel is None:
        return []
    selection = sel.get("selection") if isinstance(sel, dict) else getattr(sel, "selection", None)
    if selection is None:
        return []
    points = selection.get("points") if isinstance(selection, dict) else getattr(selection, "points", None)
    return list(points or [])


def clicked_step(key: str) -> tuple[int, str | None] | None:
    """(step, request or None) of the first clicked point that carries a step (customdata[0] ≥ 0)."""
    for p in selected_points(key):
        data = point_data(p)
        try:
            step = int(float(data[0])) if data and data[0] is not None else -1
        except (TypeError, ValueError):
            continue
        if step >= 0:
            req = data[1] if len(data) > 1 and data[1] not in (None, "") else None
            return step, None if req is None else str(req)
    return None


def on_click_open(key: str, page: str | None, tab: str | None = None, with_request: bool = False):
    """A selection callback for the chart keyed `key`: open the clicked point's step on
    `page` (None: stay on this page), in `tab`; with_request also selects its request."""
    def callback() -> None:
        hit = clicked_step(key)
        if hit is not None:
            open_view(page, hit[0], tab, hit[1] if with_request else None)
    return callback
