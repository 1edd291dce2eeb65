"""Metrics over time, one point per committed step (downsampled past 2000 steps):
batch tokens (prefill vs decode), running / waiting, KV cache usage, prefix-cache
hit rate, preemptions and throughput."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard import state
from dashboard.components.code_ref import code_ref
from dashboard.theme import KIND_COLORS, STATUS_COLORS

MAX_POINTS = 2000


def downsample(df: pd.DataFrame) -> pd.DataFrame:
    """Bucket long runs: sums for counts, max for levels, so peaks survive."""
    if len(df) <= MAX_POINTS:
        return df
    size = -(-len(df) // MAX_POINTS)
    g = df.groupby(df.index // size)
    return pd.DataFrame({"step": g["step"].first(), "t_s": g["t_s"].last(), "prefill_tokens": g["prefill_tokens"].mean(),
                         "decode_tokens": g["decode_tokens"].mean(), "running": g["running"].max(),
                         "waiting": g["waiting"].max(), "kv_usage": g["kv_usage"].max(),
                         "preempted": g["preempted"].sum(), "hit_rate": g["hit_rate"].last(),
                         "throughput": g["throughput"].mean(), "cum_preempted": g["cum_preempted"].last()})


def derive(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    q = df["query_tokens"].cumsum()
    df["hit_rate"] = (df["hit_tokens"].cumsum() / q.where(q > 0)).fillna(0.0)
    df["cum_preempted"] = df["preempted"].cumsum()
    dt = df["t_s"].diff().rolling(8, min_periods=1).sum()
    df["throughput"] = (df["tokens"].rolling(8, min_periods=1).sum() / dt).fillna(0.0)
    return df


def _fig(title: str, height: int = 220) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=dict(text=title, font=dict(size=13)), height=height, plot_bgcolor="white",
                      margin=dict(l=10, r=10, t=30, b=30), legend=dict(orientation="h", y=-0.3),
                      xaxis_title="step", hovermode="x unified")
    return fig


def figures(d: pd.DataFrame, cursor: int | None) -> list[tuple[str, go.Figure]]:
    tok = _fig("Batch tokens per step")
    tok.add_bar(x=d["step"], y=d["prefill_tokens"], name="prefill", marker_color=KIND_COLORS["final_prefill_chunk"])
    tok.add_bar(x=d["step"], y=d["decode_tokens"], name="decode", marker_color=KIND_COLORS["decode"])
    tok.update_layout(barmode="stack")
    q = _fig("Running / waiting requests")
    q.add_scatter(x=d["step"], y=d["running"], name="running", line=dict(color=STATUS_COLORS["RUNNING"], shape="hv"))
    q.add_scatter(x=d["step"], y=d["waiting"], name="waiting", line=dict(color=STATUS_COLORS["WAITING"], shape="hv"))
    kv = _fig("KV cache usage and prefix-cache hit rate")
    kv.add_scatter(x=d["step"], y=d["kv_usage"], name="KV usage", fill="tozeroy", line=dict(color="#4A6FA5"))
    kv.add_scatter(x=d["step"], y=d["hit_rate"], name="prefix hit rate (cumulative)", line=dict(color="#0072B2", dash="dot"))
    kv.update_yaxes(tickformat=".0%", range=[0, 1.05])
    pre = _fig("Preemptions")
    pre.add_bar(x=d["step"], y=d["preempted"], name="this step", marker_color=STATUS_COLORS["PREEMPTED"])
    pre.add_scatter(x=d["step"], y=d["cum_preempted"], name="cumulative", line=dict(color="#5B5B5B", shape="hv"))
    thr = _fig("Throughput (scheduled tokens / s, 8-step window)")
    thr.add_scatter(x=d["step"], y=d["throughput"], name="tokens/s", line=dict(color="#009E73"))
    out = [("tokens", tok), ("queues", q), ("kv", kv), ("preemptions", pre), ("throughput", thr)]
    if cursor is not None:
        for _, f in out:
            f.add_vline(x=cursor, line=dict(color="#E69F00", dash="dash"))
    return out


def main() -> None:
    st.title("Metrics over time")
    cur = state.current_step_table()
    if cur is None:
        return
    _, _, df = cur
    d = derive(df)
    last = d.iloc[-1]
    c = st.columns(5)
    c[0].metric("steps", len(d))
    c[1].metric("tokens scheduled", int(d["tokens"].sum()))
    c[2].metric("peak KV usage", f"{d['kv_usage'].max():.0%}")
    c[3].metric("prefix-cache hit rate", f"{last['hit_rate']:.0%}")
    c[4].metric("preemptions", int(last["cum_preempted"]))
    shown = downsample(d)
    if len(shown) < len(d):
        st.caption(f"{len(d)} steps downsampled to {len(shown)} points (max for levels, sums for counts)")
    figs = figures(shown, st.session_state.get("cursor"))
    cols = st.columns(2)
    for i, (key, fig) in enumerate(figs):
        cols[i % 2].plotly_chart(fig, width="stretch", key=f"metric_{key}")
    code_ref("vllm_anatomy/core/sched/scheduler.py", "Scheduler.make_stats · SchedulerStepRecord (per step)")


main()
