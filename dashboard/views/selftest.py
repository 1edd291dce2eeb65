"""Self-test: the article's five questions (§九 自测), answered from the open run.

Each question is quoted in the article's words with an English line; the answer is
computed from this run's snapshots and spans (dashboard/answers/), with its values,
a "show me" button (and deep link) that opens the step, inspector tab and request
where it happens, and the article's reference answer behind a click. Pickers choose
another allocation, step, finish or request of the same run."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import data, state
from dashboard.answers import QUESTIONS
from dashboard.answers.cached import answer, source
from dashboard.components.code_ref import code_ref
from dashboard.components.five_accounts import five_accounts
from dashboard.components.nav import link, open_view
from dashboard.theme import short_req_id
from dashboard.words import n_of

ss = st.session_state
ANSWER_FILES = {"q1": "q1_allocation", "q2": "q2_update_states", "q3": "q3_block_table", "q4": "q4_finish",
                "q5": "q5_accounts"}


def _where(s) -> str:
    return s.where


def _table(rows: list[dict], key: str) -> None:
    if not rows:
        st.caption("(none)")
        return
    df = pd.DataFrame(rows)
    for col in ("request", "req"):     # request ids as the chips show them (components/queues.py)
        if col in df:
            df[col] = df[col].map(lambda v: short_req_id(v) if isinstance(v, str) else v)
    st.dataframe(df.astype(str), hide_index=True, width="stretch", key=key,
                 row_height=32 if len(df) < 30 else None)


def _chain(rows: list[dict]) -> None:
    """A small table whose long cells wrap (a markdown table; st.dataframe would cut them)."""
    cols = list(rows[0])
    esc = lambda v: str("—" if v is None else v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    st.markdown("\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                          + ["| " + " | ".join(esc(r.get(c)) for c in cols) + " |" for r in rows]))


def _show_me(a, q: str) -> None:
    for i, s in enumerate(a.show_me):
        c1, c2 = st.columns([2, 5], vertical_alignment="center")
        c1.button("Show me →", key=f"show_{q}_{i}", on_click=open_view, args=(s.page, s.step, s.tab, s.request),
                  type="primary" if i == 0 else "secondary", help=_where(s))
        c2.markdown(f"[{s.label}]({link(s.page, s.step, s.tab, s.request)}) — opens {_where(s)}")


def _picker(q: str, label: str, options: list, chosen, fmt=str):
    """A selectbox over `options` that starts on `chosen` (the answer's own pick)."""
    key = f"pick_{q}"
    if key in ss and ss[key] not in options:
        del ss[key]
    index = options.index(chosen) if chosen in options else 0
    return st.selectbox(label, options, index=index, key=key, format_func=fmt)


def _question(q, path: str, version: tuple) -> None:
    with st.container(border=True, key=f"q_{q.key}"):
        n = q.key[1:]
        st.markdown(f"### {n}. {q.zh}")
        st.markdown(f"*{q.en}*")
        a = answer(path, version, q.key)
        if a.ok:
            f = a.facts
            picked = None
            if q.key == "q1":
                opts = [tuple(x) for x in f["allocations"]]
                picked = _picker("q1", "allocation (step · request)", opts, (f["step"], f["request"]),
                                 lambda x: f"step {x[0]} · request {x[1]}")
                if picked != (f["step"], f["request"]):
                    a = answer(path, version, "q1", picked[0], picked[1])
            elif q.key == "q2":
                picked = _picker("q2", "step", f["candidates"], f["step"], lambda x: f"step {x}")
                if picked != f["step"]:
                    a = answer(path, version, "q2", picked)
            elif q.key == "q3":
                picked = _picker("q3", "step (with a decode over more than one block)", f["candidates"], f["step"],
                                 lambda x: f"step {x}")
                if picked != f["step"]:
                    a = answer(path, version, "q3", picked)
            elif q.key == "q4":
                opts = [tuple(x) for x in f["finishes"]]
                picked = _picker("q4", "finished request", opts, (f["step"], f["request"]),
                                 lambda x: f"request {x[1]} · finished at step {x[0]}")
                if picked != (f["step"], f["request"]):
                    a = answer(path, version, "q4", picked[0], picked[1])
            elif q.key == "q5":
                picked = _picker("q5", "request", f["candidates"], f["request"], lambda x: f"request {x}")
                if picked != f["request"]:
                    a = answer(path, version, "q5", None, picked)
        if not a.ok:
            st.warning(f"**This run cannot answer it:** {a.why_not}", icon=":material/block:")
        else:
            st.markdown(f"**Answer, from this run ({a.subject}).** {a.summary}")
            if q.key == "q5":
                five_accounts(path, a.facts["request"], key="st_fa", links=False, page="selftest")
            elif a.chain:
                _chain(a.chain)
            _show_me(a, q.key)
            for title, rows in a.tables.items():
                if q.key == "q5" and title == "the five accounts":
                    continue
                with st.expander(f"{title} ({len(rows)})"):
                    _table(rows, f"tbl_{q.key}_{title}")
            for note in (a.notes if q.key != "q5" else []):      # (the five-accounts panel shows its own)
                st.caption(f":material/info: {note}")
        with st.expander("The article's reference answer (答案)"):
            st.markdown(f"> {q.reference_zh}")
            st.markdown(f"*{q.reference_en}*")
            if a.ok:
                st.caption("Compare it with the answer above: the same chain, with this run's blocks, rows and "
                           "milliseconds.")
        code_ref(f"dashboard/answers/{ANSWER_FILES[q.key]}.py", "how this answer is computed from the run store")


def _no_run() -> None:
    """No run open: the questions need one — open a shipped sample here, or start the tour."""
    from dashboard.components.run_picker import open_sample, sample_label
    samples = [r for r in data.runs_in(state.samples_dir()) if not r.get("error")]
    st.info("The answers come from a run, and none is open. Open a shipped sample run here, start the guided "
            "tour on the Start page, or pick a run in the sidebar.", icon=":material/info:")
    for i, r in enumerate(samples[:4]):
        st.button(f"Answer from {sample_label(r)}", key=f"st_sample_{i}", icon=":material/quiz:",
                  on_click=open_sample, args=(r["path"], "selftest"), type="primary" if i == 0 else "secondary")
    st.page_link("views/live.py", label="Start the guided tour (Start page)", icon=":material/play_arrow:")


def main() -> None:
    st.title("Self-test")
    st.caption("The article's five questions (§九 自测), each answered from **this run's** snapshots and spans — "
               "pick another allocation, step or request to see the same answer with other values. "
               "**Show me** opens the step, tab and request where it happens.")
    if not ss.get("run_path") and ss.get("run_error") is None:
        _no_run()
        return
    cur = state.current()
    if cur is None:
        return
    path, info = cur
    version = data.file_version(path)
    src = source(path, version)
    if isinstance(src, data.RunError):
        state.show_error(src)
        return
    kinds = sorted(src.pids)
    single = set(kinds) <= {"frontend"} and len(src.pids.get("frontend", ())) <= 1
    procs = ("one process (the offline LLM: engine and worker called in-process)" if single else
             "processes: " + ", ".join(f"{k} ×{len(src.pids[k])}" for k in kinds))
    st.caption(f"This run: {n_of(len(info['steps']), 'step')}, {n_of(len(src.requests), 'finished request')}, {procs}"
               + ("" if src.attributed else " · block-pool events without request attribution (older recording)"))
    for q in QUESTIONS:
        _question(q, path, version)


main()
