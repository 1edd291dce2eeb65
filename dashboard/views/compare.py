"""Compare two runs: the same prompts with one engine argument changed, side by side — the five
accounts of each with their deltas, one sentence per account saying what moved and why, and the
two runs' steps aligned (step time, tokens per step, KV usage, preemptions).

Three ways to a pair: a pair shipped in samples/compare/ (recorded by
scripts/record_compare_pairs.py), any two runs of the run list, or a pair started here
(dashboard/live_pair.py: the pair workload twice, one knob changed, one run after the other).
The URL keeps the pair: `compare?a=<run>&b=<run>`."""
from __future__ import annotations

import json
import os
from typing import cast

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from dashboard import compare as cmp
from dashboard import data, spans, state
from dashboard.components.code_ref import code_ref
from dashboard.components.run_header import run_header
from dashboard.components.run_picker import sample_label
from dashboard.live_pair import LivePair
from dashboard.scenarios import pair_specs
from dashboard.theme import style_figure

ss = st.session_state
MODES = ["A shipped pair", "Any two runs", "Start a pair"]
COLORS = {"a": "#0072B2", "b": "#E66E1E"}


# -- the runs ----------------------------------------------------------------------------------------
def shipped_pairs() -> list[dict]:
    """samples/compare/pairs.json: the pairs whose two files are here."""
    path = os.path.join(state.compare_dir(), "pairs.json")
    try:
        with open(path) as f:
            pairs = json.load(f)["pairs"]
    except (OSError, ValueError, KeyError):
        return []
    out = []
    for p in pairs:
        a, b = (os.path.join(state.compare_dir(), p[s]["file"]) for s in ("a", "b"))
        if os.path.isfile(a) and os.path.isfile(b):
            out.append({**p, "path_a": a, "path_b": b})
    return out


def all_runs() -> dict[str, str]:
    """path -> label of every run the dashboard can open (trace dir, lessons, samples, compare samples)."""
    out: dict[str, str] = {}
    for d, prefix in ((state.trace_dir(), ""), (state.lessons_dir(), "lesson · "), (state.samples_dir(), None),
                      (state.compare_dir(), "pair sample · ")):
        for r in data.runs_in(d):
            if r.get("error") or r["path"] in out:
                continue
            out[r["path"]] = sample_label(r) if prefix is None else prefix + os.path.basename(r["path"])
    return out


def _from_url() -> None:
    """?a=<run>&b=<run> opens that pair (once per URL)."""
    qa, qb = st.query_params.get("a"), st.query_params.get("b")
    if not qa or not qb or ss.get("cmp_url") == (qa, qb):
        return
    ss.cmp_url = (qa, qb)
    pa, pb = state.resolve_run(qa), state.resolve_run(qb)
    if isinstance(pa, str) and isinstance(pb, str):
        ss.cmp_pending = (pa, pb)


def _shipped_pair_of(pairs: list[dict], a: str, b: str) -> dict | None:
    """The shipped pair whose run A is `a` and run B is `b` (None: two runs of no shipped pair)."""
    return next((p for p in pairs if (os.path.abspath(p["path_a"]), os.path.abspath(p["path_b"]))
                 == (os.path.abspath(a), os.path.abspath(b))), None)


