"""Step scrubber: first / prev / play / next / last, a slider over the committed
steps, and the play timer (a timed fragment that moves the cursor and reruns the app)."""
from __future__ import annotations

import time

import streamlit as st

from dashboard import state
from dashboard.words import rate_text

ss = st.session_state


def scrubber(steps: list[int]) -> int:
    """Draw the scrubber; return the current step id."""
    idx = state.cursor_index(steps)
    cols = st.columns([1, 1, 1, 1, 1, 12, 3], vertical_alignment="center")
    cols[0].button(":material/first_page:", key="first", help="first step", on_click=state.goto, args=(steps[0],))
    cols[1].button(":material/chevron_left:", key="prev", help="previous step", on_click=state.move, args=(steps, -1))
    at_end = idx == len(steps) - 1 and len(steps) > 1
    cols[2].button(":material/pause:" if ss.get("playing") else ":material/play_arrow:", key="play",
                   help="pause" if ss.get("playing") else
                   ("play: at the last step, start again from the first step" if at_end else "play"),
                   on_click=state.play, args=(steps,))
    cols[3].button(":material/chevron_right:", key="next", help="next step", on_click=state.move, args=(steps, 1))
    cols[4].button(":material/last_page:", key="last", help="last step", on_click=state.goto, args=(steps[-1],))
    ss.scrub = steps[idx]   # set before the widget exists: allowed, and keeps it in sync with the cursor
    if len(steps) > 1:
        cols[5].select_slider("step", options=steps, key="scrub", on_change=state.on_scrub,
                              label_visibility="collapsed")
    cols[6].selectbox("speed", [0.5, 1.0, 2.0, 4.0], index=1, key="speed",
                      format_func=rate_text, label_visibility="collapsed")
    st.caption(f"step **{steps[idx]}** · {idx + 1} of {len(steps)} committed")
    if ss.get("playing"):
        _ticker(steps)
    return steps[idx]


def _ticker(steps: list[int]) -> None:
    interval = 1.0 / float(ss.get("speed", 1.0))

    @st.fragment(run_every=interval)
    def tick() -> None:
        # NOTE: the fragment also runs with every full rerun: move only when a period has passed.
        now = time.monotonic()
        if now - ss.get("_last_tick", 0.0) >= 0.8 * interval:
            ss._last_tick = now
            state.move(steps, 1)
            st.rerun()
    tick()
