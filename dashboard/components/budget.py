"""The token-budget bar of one step: max_num_batched_tokens split by request and
chunk kind (prefill chunk, last prefill chunk, decode, resumed), and why the
scheduler stopped admitting WAITING requests."""
from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.theme import KIND_COLORS, chip, request_color, short_req_id, style_figure, text_on
from dashboard.words import n_of
from vllm_anatomy.core.sched.record import AdmissionStop

PATTERNS = {"prefill_chunk": "/", "final_prefill_chunk": "\\", "decode": "", "resumed": "x"}
PATTERN_LEGEND = [("╱", "prefill_chunk", "a chunk of a prompt that does not end it: no token is sampled"),
                  ("╲", "final_prefill_chunk", "the prompt's last chunk: the step samples its first token"),
                  ("plain", "decode", "one new token of a running request"),
                  ("✕", "resumed", "a preempted request coming back: its tokens are recomputed")]


def budget_figure(rec: dict) -> go.Figure:
    fig = go.Figure()
    for s in rec["scheduled"]:
        color, rid = request_color(s["request_id"]), short_req_id(s["request_id"])
        fig.add_bar(y=["budget"], x=[s["num_tokens"]], orientation="h", name=f"req {rid}",
                    marker=dict(color=color, pattern=dict(shape=PATTERNS.get(s["kind"], ""), fillmode="overlay",
                                                          fgcolor="white", fgopacity=0.6),
                                line=dict(color="white", width=1)),
                    textfont=dict(color=text_on(color)),
                    text=f"req {rid} · {s['kind'].replace('_', ' ')} · {s['num_tokens']}",
                    textposition="inside", insidetextanchor="middle",
                    hovertemplate=f"req {s['request_id']}<br>{s['kind']}<br>{n_of(s['num_tokens'], 'token')} from "
                                  f"position {s['num_computed_tokens_before']}<extra></extra>")
    left = rec["token_budget_end"]
    if left > 0:
        fig.add_bar(y=["budget"], x=[left], orientation="h", name="unused",
                    marker=dict(color=KIND_COLORS["unused"]), text=f"unused {left}", textposition="inside",
                    hovertemplate=f"{n_of(left, 'token')} unused<extra></extra>")
    fig.update_layout(barmode="stack", height=110, margin=dict(l=0, r=0, t=4, b=4), showlegend=False,
                      xaxis=dict(range=[0, rec["token_budget_start"]], title=None),
                      yaxis=dict(visible=False), plot_bgcolor="white")
    style_figure(fig)
    return fig


def budget_html(rec: dict) -> str:
    """The same bar as plain HTML (no chart to load): the live page redraws it every second, and a
    Plotly chart redrawn that often showed as an empty grey box until it loaded."""
    cells = []
    for s in rec["scheduled"]:
        color, rid = request_color(s["request_id"]), short_req_id(s["request_id"])
        kind = s["kind"].replace("_", " ")
        hatch = {"prefill_chunk": "repeating-linear-gradient(45deg,rgba(255,255,255,.35) 0 4px,transparent 4px 9px),",
                 "final_prefill_chunk": "repeating-linear-gradient(-45deg,rgba(255,255,255,.35) 0 4px,transparent 4px 9px),",
                 "resumed": "repeating-linear-gradient(45deg,rgba(255,255,255,.35) 0 2px,transparent 2px 6px),"
                            "repeating-linear-gradient(-45deg,rgba(255,255,255,.35) 0 2px,transparent 2px 6px),"
                 }.get(s["kind"], "")
        cells.append(f"<div title='req {s['request_id']} · {kind} · {n_of(s['num_tokens'], 'token')} from position "
                     f"{s['num_computed_tokens_before']}' style='flex:{s['num_tokens']} 0 0;min-width:0;"
                     f"background:{hatch}{color};color:{text_on(color)};border-right:1px solid white;"
                     f"overflow:hidden;white-space:nowrap;text-overflow:ellipsis;padding:0 4px;font-size:13px'>"
                     f"req {rid} · {kind} · {s['num_tokens']}</div>")
    left = int(rec["token_budget_end"])
    if left > 0:
        cells.append(f"<div title='{n_of(left, 'token')} unused' style='flex:{left} 0 0;min-width:0;background:"
                     f"{KIND_COLORS['unused']};color:#1F1F1F;overflow:hidden;white-space:nowrap;padding:0 4px;"
                     f"font-size:13px'>unused {left}</div>")
    return (f"<div data-testid='va-budget-bar' style='display:flex;height:30px;line-height:30px;width:100%;"
            f"border:1px solid #CCC;border-radius:4px;overflow:hidden'>{''.join(cells)}</div>")


def budget(rec: dict, html_bar: bool = False) -> None:
    used = rec["token_budget_start"] - rec["token_budget_end"]
    legend = " ".join(chip(f"{mark} {kind}", "#F0F0F0", title=why) for mark, kind, why in PATTERN_LEGEND)
    st.markdown(f"**Token budget** {used} / {rec['token_budget_start']} tokens used "
                f"(max_num_batched_tokens) · hatching: {legend}", unsafe_allow_html=True)
    if html_bar:
        st.markdown(budget_html(rec), unsafe_allow_html=True)
    else:
        st.plotly_chart(budget_figure(rec), width="stretch", key="budget_bar", config={"displayModeBar": False})
    st.caption(" · ".join(f"{mark} `{kind}`: {why}" for mark, kind, why in PATTERN_LEGEND))
    reason = rec.get("admission_stop_reason")
    known = reason in AdmissionStop._value2member_map_
    st.markdown(f"Admission stopped: **`{reason}`** — {AdmissionStop(reason).description if known else 'not recorded'}")
    code_ref("vllm_anatomy/core/sched/scheduler.py", "Scheduler.schedule → SchedulerStepRecord")
