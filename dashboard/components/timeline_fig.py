"""The timeline figure: one lane per process plus the device lane, spans as bars
(one row per nesting depth), sync points (GPUModelRunner._bookkeeping_sync) marked
with their wait.

The six spans a step is made of (MAIN_SPANS: Scheduler.schedule, _update_states,
_prepare_inputs, _model_forward, _bookkeeping_sync, update_from_output) have a
colour each and are always labelled: in one step of the window (the cursor's) by a
staircase of labels above the plot, each with a leader line down to its bar (a
0.03 ms span is a sliver that no label fits in); elsewhere inside the bar when it
fits. Other spans are grey by class.

The device lane has up to three rows: the step's phases (GPU.prepare_inputs,
GPU.model_forward labelled "eager" or "CUDA graph replay, padded 5→8", ...), the decoder
layers of eager steps (GPU.layer) and their kernel launches (GPU.kernel.*, one
colour per kernel, grid / tokens / bytes / GB/s in the hover).

Every bar carries [step id] as customdata: a click opens that step (views/timeline.py).
"""
from __future__ import annotations

from collections.abc import Set as AbstractSet

import pandas as pd
import plotly.graph_objects as go

from dashboard.components.device_lane import bar_label, family, hover_text
from dashboard.theme import FONT_PX, INK, MIN_FONT_PX, span_color, style_figure, text_on

SYNC = "GPUModelRunner._bookkeeping_sync"
# NOTE: with async scheduling the wait moves out of _bookkeeping_sync: the sampled ids are
# copied on a side stream and AsyncGPUModelRunnerOutput.get_output waits for them, one step
# later (article §五). A sync point is any of these spans that recorded a wait.
ASYNC_SYNC = "AsyncGPUModelRunnerOutput.get_output"
SYNC_SPANS = (SYNC, ASYNC_SYNC)
# The spans of one engine step, in order, and their short labels.
MAIN_SPANS = {"Scheduler.schedule": "Scheduler.schedule", "GPUModelRunner._update_states": "_update_states",
              "GPUModelRunner._prepare_inputs": "_prepare_inputs", "GPUModelRunner._model_forward": "_model_forward",
              "GPUModelRunner._bookkeeping_sync": "_bookkeeping_sync",
              "Scheduler.update_from_output": "update_from_output"}
# NOTE: no device-lane colour (theme.SPAN_COLORS) repeats one of these: the legend shows both, and two
# entries of one colour cannot be told apart (_model_forward is indigo: attention kernels are blue).
MAIN_COLORS = {"Scheduler.schedule": "#E69F00", "GPUModelRunner._update_states": "#56B4E9",
               "GPUModelRunner._prepare_inputs": "#009E73", "GPUModelRunner._model_forward": "#332288",
               "GPUModelRunner._bookkeeping_sync": "#C8404F", "Scheduler.update_from_output": "#CC79A7"}
# Every other host span: grey by class (the main spans carry the colour), under one legend entry;
# a class not listed here (OutputProcessor, AsyncGPUModelRunnerOutput, MPClient, ...) gets OTHER_GREY.
OTHER_COLORS = {"EngineCore": "#5F6B7A", "Executor": "#A7A7A7", "Worker": "#BDBDBD",
                "GPUModelRunner": "#CFCFCF", "KVCacheManager": "#8F8F8F", "Scheduler": "#B0A48A"}
OTHER_GREY = "#9A9A9A"
ROW_PX = 26
LABEL_PX = 19          # one staircase label line
LEVELS = {"phases": 0, "layers": 1, "kernels": 2}


def _group(r) -> str:
    """Legend group of a span row: a main span by its name, device spans by family, the rest by class."""
    if r["lane"] != "device" and r["name"] in MAIN_SPANS:
        return r["name"]
    return r["family"]


def _is_other(group: str, device_groups: AbstractSet[str]) -> bool:
    """A host span's class outside the main spans: grey, under the one "other spans" legend entry."""
    return group not in MAIN_SPANS and group not in device_groups


def _color(group: str, device_groups: AbstractSet[str]) -> str:
    if group in MAIN_COLORS:
        return MAIN_COLORS[group]
    if group in OTHER_COLORS or _is_other(group, device_groups):
        return OTHER_COLORS.get(group, OTHER_GREY)
    return span_color(group)


