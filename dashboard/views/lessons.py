"""Lessons: the article's concepts, each with a deep link to the step of the open
run that shows it — the page, the inspector tab and the request its text names
(computed from the run, see dashboard/lessons.py) — and the CLI lessons
(lessons/NN_*.py) that provoke the same idea on purpose."""
from __future__ import annotations

import streamlit as st

from dashboard import data, spans, state
from dashboard.answers.source import tensor_parallel_size
from dashboard.components.code_ref import code_ref
from dashboard.components.nav import TABS, link, open_view
from dashboard.components.run_picker import tp_sample_button
from dashboard.lessons import CLI_LESSONS, LESSONS, Facts

ss = st.session_state


def _where(lesson, step: int, request: str | None) -> str:
    page = {"inspector": "Step inspector", "timeline": "Timeline", "journey": "Request journey",
            "processes": "Processes"}.get(lesson.page, lesson.page)
    tab = f", {TABS[lesson.tab]} tab" if lesson.tab else ""
    req = f", req {request}" if request else ""
    return f"{page}{tab}, step {step}{req}"


def _cli(lesson) -> str:
    if not lesson.cli:
        return ""
    runs = " · ".join(f"`vllm-anatomy lesson {n}` ({CLI_LESSONS[n][1]})" for n in lesson.cli if n in CLI_LESSONS)
    return f"  \n:material/terminal: *Provoke it yourself:* {runs}"


def lesson_card(lesson, found: tuple[int | None, str | None]) -> None:
    step, request = found
    with st.container(border=True, key=f"card_{lesson.key}"):
        c1, c2 = st.columns([5, 2], vertical_alignment="center")
        c1.markdown(f"**{lesson.title}**  \n{lesson.idea}  \n*Look at:* {lesson.look_at}{_cli(lesson)}")
        if step is None:
            if lesson.key == "tp":
                c2.caption("not in this run — one device, nothing to split")
                tp_sample_button("lesson_tp_sample", "lessons", "Open the TP sample", where=c2)
                return
            c2.caption("not in this run — needs a GPU: open the GPU sample run (sidebar)" if lesson.key == "cudagraph"
                       else "not in this run — try the matching scenario on the Live run page, or the CLI lesson")
            return
        c2.button(f"Open step {step} →", key=f"lesson_{lesson.key}", on_click=open_view,
                  args=(lesson.page, step, lesson.tab, request), type="secondary", help=_where(lesson, step, request))
        c2.markdown(f"[{_where(lesson, step, request)}]({link(lesson.page, step, lesson.tab, request)})")


def main() -> None:
    st.title("Lessons")
    cur = state.current_step_table()
    if cur is None:
        return
    path, _, df = cur
    version = data.file_version(path)
    records, statuses = data.step_records(path, version), data.queue_statuses(path, version)
    reqs = spans.request_table(path, version)
    reasons = {} if isinstance(reqs, data.RunError) else {
        str(r["request_id"]): (r["finish_reasons"] or [""])[0] for r in reqs}
    info = data.run_info(path, version)
    facts = Facts(df, records if isinstance(records, dict) else {}, statuses if isinstance(statuses, dict) else {},
                  reasons, tp=1 if isinstance(info, data.RunError) else tensor_parallel_size(info["meta"]))
    found = [(lesson, lesson.find(facts)) for lesson in LESSONS]
    n = sum(f[0] is not None for _, f in found)
    st.caption(f"{n} of {len(found)} concepts appear in this run ({len(df)} steps). Each card opens the step, tab "
               "and request its text names. The CLI lessons (`vllm-anatomy lesson --list`) provoke each idea on "
               "purpose, check it, and print a link back to this dashboard.")
    st.page_link("views/selftest.py", label="Self-test: the article's five questions, answered from this run",
                 icon=":material/quiz:")
    for lesson, f in found:
        lesson_card(lesson, f)
    code_ref("dashboard/lessons.py", "LESSONS (finders over the per-step table, the step records and the queues)")


main()