def _choose() -> tuple[str, str] | None:
    pairs = shipped_pairs()
    if ss.get("cmp_pending"):
        a, b = ss.pop("cmp_pending")
        # NOTE: a link naming a shipped pair's two runs (compare?a=…&b=…, what this page writes for
        # it) opens it as that pair, with its description, as picking it here does.
        shipped = _shipped_pair_of(pairs, a, b)
        if shipped is not None:
            ss.cmp_mode, ss.cmp_pair = MODES[0], shipped["name"]
        else:
            ss.cmp_a, ss.cmp_b = a, b
            ss.cmp_mode = MODES[1]
    if "cmp_mode" not in ss:
        ss.cmp_mode = MODES[0] if pairs else MODES[1]
    mode = st.radio("Which runs", MODES, key="cmp_mode", horizontal=True, label_visibility="collapsed")
    if mode == MODES[0]:
        if not pairs:
            st.info("No pair ships in `samples/compare/` (record them: `python scripts/record_compare_pairs.py`). "
                    "Pick any two runs, or start a pair.")
            return None
        names = [p["name"] for p in pairs]
        pick = st.selectbox("Pair", names, key="cmp_pair", format_func=lambda n: next(
            f"{p['title']} ({p['device']})" for p in pairs if p["name"] == n))
        p = next(x for x in pairs if x["name"] == pick)
        st.caption(p.get("description", ""))
        # "Any two runs" starts from this pair's two runs (its pickers are not drawn now: they may be set).
        ss.cmp_a, ss.cmp_b = p["path_a"], p["path_b"]
        return p["path_a"], p["path_b"]
    if mode == MODES[1]:
        runs = all_runs()
        paths = list(runs)
        if len(paths) < 2:
            st.info("Fewer than two runs are in the run list: start a pair, or record runs first.")
            return None
        for key, default in (("cmp_a", 1), ("cmp_b", 0)):
            if ss.get(key) not in paths:
                ss[key] = paths[min(default, len(paths) - 1)]
        c1, c2 = st.columns(2)
        a = c1.selectbox("Run A", paths, key="cmp_a", format_func=runs.get)
        b = c2.selectbox("Run B", paths, key="cmp_b", format_func=runs.get)
        shipped = _shipped_pair_of(pairs, a, b)
        if shipped is not None:
            st.caption(shipped.get("description", ""))
        return (a, b) if a != b else None
    _pair_form()
    return None


def _pair_form() -> None:
    on_gpu = _has_gpu()
    knobs = [k for k in cmp.KNOBS]
    label = {k.arg: k.label + ("" if k.available else " — not in this engine yet")
             + (" — GPU only" if k.needs_gpu and not on_gpu else "") for k in knobs}
    # (the casts below: each widget has options and an index, so its value is one of them; [tool.mypy] says
    # why mypy reads None)
    arg = cast(str, st.selectbox("Change one knob", [k.arg for k in knobs], key="cmp_knob",
                                 format_func=label.__getitem__))
    knob = cmp.BY_ARG[arg]
    st.caption(f"`{knob.arg}`: {knob.what}.")
    if arg == "speculative_config":
        st.caption("The same prompts twice — copy and edit tasks (the answer repeats the prompt, so prompt lookup "
                   "finds drafts), greedy — first with A, then with B: one run after the other, so they do not "
                   "share the cores.")
    else:
        st.caption("The same prompts twice (a shared system prompt, a long prompt arriving mid-run, more requests "
                   "than a small batch admits), first with A, then with B: one run after the other, so they do not "
                   "share the cores.")
    if not knob.available:
        st.info(f"{knob.label} is not in this engine yet: when it lands, it becomes a knob here "
                "(dashboard/compare.py: KNOBS).", icon=":material/schedule:")
        return
    if knob.needs_gpu and not on_gpu:
        st.info("CUDA graphs exist only on a GPU: on this CPU both runs would be eager. The GPU pair's recording "
                "command: `python scripts/record_compare_pairs.py --gpu`.", icon=":material/memory:")
        return
    c1, c2, c3 = st.columns([1, 1, 2])
    a_default, b_default = knob.values
    a: dict[str, str | int] | bool | int | None      # the knob's value: a speculative config, a switch, a size
    b: dict[str, str | int] | bool | int | None
    if arg == "speculative_config":
        names = list(SPEC_CHOICES)
        a = SPEC_CHOICES[cast(str, c1.selectbox("A", names, index=0, key="cmp_va_spec"))]
        b = SPEC_CHOICES[cast(str, c2.selectbox("B", names, index=names.index(cmp.spec_text(b_default)), key="cmp_vb_spec"))]
    elif isinstance(a_default, bool):
        a = c1.selectbox("A", [False, True], index=int(a_default), key=f"cmp_va_{arg}", format_func=lambda v: "on" if v else "off")
        b = c2.selectbox("B", [False, True], index=int(b_default), key=f"cmp_vb_{arg}", format_func=lambda v: "on" if v else "off")
    else:
        a = c1.number_input("A", 1, 8192, int(a_default), key=f"cmp_va_{arg}")
        b = c2.number_input("B", 1, 8192, int(b_default), key=f"cmp_vb_{arg}")
    if arg == "enforce_eager":
        st.caption("enforce_eager on = CUDA graphs off.")
    procs = cast(int, c3.radio("Processes", [1, 3], key="cmp_procs", horizontal=True,
                               format_func=lambda n: "one process" if n == 1 else "three (API server → engine → worker)"))
    if st.button("Start the pair", key="cmp_start", icon=":material/play_arrow:", type="primary", disabled=a == b):
        old = ss.get("live_pair")
        if old is not None:
            old.stop()
        ss.live_pair = LivePair.start(*pair_specs(arg, a, b, procs), state.trace_dir())
        ss.cmp_pair_seen = None
    if ss.get("live_pair") is not None:
        st.fragment(_pair_progress, run_every=1.0)()


