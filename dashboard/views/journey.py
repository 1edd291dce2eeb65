"""Request journey: one request across processes and steps — its llm_request span
and events (frontend), the engine steps that served it (chunk kind and tokens),
the tokens it sampled, TTFT and ITL."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard import data, spans, state
from dashboard.components.code_ref import code_ref
from dashboard.theme import KIND_COLORS, STATUS_COLORS, request_color

ss = st.session_state
EVENT_COLORS = {"QUEUED": STATUS_COLORS["WAITING"], "SCHEDULED": STATUS_COLORS["RUNNING"],
                "PREEMPTED": STATUS_COLORS["PREEMPTED"], "FIRST_TOKEN": "#0072B2",
                "FINISHED": STATUS_COLORS["FINISHED_STOPPED"]}


def served_steps(records: dict[int, dict], req: str, tokens: dict) -> pd.DataFrame:
    rows = []
    for step_id, rec in records.items():
        pre = req in rec.get("preempted_req_ids", [])
        for s in rec.get("scheduled", []):
            if s["request_id"] == req:
                pos, tok = tokens["sampled"].get(step_id, {}).get(req, (None, None))
                rows.append({"step": step_id, "time_ns": rec["time_ns"], "kind": s["kind"],
                             "tokens": s["num_tokens"], "from position": s["num_computed_tokens_before"],
                             "new blocks": str(s["new_block_ids"]), "sampled": tok, "preempted": pre})
        if pre and not any(s["request_id"] == req for s in rec.get("scheduled", [])):
            rows.append({"step": step_id, "time_ns": rec["time_ns"], "kind": "preempted", "tokens": 0,
                         "from position": None, "new blocks": "", "sampled": None, "preempted": True})
    return pd.DataFrame(rows)


def journey_figure(req: dict | None, served: pd.DataFrame, req_id: str) -> go.Figure:
    t0 = req["start_ns"] if req else int(served["time_ns"].min())
    fig = go.Figure()
    if req:
        fig.add_bar(y=["frontend · llm_request"], x=[(req["end_ns"] - t0) / 1e6], base=[0], orientation="h",
                    marker_color=request_color(req_id), width=0.4, name="llm_request",
                    hovertemplate="llm_request %{x:.0f} ms<extra></extra>")
        for e in req["events"]:
            fig.add_scatter(x=[(e["time_ns"] - t0) / 1e6], y=["frontend · llm_request"], mode="markers+text",
                            marker=dict(size=12, color=EVENT_COLORS.get(e["name"], "#555"), symbol="diamond"),
                            text=[e["name"]], textposition="top center", name=e["name"], showlegend=False)
    if not served.empty:
        fig.add_scatter(x=(served["time_ns"] - t0) / 1e6, y=["engine core · steps"] * len(served),
                        mode="markers+text", text=served["step"].astype(str), textposition="bottom center",
                        marker=dict(size=14, symbol="square", color=[KIND_COLORS.get(k, STATUS_COLORS["PREEMPTED"])
                                                                      for k in served["kind"]]),
                        customdata=served[["kind", "tokens"]], name="steps",
                        hovertemplate="step %{text}: %{customdata[0]}, %{customdata[1]} tokens<extra></extra>")
    fig.update_layout(height=240, margin=dict(l=10, r=10, t=30, b=30), plot_bgcolor="white", showlegend=False,
                      xaxis_title="ms since the request arrived")
    return fig


def metrics_row(req: dict) -> None:
    c = st.columns(6)
    fmt = lambda v, u="ms": "—" if v is None else f"{v:.0f} {u}"  # noqa: E731
    c[0].metric("TTFT", fmt(req["ttft_ms"]))
    c[1].metric("ITL (mean)", fmt(req["itl_ms"]))
    c[2].metric("end to end", fmt(req["e2e_ms"]))
    c[3].metric("prompt → output tokens", f"{req['input_tokens']} → {req['output_tokens']}")
    c[4].metric("preemptions", req["num_preemptions"])
    c[5].metric("finish reason", ", ".join(req["finish_reasons"] or []) or "—")


def main() -> None:
    st.title("Request journey")
    cur = state.current()
    if cur is None:
        return
    path, info = cur
    version = data.file_version(path)
    reqs, records, tokens = (spans.request_table(path, version), data.step_records(path, version),
                             data.token_index(path, version))
    for x in (reqs, records, tokens):
        if isinstance(x, data.RunError):
            state.show_error(x)
            return
    by_id = {r["request_id"]: r for r in reqs}
    ids = list(by_id) + sorted({s["request_id"] for r in records.values() for s in r["scheduled"]} - set(by_id))
    if not ids:
        st.info("No request in this run yet.")
        return
    req_id = st.selectbox("Request", ids, key="journey_req", format_func=lambda r: f"req {r}")
    req = by_id.get(req_id)
    if req:
        metrics_row(req)
    else:
        st.caption("this request has not finished yet (its llm_request span is written when it ends)")
    served = served_steps(records, req_id, tokens)
    st.plotly_chart(journey_figure(req, served, req_id), width="stretch", key="journey_fig")
    st.dataframe(served.drop(columns=["time_ns"]), hide_index=True, width="stretch")
    known = tokens["tokens"].get(req_id, {})
    n_prompt = req["input_tokens"] if req else 0
    out_ids = [known[p] for p in sorted(known) if p >= (n_prompt or 0)]
    text = data.decode(info["meta"], out_ids)
    st.markdown(f"**Output tokens fed back so far** ({len(out_ids)}): `{out_ids}`" +
                (f"  \n→ {text!r}" if text is not None else ""))
    c1, c2 = st.columns([1, 3], vertical_alignment="bottom")
    if not served.empty:
        pick = c1.selectbox("Step", served["step"].tolist(), key="journey_step")
        c2.button("Open this step in the inspector", key="journey_open", icon=":material/search:", on_click=state.goto,
                  args=(pick, "inspector"))
    code_ref("vllm_anatomy/tracing/request_tracer.py", "RequestTracer (llm_request span) · "
                                                       "Scheduler.schedule (step records)")


main()
