"""Request journey: one request across processes and steps — its prompt, its
llm_request span and events (frontend), every engine step of its life (waiting,
preempted, or served: chunk kind and tokens), the tokens it sampled, TTFT and ITL.

The request and the step come from the URL (`request`, `step`): a link can open the
journey of the request that was preempted, at the step it was preempted. Click a
step on the chart (or pick one below) to open it in the step inspector."""
from __future__ import annotations

from typing import cast

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard import data, spans, state
from dashboard.components.code_ref import code_ref
from dashboard.components.five_accounts import five_accounts
from dashboard.components.nav import REQUEST_KEY, on_click_open, open_view
from dashboard.theme import KIND_COLORS, STATUS_COLORS, request_color, style_figure
from dashboard.words import n_of

ss = st.session_state
EVENT_COLORS = {"QUEUED": STATUS_COLORS["WAITING"], "SCHEDULED": STATUS_COLORS["RUNNING"],
                "PREEMPTED": STATUS_COLORS["PREEMPTED"], "FIRST_TOKEN": "#0072B2",
                "FINISHED": STATUS_COLORS["FINISHED_STOPPED"]}
EVENT_SYMBOLS = {"QUEUED": "circle", "SCHEDULED": "triangle-right", "PREEMPTED": "x", "FIRST_TOKEN": "star",
                 "FINISHED": "diamond"}
WAIT_COLORS = {"WAITING": STATUS_COLORS["WAITING"], "PREEMPTED": STATUS_COLORS["PREEMPTED"],
               "RUNNING": "#9E9E9E"}
ONE_TOKEN_ITL = "one token: no gap"
GLOSSARY = {"TTFT": "time to first token: from the request's arrival (QUEUED) to its first generated token",
            "ITL": "inter-token latency: the mean time between two generated tokens after the first "
                   "(decode time / (output tokens - 1))",
            "end to end": "arrival to the last token (the llm_request span)"}


def life_steps(records: dict[int, dict], statuses: dict[int, str], req: str, tokens: dict) -> pd.DataFrame:
    """Every step of the request's life, in order: served (chunk kind, tokens, new blocks, sampled
    token), waiting (WAITING before it first runs, PREEMPTED while it waits to be recomputed),
    preempted this step, or finishing."""
    rows = []
    seen = set(statuses)
    served = {step for step, rec in records.items() if any(s["request_id"] == req for s in rec.get("scheduled", []))}
    preempted = {step for step, rec in records.items() if req in rec.get("preempted_req_ids", [])}
    life = sorted(seen | served | preempted)
    last_seen = max(seen) if seen else None
    for step_id in life:
        rec = records.get(step_id, {})
        status = statuses.get(step_id)
        s = next((x for x in rec.get("scheduled", []) if x["request_id"] == req), None)
        tok = tokens["sampled"].get(step_id, {}).get(req, (None, None))[1]     # its first token this step
        pre = step_id in preempted
        if s is not None:
            kind, n, frm, blocks = s["kind"], s["num_tokens"], s["num_computed_tokens_before"], str(s["new_block_ids"])
        else:
            # NOTE: RUNNING without a scheduled entry: it holds its blocks but got no token this step
            # (the budget ran out, or under async scheduling its tokens in flight reach max_tokens).
            why = "not scheduled" if status == "RUNNING" else (status or "?").lower()
            kind, n, frm, blocks, tok = ("preempted" if pre else why), 0, None, "", None
        if status is None and s is not None and last_seen is not None and step_id > last_seen:
            status = "finished"         # served, then gone from the queues: it finished in this step
        rows.append({"step": step_id, "time_ns": rec.get("time_ns"), "status": status or "—", "kind": kind,
                     "tokens": n, "from position": frm, "new blocks": blocks, "sampled": tok, "preempted": pre})
    df = pd.DataFrame(rows, columns=["step", "time_ns", "status", "kind", "tokens", "from position", "new blocks",
                                     "sampled", "preempted"])
    for col in ("from position", "sampled"):      # integers with gaps (waiting steps), not floats
        df[col] = df[col].astype("Int64")
    return df


