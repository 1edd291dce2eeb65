"""The five accounts of one request (the article's §八/§九 Q5): time, memory,
communication, CPU and request, side by side, computed from the run store
(dashboard/answers/q5_accounts.py), with why no single number suffices — in the
run's own values. One function, drawn on the Self-test page and on the Request
journey page; on the Self-test page it closes with the article's trade-off
"投机解码省轮次但涨每步时间" measured in the shipped speculative-decoding pair
(dashboard/answers/q5_tradeoff.py), with a way to that pair on the Compare page."""
from __future__ import annotations

import streamlit as st

from dashboard import data, state
from dashboard.answers.cached import answer
from dashboard.answers.q5_tradeoff import ARTICLE, spec_pair, spec_tradeoff
from dashboard.answers.q5_accounts import itl_text, mb_text, ms_text
from dashboard.components.nav import link, open_view
from dashboard.components.run_picker import tp_sample_button
from dashboard.words import n_of


def five_accounts(path: str, request_id: str | None, key: str = "fa", links: bool = True,
                  page: str = "journey") -> None:
    """Draw the five accounts of `request_id` in the run at `path` (None: the run's most telling request);
    links: with "show me" buttons (the Self-test page draws its own); page: the page it is drawn on
    (a run without collectives offers the shipped tensor-parallel sample there)."""
    a = answer(path, data.file_version(path), "q5", None, None if request_id is None else str(request_id))
    if not a.ok:
        st.info(a.why_not, icon=":material/info:")
        return
    f = a.facts
    if request_id is not None and f["request"] != str(request_id):
        st.info(f"Request {request_id} has not finished in this run (its llm_request span is written when it "
                "ends): its five accounts are not closed yet.", icon=":material/info:")
        return
    t, m = f["time"], f["memory"]
    with st.container(border=True, key=f"{key}_panel"):
        st.markdown(f"**The five accounts of request {f['request']}** — *one request, five views, five different "
                    "bills* (article §八)")
        cols = st.columns(5)
        with cols[0]:
            st.markdown("**:material/timer: time**")
            st.markdown(f"queue {ms_text(t, 'queue ms')}  \nprefill {ms_text(t, 'prefill ms')}  \ndecode "
                        f"{ms_text(t, 'decode ms')}  \n**TTFT {ms_text(t, 'TTFT ms')}**  \n{itl_text(t)}")
        with cols[1]:
            st.markdown("**:material/memory: memory**")
            st.markdown(f"**KV {mb_text(m['KV MB'], 2)}** ({m['peak KV blocks']} blocks, peak at step {m['at step']})  \n"
                        f"pool {mb_text(m['pool MB'])} ({m['pool blocks']} blocks)  \nweights {mb_text(m['weights MB'], 0)}"
                        + ("  \n(each per rank)" if m.get("per rank") else ""))
        with cols[2]:
            st.markdown("**:material/swap_horiz: communication**")
            c = f["collectives"]
            if f["have_counts"]:
                st.markdown(f"**{c['all_reduce'][0]} all-reduces** over {n_of(len(f['steps']), 'step')}, each joined by "
                            f"every rank  \n{c['all_reduce'][1] / 2 ** 20:,.2f} MB handed to them per rank")
            else:
                st.markdown("**0 collectives**  \none device: nothing to all-reduce")
                tp_sample_button(f"{key}_tp_sample", page, "See them in a TP run", current=path)
            st.markdown("  \n".join(f"{v} {k.split(' (')[0]}" for k, v in f["ipc"].items()))
        with cols[3]:
            st.markdown("**:material/developer_board: CPU (host)**")
            st.markdown("  \n".join(f"{k} {tot:,.2f} ms" for k, (tot, _) in f["cpu"].items())
                        + f"  \n**its share {f['cpu_share']:,.2f} ms** of {f['cpu_total']:,.2f}")
        with cols[4]:
            st.markdown("**:material/route: request**")
            st.markdown("  \n".join(f"{p['status']} @ {p['from step']}"
                                    + (f"–{p['to step']}" if p["to step"] != p["from step"] else "")
                                    for p in f["path"]))
        if f["why"]:
            st.markdown("**Why no single number suffices — on this run:**\n" + "\n".join(f"- {w}" for w in f["why"]))
        if page == "selftest":
            tradeoff(key)
        st.caption(" · ".join(a.notes))
        shown = [s for s in a.show_me if s.page != "journey"] if links else []
        if shown:
            bc = st.columns(len(shown))
            for i, s in enumerate(shown):
                bc[i].button(f"Show me: {s.label} →", key=f"{key}_show_{i}", on_click=open_view,
                             args=(s.page, s.step, s.tab, s.request), help=s.where)
                bc[i].markdown(f"[{s.where}]({link(s.page, s.step, s.tab, s.request)})")


@st.cache_data(max_entries=4, show_spinner=False)
def _tradeoff(compare_dir: str, versions: tuple) -> dict | None:
    return spec_tradeoff(compare_dir)


def tradeoff(key: str) -> None:
    """The article's "投机解码省轮次但涨每步时间", quoted with the shipped speculative-decoding pair's numbers,
    and a way to open that pair on the Compare page (or how to get it, when it is not here)."""
    d = state.compare_dir()
    pair = spec_pair(d)
    t = _tradeoff(d, tuple(data.file_version(pair[p]) for p in ("path_a", "path_b"))) if pair else None
    if t is None:
        st.markdown(f"**The article's trade-off, measured:** {ARTICLE} (speculative decoding saves rounds but makes "
                    "each step longer) — the shipped speculative-decoding pair is not here: start one on the Compare "
                    "page (Start a pair → speculative decoding), or record it with `python "
                    "scripts/record_compare_pairs.py --only spec-decode`.")
        st.page_link("views/compare.py", label="Open the Compare page", icon=":material/compare_arrows:")
        return
    st.markdown(f"**The article's trade-off, measured:** {t['sentence']}")
    c1, c2 = st.columns([2, 5], vertical_alignment="center")
    c1.button("Show me →", key=f"{key}_spec_pair", on_click=_open_pair, args=(t["pair"],),
              help="Compare page, the shipped speculative-decoding pair")
    c2.markdown(f"[{t['title']}]({t['link']}) — opens the Compare page on this pair: the five accounts side by "
                "side, and both runs' steps aligned")


def _open_pair(name: str) -> None:
    ss = st.session_state
    ss.cmp_mode, ss.cmp_pair = "A shipped pair", name
    ss.goto_page = "compare"