def rows_of(df: pd.DataFrame) -> list[tuple[str, str]]:
    """(lane, level) of every row, top to bottom: process lanes by first span, depth 0 first; the
    device lane last (phases, layers, kernels)."""
    lanes = df.sort_values("start_ns").drop_duplicates("lane")["lane"].tolist()
    lanes = [x for x in lanes if x != "device"] + (["device"] if "device" in lanes else [])
    # The ranks of a tensor-parallel run in rank order, where the first of them started.
    if "rank" in df and df["rank"].notna().any():
        rank_of = dict(zip(df["lane"], df["rank"]))
        ranked = sorted((x for x in lanes if x != "device" and pd.notna(rank_of.get(x))), key=lambda x: int(rank_of[x]))
        at = min(lanes.index(x) for x in ranked)
        rest = [x for x in lanes if x not in ranked]
        lanes = rest[:at] + ranked + rest[at:]
    out = []
    for lane in lanes:
        levels = df.loc[df["lane"] == lane, "level"].unique().tolist()
        out += [(lane, lv) for lv in sorted(levels, key=lambda v: (LEVELS.get(v, -1), str(v)))]
    return out


def _tick(lane: str, level: str, first: bool) -> str:
    name = "device" if lane == "device" else lane
    return f"{name} · {level}" if first else str(level)


def label_step(df: pd.DataFrame, cursor: int | None) -> int | None:
    """The step whose main spans get the staircase labels: the cursor's if it is in the window,
    else the window's first."""
    steps = sorted(df["step_id"].dropna().astype(int).unique())
    if not steps:
        return None
    return cursor if cursor in steps else steps[0]


def timeline_figure(df: pd.DataFrame, t0_ns: int, cursor: int | None) -> go.Figure:
    df = df.assign(start_ms=(df["start_ns"] - t0_ns) / 1e6, family=family(df))
    df["level"] = df["depth"].clip(upper=6).map(lambda d: f"depth {d}")
    if "device_row" in df:
        df["level"] = df["device_row"].where(df["lane"] == "device", df["level"]).fillna(df["level"])
    rows = rows_of(df)
    row_of = {r: i for i, r in enumerate(rows)}
    df["row"] = [row_of[(lane, lv)] for lane, lv in zip(df["lane"], df["level"])]
    df["group"] = [_group(r) for r in df[["lane", "name", "family"]].to_dict("records")]
    fig = go.Figure()
    _add_span_bars(fig, df)
    _add_sync_points(fig, df)
    if cursor is not None:
        cur = df[(df["name"] == "EngineCore.step") & (df["step_id"] == cursor)]
        for _, r in cur.iterrows():
            fig.add_vrect(x0=r["start_ms"], x1=r["start_ms"] + r["dur_ms"], fillcolor="#FFE082", opacity=0.35,
                          line_width=0, layer="below")
    labels = _staircase(df, label_step(df, cursor))
    ticks = [_tick(lane, lv, i == min(j for j, r in enumerate(rows) if r[0] == lane)) for i, (lane, lv) in enumerate(rows)]
    n_legend = sum(1 for t in fig.data if t.showlegend is not False)
    # NOTE: fixed margins (no autoexpand): the staircase is placed in pixels, so the plot's
    # height must be exactly what is computed here.
    top = 14 + LABEL_PX * len(labels)
    bottom = 52 + 24 * -(-n_legend // 3)     # three legend entries a row at the narrowest width
    left = 14 + int(7.2 * max((len(t) for t in ticks), default=8))
    plot_h = ROW_PX * len(rows)
    _add_labels(fig, labels)
    for lane, _ in rows:
        i = min(j for j, r in enumerate(rows) if r[0] == lane)
        if i:
            fig.add_hline(y=i - 0.5, line=dict(color="#9E9E9E", width=1))
    fig.update_layout(barmode="overlay", height=top + plot_h + bottom,
                      margin=dict(l=left, r=16, t=top, b=bottom, autoexpand=False), plot_bgcolor="white",
                      xaxis=dict(title="ms since the first step of the window", showgrid=True, gridcolor="#EEEEEE",
                                 automargin=False),
                      yaxis=dict(range=[len(rows) - 0.5, -0.5], tickvals=list(range(len(rows))), ticktext=ticks,
                                 automargin=False),
                      clickmode="event+select", dragmode="zoom", hovermode="closest")
    style_figure(fig)
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-44 / plot_h, x=0, traceorder="normal"))
    return fig