def _thin(xs: list[float], min_gap: float, first: int | None = None) -> list[bool]:
    """Which of the (sorted) x positions keep a text label so that kept labels are min_gap apart;
    the one at index `first` (the cursor's) is kept in any case, its neighbours give way."""
    fx = xs[first] if first is not None and 0 <= first < len(xs) else None
    keep, last = [], None
    for i, x in enumerate(xs):
        ok = i == first or ((last is None or x - last >= min_gap) and (fx is None or abs(x - fx) >= min_gap))
        keep.append(ok)
        if ok:
            last = x
    return keep


def journey_figure(req: dict | None, life: pd.DataFrame, req_id: str, cursor: int | None) -> go.Figure:
    t0 = req["start_ns"] if req else int(life["time_ns"].dropna().min())
    fig = go.Figure()
    lane_req, lane_run, lane_wait = "frontend · llm_request", "engine · steps served", "engine · steps not scheduled"
    if req:
        fig.add_bar(y=[lane_req], x=[(req["end_ns"] - t0) / 1e6], base=[0], orientation="h",
                    marker_color=request_color(req_id), marker_opacity=0.35, width=0.5, name="llm_request span",
                    hovertemplate="llm_request %{x:.0f} ms<extra></extra>", showlegend=False)
        for name in dict.fromkeys(e["name"] for e in req["events"]):
            ev = [e for e in req["events"] if e["name"] == name]
            fig.add_scatter(x=[(e["time_ns"] - t0) / 1e6 for e in ev], y=[lane_req] * len(ev), mode="markers",
                            marker=dict(size=14, color=EVENT_COLORS.get(name, "#555"),
                                        symbol=EVENT_SYMBOLS.get(name, "diamond"), line=dict(color="white", width=1)),
                            name=name, hovertemplate=name + " at %{x:.1f} ms<extra></extra>")
    timed = life.dropna(subset=["time_ns"])
    if not timed.empty:
        x = ((timed["time_ns"] - t0) / 1e6).tolist()
        end = (req["end_ns"] - t0) / 1e6 if req else 0.0
        rng = (max(x + [end]) - min(x + [0.0])) or 1.0
        run = [n > 0 and s not in ("WAITING", "PREEMPTED") for n, s in zip(timed["tokens"], timed["status"])]
        for served, lane in ((True, lane_run), (False, lane_wait)):
            part = timed[[r == served for r in run]]
            if part.empty:
                continue
            px = ((part["time_ns"] - t0) / 1e6).tolist()
            steps_here = part["step"].tolist()
            keep = _thin(px, rng * 0.035, steps_here.index(cursor) if cursor in steps_here else None)
            colors = [KIND_COLORS.get(k, WAIT_COLORS.get(s, STATUS_COLORS["PREEMPTED"])) for k, s in
                      zip(part["kind"], part["status"])]
            fig.add_scatter(x=px, y=[lane] * len(part), mode="markers+text",
                            text=[str(s) if k else "" for s, k in zip(part["step"], keep)], textposition="bottom center",
                            marker=dict(size=13, symbol="square" if served else "square-open", color=colors,
                                        line=dict(width=2 if not served else 0, color=colors)),
                            customdata=[[int(s), req_id, k, st_] for s, k, st_ in
                                        zip(part["step"], part["kind"], part["status"])],
                            name="steps served" if served else "steps not scheduled", showlegend=False,
                            hovertemplate="step %{customdata[0]}: %{customdata[3]} · %{customdata[2]}"
                                          "<extra>click: open in the inspector</extra>")
        if cursor is not None and cursor in set(timed["step"]):
            cx = float((timed.loc[timed["step"] == cursor, "time_ns"].iloc[0] - t0) / 1e6)
            fig.add_vline(x=cx, line=dict(color="#E69F00", dash="dash", width=2))
    fig.update_layout(height=300, margin=dict(l=10, r=10, t=40, b=44), plot_bgcolor="white",
                      xaxis_title="ms since the request arrived", clickmode="event+select", hovermode="closest",
                      yaxis=dict(categoryorder="array", categoryarray=[lane_wait, lane_run, lane_req]))
    style_figure(fig, legend_top=True)
    return fig


