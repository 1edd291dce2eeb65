"""The timeline figure: one lane per process plus the device lane, spans as bars
(nested spans drawn thinner on top of their parents), sync points
(GPUModelRunner._bookkeeping_sync) marked with their wait.

The device lane has up to three rows: the step's phases (GPU.prepare_inputs,
GPU.model_forward labelled "eager" or "CUDA graph replay, padded 5→8", ...), the decoder
layers of eager steps (GPU.layer) and their kernel launches (GPU.kernel.*, one
colour per kernel, grid / tokens / bytes / GB/s in the hover)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.components.device_lane import bar_label, family, hover_text
from dashboard.theme import span_color

SYNC = "GPUModelRunner._bookkeeping_sync"


def timeline_figure(df: pd.DataFrame, t0_ns: int, cursor: int | None) -> go.Figure:
    df = df.assign(start_ms=(df["start_ns"] - t0_ns) / 1e6, family=family(df))
    df["level"] = df["depth"].clip(upper=6).map(lambda d: f"depth {d}")
    if "device_row" in df:
        df["level"] = df["device_row"].where(df["lane"] == "device", df["level"]).fillna(df["level"])
    # Categories in order of appearance: make the device rows come phases, layers, kernels.
    order = {"phases": 0, "layers": 1, "kernels": 2}
    df = df.assign(_o=df["level"].map(order).fillna(-1)).sort_values(["_o", "start_ns"], kind="stable")
    fig = go.Figure()
    for fam, g in df.groupby("family", sort=False):
        fig.add_bar(y=[g["lane"].tolist(), g["level"].tolist()], x=g["dur_ms"], base=g["start_ms"],
                    orientation="h", name=fam, width=0.85, textposition="inside", insidetextanchor="start",
                    marker=dict(color=span_color(fam), line=dict(color="white", width=0.5 if fam == "device" or
                                                            not fam.startswith("GPU.") else 0)),
                    customdata=g[["step_id"]].fillna(-1).astype(int), text=bar_label(g),
                    hovertext=hover_text(g), hovertemplate="%{hovertext}<extra></extra>")
    sync = df[(df["name"] == SYNC) & (df["lane"] != "device")]
    if not sync.empty:
        fig.add_scatter(x=sync["start_ms"] + sync["dur_ms"], y=[sync["lane"].tolist(), sync["level"].tolist()], mode="markers", name="sync point",
                        marker=dict(symbol="triangle-down", size=11, color="#D1495B"),
                        customdata=sync[["step_id"]].fillna(-1).astype(int),
                        text=[f"sync wait {w or 0:.2f} ms" for w in sync["sync_wait_ms"]],
                        hovertemplate="_bookkeeping_sync · step %{customdata[0]}<br>%{text}<extra></extra>")
    if cursor is not None:
        cur = df[(df["name"] == "EngineCore.step") & (df["step_id"] == cursor)]
        for _, r in cur.iterrows():
            fig.add_vrect(x0=r["start_ms"], x1=r["start_ms"] + r["dur_ms"], fillcolor="#FFE082", opacity=0.35,
                          line_width=0, layer="below")
    n_rows = df.groupby("lane")["level"].nunique().sum()
    fig.update_layout(barmode="overlay", height=120 + 28 * n_rows, margin=dict(l=10, r=10, t=10, b=40),
                      plot_bgcolor="white", xaxis_title="ms since the first step of the window",
                      yaxis=dict(autorange="reversed"), uniformtext=dict(minsize=8, mode="hide"),
                      legend=dict(orientation="h", y=-0.25), clickmode="event+select", dragmode="zoom")
    return fig


def step_duration_figure(steps: pd.DataFrame) -> go.Figure:
    """Duration of every EngineCore.step (downsampled to at most 2000 points)."""
    every = max(1, len(steps) // 2000)
    s = steps.iloc[::every]
    fig = go.Figure(go.Scatter(x=s["step_id"], y=s["dur_ms"], mode="lines+markers", marker=dict(size=4),
                               line=dict(color=span_color("EngineCore")),
                               hovertemplate="step %{x}: %{y:.1f} ms<extra></extra>"))
    fig.update_layout(height=160, margin=dict(l=10, r=10, t=10, b=30), plot_bgcolor="white",
                      xaxis_title="step", yaxis_title="EngineCore.step ms")
    return fig