def _add_span_bars(fig: go.Figure, df: pd.DataFrame) -> None:
    """One bar trace per span group: the main spans by name, the rest grey under one legend entry."""
    order = list(MAIN_SPANS) + sorted(set(df["group"]) - set(MAIN_SPANS))
    device_groups = set(df.loc[df["lane"] == "device", "group"])
    others = [g for g in order if _is_other(g, device_groups)]
    for grp in order:
        g = df[df["group"] == grp]
        if g.empty:
            continue
        main = grp in MAIN_SPANS
        color = _color(grp, device_groups)
        # The grey spans share one legend entry (their names are in the bars and the hover).
        legend = dict(legendgroup="other", showlegend=grp == next((o for o in others if (df["group"] == o).any()), None),
                      name="other spans (grey, by class)") if grp in others else dict(name=MAIN_SPANS.get(grp, grp))
        fig.add_bar(y=g["row"].tolist(), x=g["dur_ms"].tolist(), base=g["start_ms"].tolist(), orientation="h",
                    **legend, width=0.85, textposition="inside", insidetextanchor="start",
                    textfont=dict(color=text_on(color)),
                    marker=dict(color=color, line=dict(color="white", width=0.5 if not grp.startswith("GPU.") else 0)),
                    legendrank=1 if main else 2,
                    customdata=[[int(s) if pd.notna(s) else -1] for s in g["step_id"]],
                    text=[MAIN_SPANS[grp]] * len(g) if main else bar_label(g),
                    hovertext=hover_text(g), hovertemplate="%{hovertext}<extra></extra>")


def sync_points(df: pd.DataFrame) -> pd.DataFrame:
    """The spans where the CPU waited for the GPU: _bookkeeping_sync of a synchronous step,
    AsyncGPUModelRunnerOutput.get_output with async scheduling (a _bookkeeping_sync that
    recorded no wait is not one: with async scheduling nothing waits there)."""
    rows = df[df["name"].isin(SYNC_SPANS) & (df["lane"] != "device")]
    if rows["sync_wait_ms"].notna().any():
        rows = rows[rows["sync_wait_ms"].notna()]
    else:       # (runs recorded before the wait was an attribute: the sync span itself)
        rows = rows[rows["name"] == SYNC]
    return rows


def _add_sync_points(fig: go.Figure, df: pd.DataFrame) -> None:
    """A marker where the CPU waited for the GPU (the sync point), with how long."""
    sync = sync_points(df)
    if not sync.empty:
        moved = bool((sync["name"] == ASYNC_SYNC).any())
        fig.add_scatter(x=(sync["start_ms"] + sync["dur_ms"]).tolist(), y=sync["row"].tolist(), mode="markers",
                        name=("sync point (async: get_output)" if moved
                              else "sync point (CPU waits for the GPU)"),
                        marker=dict(symbol="triangle-down", size=12, color="#C8404F", line=dict(color=INK, width=1)),
                        customdata=[[int(s) if pd.notna(s) else -1] for s in sync["step_id"]],
                        text=[f"{n.split('.')[-1]} · sync wait {w or 0:.3f} ms"
                              for n, w in zip(sync["name"], sync["sync_wait_ms"].fillna(0))],
                        hovertemplate="step %{customdata[0]} · %{text}<extra></extra>")


def _add_labels(fig: go.Figure, labels: list[tuple[float, int, str]]) -> None:
    """The staircase of span labels above the plot, each with a leader line to its bar."""
    for i, (x, row, text) in enumerate(labels):
        # Earliest span highest: a leader line never crosses a later label (all text runs rightwards).
        level = len(labels) - 1 - i
        fig.add_annotation(x=x, y=row, text=text, showarrow=True, arrowhead=0, arrowwidth=1, arrowcolor=INK,
                           ax=0, ay=-((row + 0.5) * ROW_PX + 6 + LABEL_PX * level), xanchor="left",
                           yanchor="bottom", font=dict(size=MIN_FONT_PX, color=INK),
                           bgcolor="rgba(255,255,255,0.9)", borderpad=1)


