"""Processes: the article's call chain ①–⑪ (§六) drawn from the run's real spans — one
lane per process and thread (API server event loop; EngineCoreProc input thread, busy
loop, output thread; worker busy loop; device), the ZMQ and shared-memory hops with
their message sizes and latencies. Click a hop to open its step in the inspector.
A one-process run is drawn as one process (its worker is a plain call)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard import data, state
from dashboard.answers.cached import source
from dashboard.answers.source import RunSource
from dashboard.components.code_ref import code_ref
from dashboard.components.nav import open_view, point_data, selected_points
from dashboard.components.tensor_parallel import article_line, tp_facts
from dashboard.processes import BUSY, chain_rows, layout, step_view
from dashboard.words import n_of

ss = st.session_state
FIG_KEY = "proc_fig"
COLORS = {"frontend": "#0072B2", "input": "#56B4E9", "busy": "#009E73", "output": "#56B4E9", "worker": "#D55E00",
          "device": "#7F7F7F"}
HOP_TAB = {"③": "scheduler", "⑤": "worker", "⑩": "worker", "⑪": "scheduler"}
GROUP_OF = {"frontend": 0, "input": 1, "busy": 1, "output": 1, "worker": 2, "device": 2}


def _size(n) -> str:
    if n is None:
        return "size not recorded"
    return f"{n:,} B" if n < 10_000 else f"{n / 1024:,.1f} KiB"


def figure(view: dict, step: int) -> go.Figure:
    used = {s["lane"] for s in view["spans"]}
    # A device lane only where the run recorded device spans (CUDA runs).
    lanes = [(k, label) for k, label in view["layout"]["lanes"] if not k.startswith("device:") or k in used]
    n = len(lanes)
    y_of = {key: n - 1 - i for i, (key, _) in enumerate(lanes)}       # first lane on top
    t0 = view["t0"]
    ms = lambda t: (t - t0) / 1e6  # noqa: E731
    x_max = ms(view["t1"])
    fig = go.Figure()
    _add_spans(fig, view, lanes, y_of, ms, x_max)
    if not view["layout"]["single"]:
        _add_boundaries(fig, lanes, view["layout"]["inproc_engine"])
    _add_hops(fig, view, y_of, ms)
    ticks = _lane_ticks(view, lanes)
    fig.update_layout(barmode="overlay", height=max(340, 84 * n + 90), uniformtext={"minsize": 12, "mode": "hide"}, margin={"l": 10, "r": 10, "t": 30, "b": 40},
                      plot_bgcolor="#FFFFFF", paper_bgcolor="#FFFFFF", font={"size": 13, "color": "#222"},
                      clickmode="event+select", hovermode="closest",
                      xaxis={"title": f"ms since the window's start (step {step})", "range": [0, x_max * 1.14],
                             "gridcolor": "#E5E5E5", "tickfont": {"size": 13, "color": "#222"}},
                      yaxis={"tickvals": list(range(n)), "ticktext": [label for _, label in reversed(lanes)],
                             "range": [-0.6, n - 0.4], "automargin": True,
                             "tickfont": {"size": 13, "color": "#222"}})
    fig.update_yaxes(ticktext=[ticks[k] for k, _ in reversed(lanes)])
    return fig


def _lane_ticks(view: dict, lanes: list) -> dict[str, str]:
    """Each lane's label; a rank's lane also says what its collectives took (a second line), since
    they are drawn as one thin row of ticks under its forward."""
    out = {}
    for key, label in lanes:
        coll = [s for s in view["spans"] if s["lane"] == key and s["name"].startswith("GroupCoordinator.")]
        if coll:
            ms = sum(s["end_ns"] - s["start_ns"] for s in coll) / 1e6
            label += f"<br><span style='font-size:12px'>{len(coll)} collectives · {ms:,.0f} ms</span>"
        out[key] = label
    return out


def _add_spans(fig: go.Figure, view: dict, lanes: list, y_of: dict, ms, x_max: float) -> None:
    """A bar per span on its lane: outer spans thin and pale above, the rest below, labelled when wide."""
    for s in view["spans"]:
        if s["lane"] not in y_of:
            continue
        kind = s["lane"].split(":")[0]
        start, end = max(ms(s["start_ns"]), 0), min(ms(s["end_ns"]), x_max)
        if end < start:
            continue
        coll = s["name"].startswith("GroupCoordinator.")
        # A rank's collectives (GroupCoordinator.all_reduce, ...): a thin dark row under its forward, so the
        # forward stays readable (61 of them per step would stripe it solid).
        y = y_of[s["lane"]] + (0.24 if s["outer"] else -0.36 if coll else -0.08)
        short = s["name"].split(".")[-1] if not s["name"].startswith("POST ") else s["name"]
        color = "#222222" if coll else COLORS.get(kind, "#999")
        fig.add_bar(orientation="h", base=[start], x=[max(end - start, x_max * 0.002)], y=[y],
                    width=0.16 if s["outer"] else 0.1 if coll else 0.36, marker_color=color,
                    marker_line_width=0, opacity=0.45 if s["outer"] else 0.9, showlegend=False,
                    text=[short] if not s["outer"] and (end - start) > x_max * 0.08 else None,
                    textposition="inside", insidetextanchor="start", textfont={"size": 12, "color": "#FFFFFF"},
                    hovertemplate=f"<b>{s['name']}</b><br>{(s['end_ns'] - s['start_ns']) / 1e6:.3f} ms"
                                  f"<br>{dict(lanes).get(s['lane'], s['lane'])}<extra></extra>")


def _add_boundaries(fig: go.Figure, lanes: list, inproc_engine: bool) -> None:
    """Process boundaries between groups of lanes, each named by what crosses it."""
    n = len(lanes)
    # An in-process engine's loop is a lane of the frontend's process: no boundary between them.
    groups = [0 if inproc_engine and k.startswith(f"{BUSY}:") else GROUP_OF.get(k.split(":")[0], 0) for k, _ in lanes]
    names = {1: "process boundary ① · ZMQ + msgspec (EngineCoreRequest ↓ / EngineCoreOutputs ↑)",
             2: "process boundary ② · shared-memory MessageQueue (SchedulerOutput ↓ / ModelRunnerOutput ↑)"}
    for i in range(1, n):
        if groups[i] != groups[i - 1]:
            yb = n - 1 - i + 0.5
            fig.add_hline(y=yb, line_dash="dash", line_color="#333333", line_width=1.5)
            fig.add_annotation(x=0, y=yb, xref="paper", yref="y", text=names.get(groups[i], "process boundary"),
                               showarrow=False, xanchor="left", yanchor="bottom", font={"size": 12, "color": "#222"},
                               bgcolor="rgba(255,255,255,0.85)")


def _add_hops(fig: go.Figure, view: dict, y_of: dict, ms) -> None:
    """Hops: an arrow each, a clickable marker at the receiving end, and a label on a white ground
    (over the lane's bars): one per kind of hop — the same message to every rank is labelled once
    (the others say it in their hover) — anchored leftwards near the right edge, so it is never cut."""
    xs, ys, cds, hovers = [], [], [], []
    arrivals: dict[str, int] = {}
    labelled: set = set()
    x_max = ms(view["t1"])
    for h in view["hops"]:
        if h.src_lane not in y_of or h.dst_lane not in y_of:
            continue
        xa, xb = ms(h.t_send), ms(h.t_recv)
        ya, yb = y_of[h.src_lane] - 0.08, y_of[h.dst_lane] - 0.08
        fig.add_annotation(x=xb, y=yb, ax=xa, ay=ya, xref="x", yref="y", axref="x", ayref="y", showarrow=True,
                           arrowhead=3, arrowsize=1.2, arrowwidth=2, arrowcolor="#B8860B" if "ZMQ" in h.boundary
                           else "#8B008B" if "shared" in h.boundary else "#555555", text="")
        xs.append(xb)
        ys.append(yb)
        label = f"{h.marker} {_size(h.nbytes) if h.nbytes else ''} {h.latency_us / 1000:.2f} ms".replace("  ", " ")
        group = (h.marker, h.what, h.src_lane if h.dst_lane.startswith("worker") else h.dst_lane)
        if "thread" not in h.boundary and group not in labelled:
            labelled.add(group)
            # Labels of hops that end on the same lane alternate above and below it.
            arrivals[h.dst_lane] = arrivals.get(h.dst_lane, -1) + 1
            right = xb > 0.72 * x_max
            fig.add_annotation(x=xb, y=yb, text=label, showarrow=False, xanchor="right" if right else "left",
                               xshift=-9 if right else 9, yshift=13 if arrivals[h.dst_lane] % 2 == 0 else -13,
                               font={"size": 12, "color": "#222"}, bgcolor="rgba(255,255,255,0.9)", borderpad=1)
        cds.append([h.step, h.request or "", HOP_TAB.get(h.marker, "scheduler")])
        hovers.append(f"<b>{h.marker} {h.what}</b><br>{h.boundary}<br>{_size(h.nbytes)}"
                      f"{' (' + h.size_from + ')' if h.size_from else ''}<br>latency {h.latency_us:,.0f} µs"
                      f"<br>click: open step {h.step} in the inspector")
    if xs:
        fig.add_scatter(x=xs, y=ys, mode="markers", customdata=cds, hovertext=hovers,
                        hoverinfo="text", marker={"size": 12, "color": "#B8860B", "symbol": "diamond",
                                                  "line": {"width": 1, "color": "#222"}}, showlegend=False)


def _on_hop() -> None:
    for p in selected_points(FIG_KEY):
        d = point_data(p)
        if len(d) >= 3 and d[0] is not None:
            open_view("inspector", int(float(d[0])), d[2] or None, d[1] or None)
            return


def opening_step(src: RunSource, steps: list[int]) -> int:
    """The step the page opens on when none is asked: the first that admits a request and runs a
    forward, so the chain shows ② ③ (the arrival) and ⑦ ⑧ ⑩ (the forward) in one step.

    NOTE: not the last step (the other pages' default): a finished run's last steps often schedule
    nothing (async scheduling: the last tokens are in flight), leaving ⑦–⑩ empty. A run without such a
    step opens on its last step that ran a forward, else its last step."""
    forward = [s for s in steps if src.scheduler_output(s).get("total_num_scheduled_tokens")]
    return next((s for s in forward if src.scheduler_output(s).get("scheduled_new_reqs")),
                forward[-1] if forward else steps[-1])


def main() -> None:
    st.title("Processes")
    st.caption("The article's call chain ①–⑪ (§六) in this run's own spans: one lane per process and thread. "
               "Arrows are messages between them — ZMQ (gold) and the shared-memory ring (purple), with their size "
               "and latency; grey arrows are hand-overs between threads of one process. **Click a hop's ◆ to open "
               "its step in the Step inspector.**")
    cur = state.current()
    if cur is None:
        return
    path, info = cur
    version = data.file_version(path)
    src = source(path, version)
    if isinstance(src, data.RunError):
        state.show_error(src)
        return
    steps = [s for s in info["steps"] if s in src.step_spans]
    if not steps:
        st.info("This run has no EngineCore.step span yet.")
        return
    if ss.get("cursor") is None:
        ss.cursor = opening_step(src, steps)
    lay_single = set(src.pids) <= {"frontend"}
    if lay_single:
        st.info(f"**One process** (pid {', '.join(map(str, sorted(src.pids.get('frontend', []))))}): this run was "
                "recorded with the engine in-process (LLM / LLMEngine, UniProcExecutor) — the frontend, the engine "
                "loop and the worker are one Python thread, so ③ and ⑤ are plain function calls, not messages. "
                "Start a live run with **three processes** (Start page) to see the ZMQ and shared-memory hops.",
                icon=":material/info:")
    elif layout(src)["inproc_engine"]:
        workers = len(src.pids.get("worker", ()))
        st.info(f"**The engine in the LLM's process, {n_of(workers, 'worker process', 'worker processes')}**"
                + (f" (tensor parallelism: {src.tp} ranks)" if src.tp > 1 else "") + ": requests reach "
                "EngineCore by a plain call (no ③ over ZMQ), while every step's SchedulerOutput crosses the "
                "shared-memory ring ⑤ to every rank. Each rank runs its slice of the model and joins the others' "
                "in collectives (GroupCoordinator.all_reduce: the thin dark row under each rank's forward); only "
                "rank 0 answers.", icon=":material/info:")
    c1, c2, c3 = st.columns([3, 1, 1], vertical_alignment="bottom")
    state.pick_on_cursor("proc_step", steps)
    step = c1.selectbox("step", steps, key="proc_step", format_func=lambda s: f"step {s}",
                        on_change=lambda: state.goto(int(ss.proc_step)))
    admits = [s for s in steps if src.scheduler_output(s).get("scheduled_new_reqs")]
    nxt = next((s for s in admits if s > step), None)
    c2.button("next arrival →", key="proc_next_arrival", disabled=nxt is None,
              on_click=state.goto, args=(nxt if nxt is not None else step,), help="the next step that admits a new "
              "request (its ①②③ hops are drawn)")
    c3.button("open in inspector", key="proc_open", on_click=open_view, args=("inspector", step, "worker"))
    view = step_view(src, step)
    st.plotly_chart(figure(view, step), width="stretch", key=FIG_KEY, on_select=_on_hop, selection_mode="points",
                    config={"displayModeBar": False})
    tp = tp_facts(src, step)
    if tp is not None:
        ar = tp["counts"].get("all_reduce")
        st.markdown(f":material/call_split: **Collectives of step {step}**, on every rank: "
                    + article_line(ar[0] if ar else None, tp["layers"]) + ".")
    hops = view["hops"]
    if hops:
        st.markdown("**Hops of this step**")
        # NOTE: st.table, not st.dataframe: every row and every cell's whole text shows (wrapped).
        st.table(pd.DataFrame([{"#": h.marker, "message": h.what, "boundary": h.boundary,
                                    "from": dict(view["layout"]["lanes"]).get(h.src_lane, h.src_lane),
                                    "to": dict(view["layout"]["lanes"]).get(h.dst_lane, h.dst_lane),
                                    "size": "— (a hand-over inside the process)" if "thread" in h.boundary
                                    else _size(h.nbytes) + (f" ({h.size_from})" if h.size_from else ""),
                                    "latency µs": round(h.latency_us, 1)} for h in hops]).astype(str).set_index("#"),
                 border="horizontal")
    elif not lay_single:
        st.caption("No hop recorded for this step.")
    st.markdown("**The article's chain ①–⑪, in this step**")
    st.table(pd.DataFrame(chain_rows(view, step)).astype(str).set_index("#"), border="horizontal")
    code_ref("dashboard/processes.py", "layout, step_view (lanes and hops from the spans), CHAIN")


main()
