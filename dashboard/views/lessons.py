"""Lessons: the article's concepts, each with a deep link to the step of the open
run that shows it (computed from the run, see dashboard/lessons.py)."""
from __future__ import annotations

import os

import streamlit as st

from dashboard import state
from dashboard.components.code_ref import code_ref
from dashboard.lessons import LESSONS

ss = st.session_state


def lesson_card(lesson, step: int | None, run_name: str) -> None:
    with st.container(border=True):
        c1, c2 = st.columns([5, 2], vertical_alignment="center")
        c1.markdown(f"**{lesson.title}**  \n{lesson.idea}  \n*Look at:* {lesson.look_at}")
        if step is None:
            c2.caption("not in this run — needs a GPU: open the GPU sample run (sidebar)" if lesson.key == "cudagraph"
                       else "not in this run — try the matching scenario on the Live run page")
            return
        c2.button(f"Open step {step} →", key=f"lesson_{lesson.key}", on_click=state.goto,
                  args=(step, lesson.page), type="primary")
        c2.markdown(f"[link](/{lesson.page}?run={run_name}&page={lesson.page}&step={step})")


def main() -> None:
    st.title("Lessons")
    cur = state.current_step_table()
    if cur is None:
        return
    path, _, df = cur
    found = [(lesson, lesson.find(df)) for lesson in LESSONS]
    n = sum(step is not None for _, step in found)
    st.caption(f"{n} of {len(found)} concepts appear in this run ({len(df)} steps).")
    for lesson, step in found:
        lesson_card(lesson, step, os.path.basename(path))
    code_ref("dashboard/lessons.py", "LESSONS (finders over the per-step table)")


main()
