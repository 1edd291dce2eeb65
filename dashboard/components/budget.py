"""The token-budget bar of one step: max_num_batched_tokens split by request and
chunk kind (prefill chunk, last prefill chunk, decode, resumed), and why the
scheduler stopped admitting WAITING requests."""
from __future__ import annotations

import plotly.graph_objects as go
import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.theme import KIND_COLORS, request_color

STOP_REASONS = {
    "queue_empty": "nobody was waiting",
    "budget_exhausted": "the token budget was spent (RUNNING requests are served first)",
    "max_num_seqs": "the running batch is full (max_num_seqs)",
    "no_free_blocks": "allocate_slots refused the head of the waiting queue: no free KV blocks",
    "preempted_this_step": "a request was preempted this step: no admissions",
    "chunked_prefill_disabled": "the head's prompt does not fit the remaining budget whole",
}
PATTERNS = {"prefill_chunk": "/", "final_prefill_chunk": "\\", "decode": "", "resumed": "x"}


def budget_figure(rec: dict) -> go.Figure:
    fig = go.Figure()
    for s in rec["scheduled"]:
        fig.add_bar(y=["budget"], x=[s["num_tokens"]], orientation="h", name=f"req {s['request_id']}",
                    marker=dict(color=request_color(s["request_id"]), pattern=dict(shape=PATTERNS.get(s["kind"], ""), fillmode="overlay", fgcolor="white"),
                                line=dict(color="white", width=1)),
                    text=f"req {s['request_id']} · {s['kind'].replace('_', ' ')} · {s['num_tokens']}",
                    textposition="inside", insidetextanchor="middle",
                    hovertemplate=f"req {s['request_id']}<br>{s['kind']}<br>{s['num_tokens']} tokens from "
                                  f"position {s['num_computed_tokens_before']}<extra></extra>")
    left = rec["token_budget_end"]
    if left > 0:
        fig.add_bar(y=["budget"], x=[left], orientation="h", name="unused",
                    marker=dict(color=KIND_COLORS["unused"]), text=f"unused {left}", textposition="inside",
                    hovertemplate=f"{left} tokens unused<extra></extra>")
    fig.update_layout(barmode="stack", height=110, margin=dict(l=0, r=0, t=4, b=4), showlegend=False,
                      xaxis=dict(range=[0, rec["token_budget_start"]], title=None),
                      yaxis=dict(visible=False), plot_bgcolor="white")
    return fig


def budget(rec: dict) -> None:
    used = rec["token_budget_start"] - rec["token_budget_end"]
    st.markdown(f"**Token budget** {used} / {rec['token_budget_start']} tokens used "
                f"(max_num_batched_tokens) · pattern: ╱ prefill chunk, ╲ last prefill chunk, plain decode, ✕ resumed")
    st.plotly_chart(budget_figure(rec), width="stretch", key="budget_bar",
                    config={"displayModeBar": False})
    reason = rec.get("admission_stop_reason")
    st.markdown(f"Admission stopped: **`{reason}`** — {STOP_REASONS.get(reason, 'not recorded')}")
    code_ref("vllm_anatomy/core/sched/scheduler.py", "Scheduler.schedule → SchedulerStepRecord")
