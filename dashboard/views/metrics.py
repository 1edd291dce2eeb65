"""Metrics over time, one point per committed step (downsampled past 2000 steps):
batch tokens (prefill vs decode), running / waiting, KV cache usage (and MB),
prefix-cache hit rate, preemptions and throughput. Click a point (or bar) of any
chart to open that step in the step inspector."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard import data, state
from dashboard.components.code_ref import code_ref
from dashboard.components.kv_memory import block_bytes, mb
from dashboard.components.nav import on_click_open
from dashboard.theme import KIND_COLORS, STATUS_COLORS, style_figure
from dashboard.words import n_of

MAX_POINTS = 2000
Y_LABEL_PX = 48        # the left margin of every chart: room for its y-axis labels, the same for all


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


def _fig(title: str, height: int = 250) -> go.Figure:
    """A metric chart: title above a one-line legend, both clear of the plot; the x-axis title below."""
    fig = go.Figure()
    fig.update_layout(title=dict(text=title, font=dict(size=14), x=0, xanchor="left", y=0.98, yanchor="top"),
                      height=height, plot_bgcolor="white", margin=dict(l=10, r=10, t=64, b=40),
                      xaxis_title="step", hovermode="closest", clickmode="event+select")
    return fig


def _steps(d: pd.DataFrame) -> list[list[int]]:
    return [[int(s)] for s in d["step"]]


def _hover(fmt: str = "%{y}") -> str:
    return "step %{x}: " + fmt + "<extra>%{fullData.name} · click: open this step</extra>"


def x_range(d: pd.DataFrame) -> list[float]:
    """The x range every chart shares: its bars' half-step margin on either side.

    NOTE: set on all five, not autoranged: a bar chart pads its range by half a bar, a line chart
    with markers by a few percent, so the charts side by side would not line up step for step. The
    y-axis labels get one fixed width (Y_LABEL_PX) for the same reason: "100%" is wider than "6"."""
    lo, hi = float(d["step"].min()), float(d["step"].max())
    pad = max(0.5, (hi - lo) * 0.01)
    return [lo - pad, hi + pad]


def cursor_caption(cursor: int | None) -> str:
    """The caption over the charts: the dashed line only where there is a cursor to draw."""
    line = "" if cursor is None else f"; the dashed line is the cursor (step {cursor})"
    return f"One point per step{line}. **Click a point or bar to open that step in the Step inspector.**"


def figures(d: pd.DataFrame, cursor: int | None, pool_bytes: int | None = None,
            pool_blocks: int | None = None) -> list[tuple[str, go.Figure]]:
    """pool_bytes: the usable pool's bytes (pool_blocks of them: num_gpu_blocks − the null block)."""
    tok = _fig("Batch tokens per step")
    cd = _steps(d)
    tok.add_bar(x=d["step"], y=d["prefill_tokens"], name="prefill", marker_color=KIND_COLORS["final_prefill_chunk"],
                customdata=cd, hovertemplate=_hover("%{y:.0f} tokens"))
    tok.add_bar(x=d["step"], y=d["decode_tokens"], name="decode", marker_color=KIND_COLORS["decode"], customdata=cd,
                hovertemplate=_hover("%{y:.0f} tokens"))
    tok.update_layout(barmode="stack")
    q = _fig("Running / waiting requests")
    q.add_scatter(x=d["step"], y=d["running"], name="running", line=dict(color=STATUS_COLORS["RUNNING"], shape="hv"),
                  customdata=cd, mode="lines+markers", marker=dict(size=5), hovertemplate=_hover())
    q.add_scatter(x=d["step"], y=d["waiting"], name="waiting", line=dict(color=STATUS_COLORS["WAITING"], shape="hv"),
                  customdata=cd, mode="lines+markers", marker=dict(size=5), hovertemplate=_hover())
    kv = _fig("KV cache usage and prefix-cache hit rate"
              + (f" (pool: {pool_blocks} usable blocks, {mb(pool_bytes)})" if pool_bytes else ""))
    usage_mb = [mb(u * pool_bytes) for u in d["kv_usage"]] if pool_bytes else [""] * len(d)
    kv.add_scatter(x=d["step"], y=d["kv_usage"], name="KV usage", fill="tozeroy", line=dict(color="#4A6FA5"),
                   customdata=[[c[0], m] for c, m in zip(cd, usage_mb)], mode="lines+markers", marker=dict(size=4),
                   hovertemplate=_hover("%{y:.0%} of the blocks %{customdata[1]}"))
    kv.add_scatter(x=d["step"], y=d["hit_rate"], name="prefix hit rate (cumulative)", line=dict(color="#0072B2", dash="dot"),
                   customdata=cd, mode="lines+markers", marker=dict(size=4), hovertemplate=_hover("%{y:.0%}"))
    kv.update_yaxes(tickformat=".0%", range=[0, 1.05])
    pre = _fig("Preemptions")
    pre.add_bar(x=d["step"], y=d["preempted"], name="this step", marker_color=STATUS_COLORS["PREEMPTED"], customdata=cd,
                hovertemplate=_hover("%{y:.0f} preempted"))
    pre.add_scatter(x=d["step"], y=d["cum_preempted"], name="cumulative", line=dict(color="#5B5B5B", shape="hv"),
                    customdata=cd, mode="lines+markers", marker=dict(size=4), hovertemplate=_hover("%{y:.0f} so far"))
    thr = _fig("Throughput (scheduled tokens / s, 8-step window)")
    thr.add_scatter(x=d["step"], y=d["throughput"], name="tokens/s", line=dict(color="#009E73"), customdata=cd,
                    mode="lines+markers", marker=dict(size=4), hovertemplate=_hover("%{y:,.0f} tokens/s"))
    out = [("tokens", tok), ("queues", q), ("kv", kv), ("preemptions", pre), ("throughput", thr)]
    rng = x_range(d)
    for _, f in out:
        f.update_xaxes(range=rng)
        f.update_yaxes(automargin=False)
        f.update_layout(margin=dict(l=Y_LABEL_PX))
        if cursor is not None:
            f.add_vline(x=cursor, line=dict(color="#E69F00", dash="dash"))
        style_figure(f, legend_top=True)
        f.update_layout(legend=dict(y=1.0, yanchor="bottom"))
    return out


