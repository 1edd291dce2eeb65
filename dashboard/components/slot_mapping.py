"""slot_mapping drawn: every token of the batch → its KV slot = block_id × block_size
+ offset, coloured by request, over the physical blocks it lands in."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.theme import request_color


def slot_rows(pi: dict, block_size: int) -> pd.DataFrame:
    req_ids = pi["req_ids"]
    rows = []
    for i, (row, pos, slot, tok) in enumerate(zip(pi["req_indices"], pi["positions"], pi["slot_mapping"],
                                                  pi["input_ids"])):
        rows.append({"token": i, "req": req_ids[row], "position": pos, "input_id": tok, "slot": slot,
                     "block": slot // block_size, "offset": slot % block_size})
    return pd.DataFrame(rows)


def slot_figure(df: pd.DataFrame, block_size: int) -> go.Figure:
    fig = go.Figure()
    for req, g in df.groupby("req", sort=False):
        fig.add_scatter(x=g["token"], y=g["slot"], mode="markers", name=f"req {req}",
                        marker=dict(color=request_color(req), size=7, symbol="square"),
                        customdata=g[["position", "block", "offset", "input_id"]],
                        hovertemplate="batch token %{x} · position %{customdata[0]}<br>slot %{y} = block "
                                      "%{customdata[1]} × " + str(block_size) + " + %{customdata[2]}"
                                      "<br>input_id %{customdata[3]}<extra>req " + str(req) + "</extra>")
    for b in sorted(df["block"].unique()):
        fig.add_hrect(y0=b * block_size - 0.5, y1=(b + 1) * block_size - 0.5, line_width=0,
                      fillcolor="#EEEEEE", opacity=0.5, layer="below")
        fig.add_annotation(x=-0.5, y=b * block_size + block_size / 2, text=f"block {b}", showarrow=False,
                           xanchor="right", font=dict(size=9, color="#666"))
    fig.update_layout(height=260, margin=dict(l=60, r=0, t=4, b=30), plot_bgcolor="white",
                      xaxis_title="token in the flattened batch", yaxis_title="KV slot",
                      legend=dict(orientation="h", y=1.1))
    return fig


def slot_mapping(pi: dict, block_size: int) -> None:
    df = slot_rows(pi, block_size)
    st.markdown(f"**slot_mapping** · {len(df)} tokens → KV slots (slot = block_id × {block_size} + offset)")
    if df.empty:
        st.caption("no token scheduled")
        return
    st.plotly_chart(slot_figure(df, block_size), width="stretch", key="slot_fig")
    code_ref("vllm_anatomy/worker/block_table.py", "BlockTable.compute_slot_mapping")