def metrics_row(req: dict) -> None:
    c = st.columns(6)
    fmt = lambda v, u="ms": "—" if v is None else f"{v:.0f} {u}"  # noqa: E731
    c[0].metric("TTFT", fmt(req["ttft_ms"]), help=GLOSSARY["TTFT"])
    # NOTE: one output token has no gap between two tokens: no ITL, for a reason the page says (grey, under
    # the value: a longer value is cut at 1440 px), not a dash that reads as a number lost on the way.
    one = req["itl_ms"] is None and req["output_tokens"] == 1
    c[1].metric("ITL (mean)", "none" if one else fmt(req["itl_ms"]), delta=ONE_TOKEN_ITL if one else None,
                delta_color="off", delta_arrow="off",
                help=GLOSSARY["ITL"] + (". This request generated one token: there is no gap to time." if one else ""))
    c[2].metric("end to end", fmt(req["e2e_ms"]), help=GLOSSARY["end to end"])
    c[3].metric("prompt → output tokens", f"{req['input_tokens']} → {req['output_tokens']}")
    c[4].metric("preemptions", req["num_preemptions"], help="times it was preempted (RUNNING → PREEMPTED): its KV "
                                                           "blocks were freed and its tokens recomputed later")
    c[5].metric("finish reason", ", ".join(req["finish_reasons"] or []) or "—")


def prompt_text(meta: dict, tokens: dict, req_id: str, n_prompt: int | None) -> None:
    known = tokens["tokens"].get(req_id, {})
    if not n_prompt:
        return
    ids = [known[p] for p in range(n_prompt) if p in known]
    text = data.decode(meta, ids)
    if text is None:
        st.markdown(f"**Prompt** ({n_prompt} tokens): `{ids}`")
        return
    st.markdown(f"**Prompt** ({n_prompt} tokens, as the model saw it — chat template included)")
    st.code(text, language=None, wrap_lines=True)


def _pick_step(life: pd.DataFrame, req_id: str) -> None:
    """Keep the step picker on the cursor when the cursor or the request changed."""
    steps = life["step"].tolist()
    cur = ss.get("cursor")
    key = (req_id, cur)
    if ss.get("_journey_for") != key or ss.get("journey_step") not in steps:
        ss.journey_step = cur if cur in steps else steps[0]
        ss._journey_for = key


def _requests(reqs: list[dict], records: dict) -> list[str]:
    by_id = [r["request_id"] for r in reqs]
    return by_id + sorted({s["request_id"] for r in records.values() for s in r.get("scheduled", [])} - set(by_id))


def _cursor_line(life: pd.DataFrame, req_id: str, cursor: int | None) -> None:
    """What happened to the request at the cursor's step, in one line."""
    here = life[life["step"] == cursor]
    if not here.empty:
        r = here.iloc[0]
        what = {"preempted": "preempted in this step: its KV blocks were freed, it waits (PREEMPTED) to be recomputed",
                "waiting": "waiting: not admitted yet", "finished": "served for the last time: it finished",
                "not scheduled": "RUNNING but not scheduled: it keeps its KV blocks and gets no token this step "
                                 "(no token budget was left for it, or, with async scheduling, its tokens in flight "
                                 "already reach max_tokens)"}
        line = what.get(r["kind"]) or what.get(str(r["status"])) or f"{r['status']} · {r['kind']}, {n_of(r['tokens'], 'token')}"
        st.markdown(f":material/arrow_right: **Step {cursor}** (the cursor, marked on the chart): req {req_id} — "
                    f"{line}.")


def _life_table(life: pd.DataFrame, cursor: int | None) -> None:
    """The steps of its life, one row each, the cursor's highlighted."""
    counts = life["status"].value_counts()
    st.caption(f"{n_of(len(life), 'step')} of its life: " + ", ".join(f"{v} {k}" for k, v in counts.items())
               + ". `status` is its state after the step (the step snapshot's queues).")

    def _mark(row):
        return ["background-color: #FFE9A8" if row["step"] == cursor else "" for _ in row]
    shown = life.drop(columns=["time_ns"])
    st.dataframe(shown.style.apply(_mark, axis=1), hide_index=True, width="stretch", key="journey_steps",
                 column_config={"status": st.column_config.TextColumn(help="WAITING / RUNNING / PREEMPTED after the "
                                                                      "step; finished = its last step"),
                                "kind": st.column_config.TextColumn(help="how it was served: prefill_chunk, "
                                                                    "final_prefill_chunk, decode, resumed; or why not: "
                                                                    "waiting, preempted, not scheduled"),
                                "sampled": st.column_config.NumberColumn(help="the token id it sampled this step")})