def _pool(path: str, info: dict) -> tuple[int | None, int | None]:
    """(bytes, blocks) of the usable KV pool, the blocks usage is a share of: num_gpu_blocks − 1
    (block 0 is the null block: BlockPool.get_usage leaves it out); bytes None when the run does
    not tell the block size in bytes."""
    steps = info["steps"]
    d = data.step_data(path, steps[0]) if steps else None
    if not isinstance(d, dict):
        return None, None
    kv = d["step"]["scheduler"]["kv_cache"]
    per = block_bytes(info["meta"], d["mr"], kv.get("block_size"))
    usable = kv["num_gpu_blocks"] - 1
    return (per * usable if per else None), usable


def main() -> None:
    st.title("Metrics over time")
    cur = state.current_step_table()
    if cur is None:
        return
    path, info, df = cur
    d = derive(df)
    last = d.iloc[-1]
    pool_bytes, pool_blocks = _pool(path, info)
    c = st.columns(5)
    c[0].metric("steps", len(d))
    c[1].metric("tokens scheduled", int(d["tokens"].sum()), help="prompt and generated tokens run through the "
                                                                 "model, summed over the steps")
    peak = d["kv_usage"].max()
    c[2].metric("peak KV usage" + (f" ({mb(peak * pool_bytes)})" if pool_bytes else ""), f"{peak:.0%}",
                help="the most KV blocks held at once, as a share of the usable pool" +
                     (f" ({pool_blocks} blocks, {mb(pool_bytes)}; the null block left out)" if pool_bytes else ""))
    c[3].metric("prefix-cache hit rate", f"{last['hit_rate']:.0%}", help="prompt tokens found in the prefix cache "
                                                                        "/ prompt tokens looked up (cumulative)")
    c[4].metric("preemptions", int(last["cum_preempted"]), help="RUNNING → PREEMPTED transitions: a request lost its "
                                                               "KV blocks and will be recomputed")
    shown = downsample(d)
    if len(shown) < len(d):
        st.caption(f"{n_of(len(d), 'step')} downsampled to {n_of(len(shown), 'point')} (max for levels, sums for counts)")
    cursor = st.session_state.get("cursor")
    st.caption(cursor_caption(cursor))
    figs = figures(shown, cursor, pool_bytes, pool_blocks)
    cols = st.columns(2)
    for i, (key, fig) in enumerate(figs):
        cols[i % 2].plotly_chart(fig, width="stretch", key=f"metric_{key}", selection_mode="points",
                                 on_select=on_click_open(f"metric_{key}", "inspector"),
                                 config={"displayModeBar": False})
    code_ref("vllm_anatomy/core/sched/scheduler.py", "Scheduler.make_stats · SchedulerStepRecord (per step)")


main()
