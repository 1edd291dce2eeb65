"""slot_mapping drawn: every token of the batch lands in one KV slot,

    slot = block_id × block_size + offset

so the figure is the physical blocks this step writes (one row each, in the order the
batch first reaches them) by the offsets inside a block (columns 0 … block_size-1);
each token is a square in its (block_id, offset) cell, coloured by its request and
labelled with its position in that request. Padding slots (-1: CUDA-graph padding
rows) write nothing and are counted below."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard.answers.q3_block_table import KV_WRITE_FUSED_WITH, KV_WRITE_KERNELS
from dashboard.components.code_ref import code_ref
from dashboard.theme import request_color, short_req_id, style_figure, text_on
from dashboard.words import n_of

MAX_BLOCKS = 40
ROW_PX = 26


def slot_rows(pi: dict, block_size: int) -> pd.DataFrame:
    req_ids = pi["req_ids"]
    rows = []
    for i, (row, pos, slot, tok) in enumerate(zip(pi["req_indices"], pi["positions"], pi["slot_mapping"],
                                                  pi["input_ids"])):
        pad = slot is None or slot < 0
        rows.append({"token": i, "req": req_ids[row] if row < len(req_ids) else "pad", "position": pos,
                     "input_id": tok, "slot": slot, "block": -1 if pad else slot // block_size,
                     "offset": -1 if pad else slot % block_size})
    return pd.DataFrame(rows)


def slot_figure(df: pd.DataFrame, block_size: int) -> go.Figure:
    real = df[df["block"] >= 0]
    blocks = list(dict.fromkeys(real["block"].tolist()))[:MAX_BLOCKS]
    real = real[real["block"].isin(blocks)]
    fig = go.Figure()
    many = real["req"].nunique() > 16
    for req, g in real.groupby("req", sort=False):
        color = request_color(req)
        fig.add_scatter(x=g["offset"].tolist(), y=[f"block {b}" for b in g["block"]], mode="markers+text",
                        name=f"req {short_req_id(req)}", showlegend=not many,
                        marker=dict(color=color, size=22, symbol="square", line=dict(color="white", width=1)),
                        text=[str(p) for p in g["position"]], textposition="middle center",
                        textfont=dict(color=text_on(color), size=12),
                        customdata=g[["token", "position", "block", "offset", "input_id", "slot"]].values.tolist(),
                        hovertemplate="batch token %{customdata[0]} · req " + short_req_id(req) + " position %{customdata[1]}"
                                      "<br>slot %{customdata[5]} = block %{customdata[2]} × " + str(block_size) +
                                      " + offset %{customdata[3]}<br>input_id %{customdata[4]}<extra></extra>")
    fig.update_layout(height=90 + ROW_PX * max(1, len(blocks)), margin=dict(l=10, r=10, t=36, b=50),
                      plot_bgcolor="#F7F7F7",
                      xaxis=dict(title="offset in the block (slot % block_size)", range=[-0.6, block_size - 0.4],
                                 dtick=1, side="bottom", showgrid=False, zeroline=False),
                      yaxis=dict(title="block_id (slot // block_size)", categoryorder="array",
                                 categoryarray=[f"block {b}" for b in blocks], autorange="reversed"))
    style_figure(fig, legend_top=True)
    return fig


def kv_write_note(step_spans: pd.DataFrame | None, mode: str | None, device: str) -> str:
    """Where these slots are written: this step's reshape_and_cache launches (one per layer; or the
    fused (q/k norm +) RoPE + KV write), or why the step has none of its own (a graph replay, graph
    pieces, a CPU run)."""
    if step_spans is not None:
        # (the target's: a draft model writes its own cache, in the same slots, after the step's sampling)
        target = step_spans["drafter"].ne(True) if "drafter" in step_spans else True
        for kernel in KV_WRITE_KERNELS:
            k = step_spans[(step_spans["name"] == f"GPU.kernel.{kernel}") & target]
            if not k.empty:
                fused = (f" (the same launch as the layer's {KV_WRITE_FUSED_WITH[kernel]}: they are fused on this "
                         "model)") if kernel in KV_WRITE_FUSED_WITH else ""
                return (f"`{kernel}` writes each token's K and V to its slot, in every layer{fused}: "
                        f"**{n_of(len(k), 'launch', 'launches')}** this step (one per layer, {k['dur_ms'].mean() * 1e3:.1f} µs on "
                        "average; the kernels row of the device lane above).")
    if mode == "FULL":
        why = "it ran inside this step's CUDA graph replay, once per layer; a replay has no span per kernel"
    elif mode == "PIECEWISE":
        why = ("it is captured in each layer's graph piece (only attention runs eager between the pieces), so it has "
               "no span of its own")
    elif device.startswith("cuda"):
        why = "no kernel span was recorded for this step"
    else:
        why = "on a CPU the backend writes K and V with a tensor copy: no kernel launch to time"
    return f"`reshape_and_cache` writes each token's K and V to its slot, in every layer — {why}."


def slot_mapping(pi: dict, block_size: int, write_note: str | None = None) -> None:
    df = slot_rows(pi, block_size)
    st.markdown(f"**slot_mapping** · {n_of(len(df), 'token')} → KV slots: slot = block_id × {block_size} + offset")
    if df.empty:
        st.caption("no token scheduled")
        return
    st.plotly_chart(slot_figure(df, block_size), width="stretch", key="slot_fig", config={"displayModeBar": False})
    n_blocks = df.loc[df["block"] >= 0, "block"].nunique()
    pad = int((df["block"] < 0).sum())
    st.caption("Each square is one token of this step, in the KV slot it writes: its row is the physical block "
               "(block_id = slot // block_size), its column the offset in it (slot % block_size); the number is the "
               "token's position in its request. A prefill chunk fills a run of offsets; a decode writes one slot "
               "after the request's last token."
               + (f" First {MAX_BLOCKS} of {n_blocks} blocks shown." if n_blocks > MAX_BLOCKS else "")
               + (f" {n_of(pad, 'padding slot')} (-1) write nothing." if pad else ""))
    if write_note:
        st.markdown(f":material/edit_note: {write_note}")
    code_ref("vllm_anatomy/worker/block_table.py", "BlockTable.compute_slot_mapping")