def _output_tokens(meta: dict, tokens: dict, req_id: str, n_prompt: int | None) -> None:
    """The output tokens fed back so far, and their text."""
    known = tokens["tokens"].get(req_id, {})
    out_ids = [known[p] for p in sorted(known) if p >= (n_prompt or 0)]
    text = data.decode(meta, out_ids)
    st.markdown(f"**Output tokens fed back so far** ({len(out_ids)}): `{out_ids}`" +
                (f"  \n→ {text!r}" if text is not None else ""))


def _siblings(req: dict, reqs: list[dict]) -> None:
    """n > 1: which sample of which request this is, and its siblings (one trace, one ParentRequest span)."""
    parent = req.get("parent_request_id")
    if parent is None:
        return
    kids = sorted((r for r in reqs if r.get("parent_request_id") == parent), key=lambda r: r["child_index"])
    others = ", ".join(f"`{r['request_id']}`" for r in kids if r["request_id"] != req["request_id"])
    st.caption(f"Sample {req['child_index']} of request `{parent}` (n > 1: the frontend runs each sample as a "
               f"request of its own; one trace holds them, a `ParentRequest` span over their `llm_request` spans). "
               f"Its siblings: {others or 'none finished'}.")


def main() -> None:
    st.title("Request journey")
    cur = state.current()
    if cur is None:
        return
    path, info = cur
    version = data.file_version(path)
    reqs, records, tokens, queues = (spans.request_table(path, version), data.step_records(path, version),
                                     data.token_index(path, version), data.queue_statuses(path, version))
    if isinstance(reqs, data.RunError) or isinstance(records, data.RunError) or isinstance(tokens, data.RunError) \
            or isinstance(queues, data.RunError):
        state.show_error(next(x for x in (reqs, records, tokens, queues) if isinstance(x, data.RunError)))
        return
    by_id = {r["request_id"]: r for r in reqs}
    ids = _requests(reqs, records)
    if not ids:
        st.info("No request in this run yet.")
        return
    # NOTE: no format_func: a bound widget writes its displayed option into the URL, which must stay the id.
    # (cast: ids is not empty, so the pick is one of them; [tool.mypy] says why mypy reads None)
    req_id = cast(str, st.selectbox("Request id", ids, key=REQUEST_KEY, bind="query-params",
                                    help="every request of the run; the URL's `request` opens one"))
    req = by_id.get(req_id)
    if req:
        metrics_row(req)
        _siblings(req, reqs)
    else:
        st.caption("this request has not finished yet (its llm_request span is written when it ends)")
    with st.expander("The five accounts of this request (time, memory, communication, CPU, request)",
                     icon=":material/receipt_long:"):
        five_accounts(path, req_id, key="journey_fa")
    life = life_steps(records, queues.get(str(req_id), {}), req_id, tokens)
    n_prompt = req["input_tokens"] if req else None
    prompt_text(info["meta"], tokens, req_id, n_prompt)
    if life.empty:
        st.caption("no step of this request is recorded")
        return
    _pick_step(life, req_id)
    cursor = ss.get("cursor")
    st.caption("Top: the request's span in the frontend and its events; middle: the steps that served it (filled, "
               "coloured by chunk kind); bottom: the steps it was not scheduled (open squares: yellow WAITING, red "
               "PREEMPTED, grey RUNNING but given no token). "
               "**Click a step to open it in the Step inspector.**")
    st.plotly_chart(journey_figure(req, life, req_id, cursor), width="stretch", key="journey_fig",
                    on_select=on_click_open("journey_fig", "inspector", with_request=True), selection_mode="points",
                    config={"displayModeBar": False})
    _cursor_line(life, req_id, cursor)
    _life_table(life, cursor)
    _output_tokens(info["meta"], tokens, req_id, n_prompt)
    c1, c2 = st.columns([1, 3], vertical_alignment="bottom")
    pick = c1.selectbox("Step", life["step"].tolist(), key="journey_step")
    c2.button("Open this step in the inspector", key="journey_open", icon=":material/search:", on_click=open_view,
              args=("inspector", pick, None, req_id))
    code_ref("vllm_anatomy/tracing/request_tracer.py", "RequestTracer (llm_request span) · "
                                                       "Scheduler.schedule (step records)")


main()