# The speculative configs the form offers (ngram: prompt lookup 2..4, as bench/spec_decode.py).
SPEC_CHOICES = {cmp.spec_text(v): v for v in (None, *({"method": "ngram", "num_speculative_tokens": k,
                                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4}
                                                     for k in (1, 3, 5)))}


def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _pair_progress() -> None:
    pair = ss.live_pair
    p = pair.poll()
    knob = cmp.BY_ARG[pair.specs[0]["pair"]["knob"]]
    va, vb = (pair.specs[i]["engine_args"][knob.arg] for i in (0, 1))
    for side, v in (("a", va), ("b", vb)):
        s = p.get(side)
        where = "waiting for A" if s is None else f"{s['state']} · step {s.get('step') or 0}"
        st.markdown(f"**{side.upper()}** (`{knob.arg}` = {cmp.value_text(knob, v)}): {where}")
    if p["state"] == "error":
        st.error(f"The pair stopped: run {p['side'].upper()} failed — {p.get('error', '')}", icon=":material/error:")
    elif p["state"] == "done" and ss.get("cmp_pair_seen") != id(pair):
        ss.cmp_pair_seen = id(pair)
        ss.cmp_pending = (p["a"]["run_path"], p["b"]["run_path"])
        st.rerun(scope="app")


# -- the comparison ----------------------------------------------------------------------------------
@st.cache_data(max_entries=16, show_spinner=False)
def _summary(path: str, version: tuple) -> dict | data.RunError:
    steps = data.step_table(path, version)
    if isinstance(steps, data.RunError):
        return steps
    reqs = spans.request_table(path, version)
    if isinstance(reqs, data.RunError):
        return reqs
    return cmp.summary(path, steps, reqs)


@st.cache_data(max_entries=16, show_spinner=False)
def _step_ms(path: str, version: tuple) -> dict[int, float]:
    from vllm_anatomy.tracing.reader import open_run
    with open_run(path) as run:
        return {s.step_id: s.duration_ns / 1e6 for s in run.spans("EngineCore.step") if s.step_id is not None}


def _table(a: dict, b: dict) -> pd.DataFrame:
    rows = []
    spec = a.get("speculative") or b.get("speculative")
    for account, key, label, unit, lower in cmp.METRICS:
        if key in cmp.SPEC_ONLY and not spec:
            continue
        d, rel = cmp.delta(a.get(key), b.get(key))
        better = "" if d in (None, 0) or lower is None or rel is None or abs(rel) < cmp.NOISE else \
            ("better" if (d < 0) == lower else "worse")
        rows.append({"account": cmp.ACCOUNT_TITLES[account], "metric": label + (f" ({unit})" if unit else ""),
                     "A": _cell(a.get(key)), "B": _cell(b.get(key)),
                     "Δ B − A": cmp.delta_text(d),
                     "change": "—" if rel is None else cmp.change_text(rel)
                     + (f" · {better}" if better else "")})
    return pd.DataFrame(rows)


def _cell(v) -> str:
    """A run's figure in the table; one the run did not record is said so (a dash is kept for a delta
    that cannot be taken)."""
    return "not recorded" if v is None else cmp.fmt(v)