def _staircase(df: pd.DataFrame, step: int | None) -> list[tuple[float, int, str]]:
    """(x, row, text) of the main spans of `step` on the host lanes, in time order."""
    if step is None:
        return []
    m = df[(df["step_id"] == step) & df["name"].isin(list(MAIN_SPANS)) & (df["lane"] != "device")]
    # NOTE: with tensor parallelism every rank runs the same spans: label the first rank's
    # (the lane listed first), not N copies of each.
    workers = [lane for lane in dict.fromkeys(m["lane"]) if str(lane).startswith("WorkerProc")]
    if len(workers) > 1:
        m = m[~m["lane"].isin(workers[1:])]
    m = m.sort_values("start_ns")
    return [(float(r["start_ms"] + r["dur_ms"] / 2), int(r["row"]), f"{MAIN_SPANS[r['name']]} {r['dur_ms']:.2f} ms")
            for _, r in m.iterrows()]


# -- the step-duration strip -------------------------------------------------------------------
def step_duration_figure(steps: pd.DataFrame, flags: dict[int, str], window: tuple[int, int] | None = None) -> go.Figure:
    """Duration of every EngineCore.step (downsampled to at most 2000 points). Flagged steps
    (start-up, compile outliers) are drawn as red crosses; the y axis is scaled to the other
    steps, and a flagged step beyond it sits on the top edge, its duration written beside it.
    The steps of the timeline's window are shaded. Each point carries [step id]: a click moves
    the window there."""
    every = max(1, len(steps) // 2000)
    s = steps.iloc[::every]
    normal = s[~s["step_id"].astype(int).isin(flags)]
    out = steps[steps["step_id"].astype(int).isin(flags)]
    top = float(normal["dur_ms"].quantile(0.99)) * 1.6 if not normal.empty else float(steps["dur_ms"].max())
    top = max(top, 1e-3)
    fig = go.Figure()
    fig.add_scatter(x=normal["step_id"].astype(int).tolist(), y=normal["dur_ms"].tolist(), mode="lines+markers",
                    marker=dict(size=7), line=dict(color="#4A6FA5"), name="step",
                    customdata=[[int(v)] for v in normal["step_id"]],
                    hovertemplate="step %{x}: %{y:.2f} ms<extra>click: show it below</extra>")
    if not out.empty:
        ys = [min(float(d), top * 0.97) for d in out["dur_ms"]]
        fig.add_scatter(x=out["step_id"].astype(int).tolist(), y=ys, mode="markers", name="flagged",
                        marker=dict(size=12, symbol="x", color="#C8404F"),
                        customdata=[[int(v)] for v in out["step_id"]],
                        text=[f"{d:.0f} ms · {flags[int(i)]}" for i, d in zip(out["step_id"], out["dur_ms"])],
                        hovertemplate="step %{x}: %{text}<extra>click: show it below</extra>")
        above = [(int(i), float(d)) for i, d in zip(out["step_id"], out["dur_ms"]) if d > top]
        span = max(1, int(steps["step_id"].max() - steps["step_id"].min()))
        groups: list[list[tuple[int, float]]] = []
        for i, d in above:      # neighbours (within 12 % of the axis) share one label
            if groups and i - groups[-1][-1][0] < 0.12 * span:
                groups[-1].append((i, d))
            else:
                groups.append([(i, d)])
        for g in groups:
            text = " · ".join(f"step {i}: {d:.0f} ms" for i, d in g) + " ↑"
            fig.add_annotation(x=g[0][0], y=top * 0.97, text=text, showarrow=False, xanchor="left", yanchor="top",
                               xshift=8, yshift=-4, font=dict(size=MIN_FONT_PX, color="#C8404F"),
                               bgcolor="rgba(255,255,255,0.85)")
    if window is not None:
        fig.add_vrect(x0=window[0] - 0.5, x1=window[1] + 0.5, fillcolor="#FFE082", opacity=0.45, line_width=0,
                      layer="below")
    fig.update_layout(height=190, margin=dict(l=10, r=10, t=10, b=36), plot_bgcolor="white", showlegend=False,
                      xaxis_title="step", yaxis=dict(title="step ms", range=[0, top]), clickmode="event+select",
                      dragmode=False, font=dict(size=FONT_PX))
    style_figure(fig)
    return fig