def _aligned(sa: pd.DataFrame, sb: pd.DataFrame) -> go.Figure:
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        subplot_titles=("step time (ms)", "tokens scheduled per step", "KV usage (%)",
                                        "preemptions so far"))
    for side, s in (("a", sa), ("b", sb)):
        for row, col in enumerate(("step_ms", "tokens", "kv_usage", "preemptions"), start=1):
            fig.add_scatter(x=s["i"], y=s[col], mode="lines+markers", name=f"run {side.upper()}", legendgroup=side,
                            showlegend=row == 1, line=dict(color=COLORS[side], width=2), marker=dict(size=5),
                            customdata=s["step"], hovertemplate=f"run {side.upper()} · step %{{customdata}}: "
                                                                "%{y:.2f}<extra></extra>", row=row, col=1)
    fig.update_layout(height=720, margin=dict(l=10, r=10, t=40, b=40), plot_bgcolor="white")
    fig.update_xaxes(title_text="step (1 = each run's first)", row=4, col=1)
    style_figure(fig, legend_top=True)
    fig.update_annotations(font_size=13)
    return fig


def compare_view(path_a: str, path_b: str) -> None:
    va, vb = data.file_version(path_a), data.file_version(path_b)
    info_a, info_b = data.run_info(path_a, va), data.run_info(path_b, vb)
    if isinstance(info_a, data.RunError) or isinstance(info_b, data.RunError):
        state.show_error(next(x for x in (info_a, info_b) if isinstance(x, data.RunError)))
        return
    knobs = cmp.knob_of(info_a["meta"], info_b["meta"])
    a, b = _summary(path_a, va), _summary(path_b, vb)
    if isinstance(a, data.RunError) or isinstance(b, data.RunError):
        state.show_error(next(x for x in (a, b) if isinstance(x, data.RunError)))
        return
    names = (os.path.basename(path_a), os.path.basename(path_b))
    st.query_params["a"], st.query_params["b"] = names
    ss.cmp_url = names          # (our own write: not a new link for _from_url)
    for side, path in (("A", path_a), ("B", path_b)):
        value = "; ".join(f"`{k.arg}` = **{cmp.value_text(k, v_a if side == 'A' else v_b)}**"
                          for k, v_a, v_b in knobs)
        st.markdown(f"<span style='color:{COLORS[side.lower()]};font-weight:700'>■ Run {side}</span> · "
                    f"`{os.path.basename(path)}`" + (f" · {value}" if value else ""), unsafe_allow_html=True)
        run_header(path)
    if not knobs:
        st.warning("These two runs have the same settings on every knob: their differences are the machine's noise.",
                   icon=":material/info:")
    elif len(knobs) > 1:
        st.warning("These runs differ in " + ", ".join(f"`{k.arg}`" for k, _, _ in knobs) + ": a fair comparison "
                   "changes one knob, so the sentences below name no cause.", icon=":material/warning:")
    rest = cmp.other_differences(info_a["meta"], info_b["meta"])
    if rest:
        st.caption("Also different: " + "; ".join(rest[:6]) + (" …" if len(rest) > 6 else ""))
    st.markdown("#### What moved, and why")
    lines = cmp.sentences(a, b, knobs)
    st.markdown("\n".join(f"- **{cmp.ACCOUNT_TITLES[k]}**: {lines[k]}" for k in cmp.ACCOUNTS))
    st.caption("“优化一笔常动另一笔” — improving one account often moves another (the article, §九 Q5): read the "
               "five lines together.")
    st.markdown("#### The five accounts, side by side")
    st.table(_table(a, b), border="horizontal", hide_index=True)
    st.markdown("#### The two runs, step by step")
    sa = cmp.series(data.step_table(path_a, va), _step_ms(path_a, va))
    sb = cmp.series(data.step_table(path_b, vb), _step_ms(path_b, vb))
    st.plotly_chart(_aligned(sa, sb), width="stretch", key="cmp_aligned", config={"displayModeBar": False})
    c1, c2 = st.columns(2)
    c1.button("Open run A in the step inspector", key="cmp_open_a", icon=":material/search:",
              on_click=_open, args=(path_a,))
    c2.button("Open run B in the step inspector", key="cmp_open_b", icon=":material/search:",
              on_click=_open, args=(path_b,))
    code_ref("dashboard/compare.py", "summary, sentences, KNOBS (what each knob moves, and why)")


def _open(path: str) -> None:
    state.open_run(path)
    ss.goto_page = "inspector"


def main() -> None:
    st.title("Compare two runs")
    st.caption("No number stands alone: the same prompts with one knob changed, the five accounts of each run "
               "side by side with their deltas, one sentence per account on what moved and why, and the steps "
               "of both runs aligned.")
    _from_url()
    picked = _choose()
    if picked is not None:
        compare_view(*picked)


main()
