"""Timeline: the spans of a window of steps, one lane per process plus the device
lane (on a GPU: phases, then the layers and kernels of eager steps); click a span
to open that step in the inspector. Above it, every step's duration: steps that are
not representative (the first step's Triton JIT compile, eager outliers) are
flagged, and the window opens away from them. Start-up spans (warm-up, CUDA graph
capture) are listed below."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import data, spans, state
from dashboard.components.code_ref import code_ref
from dashboard.components.nav import on_click_open, open_view
from dashboard.components.sampled import sizes_text
from dashboard.components.timeline_fig import ASYNC_SYNC, MAIN_SPANS, step_duration_figure, sync_points, timeline_figure
from dashboard.words import n_of

ss = st.session_state
MAX_WINDOW = 60
WINDOW = 5


def _set_window(steps: list[int], flags: dict[int, str]) -> None:
    """(Re)centre the window when the cursor moved since it was last placed (or never was)."""
    cur = ss.get("cursor")
    if cur not in steps:
        a, b = spans.representative_window(steps, flags, None, WINDOW)
        cur = steps[(steps.index(a) + steps.index(b)) // 2]
        ss.cursor = cur
    if ss.get("_tl_for") != (cur, tuple(steps[:1] + steps[-1:])) or "tl_window" not in ss:
        ss.tl_window = spans.representative_window(steps, flags, cur, WINDOW)
        ss._tl_for = (cur, tuple(steps[:1] + steps[-1:]))


def _window_value() -> tuple[int, int] | None:
    """The window slider's value as (first, last) (a range slider's state can come back as a list, or as one
    value where both ends are equal)."""
    w = ss.get("tl_window")
    if isinstance(w, (list, tuple)) and len(w) == 2:
        return int(w[0]), int(w[1])
    if isinstance(w, (int, float)):
        return int(w), int(w)
    return None


def window(steps: list[int], flags: dict[int, str]) -> tuple[int, int]:
    _set_window(steps, flags)
    if len(steps) == 1:
        return steps[0], steps[0]
    value = st.select_slider("Steps shown", options=steps, key="tl_window",
                             help="the steps drawn below; the window follows the cursor (click the strip above)")
    a, b = value if isinstance(value, (list, tuple)) else (value, value)
    if steps.index(b) - steps.index(a) >= MAX_WINDOW:
        st.caption(f"window capped at {MAX_WINDOW} steps")
        b = steps[steps.index(a) + MAX_WINDOW - 1]
    return a, b


def show_step_here(step: int) -> None:
    """Callback: centre the window on `step` (the cursor moves there; the page stays)."""
    state.goto(step)


def _forward_modes(win: pd.DataFrame) -> dict[int, str]:
    fwd = win[(win["name"].isin(["GPU.model_forward", "GPUModelRunner._model_forward"]))
              & win["cudagraph_mode"].notna() & win["step_id"].notna()]
    return dict(zip(fwd["step_id"].astype(int), fwd["cudagraph_mode"]))


def eager_vs_graph(win: pd.DataFrame) -> str | None:
    """One line on why eager steps look synchronous and graph replays do not, with this
    window's numbers; None unless the window has both."""
    modes = _forward_modes(win)
    eager = [s for s, m in modes.items() if m == "NONE"]
    graph = [s for s, m in modes.items() if m == "FULL"]
    if not eager or not graph:
        return None

    def mean(name: str, steps: list[int], lane_device: bool, col: str = "dur_ms") -> float:
        rows = win[(win["name"] == name) & win["step_id"].isin(steps) & ((win["lane"] == "device") == lane_device)]
        return float(rows[col].fillna(0).mean()) if not rows.empty else 0.0
    host_e, dev_e = mean("GPUModelRunner._model_forward", eager, False), mean("GPU.model_forward", eager, True)
    host_g, dev_g = mean("GPUModelRunner._model_forward", graph, False), mean("GPU.model_forward", graph, True)
    # NOTE: the wait is read where this run waited: with async scheduling nothing waits in _bookkeeping_sync,
    # AsyncGPUModelRunnerOutput.get_output does (its span carries the step of the tokens it waits for).
    sync = sync_points(win)
    name = ASYNC_SYNC if (sync["name"] == ASYNC_SYNC).any() else "GPUModelRunner._bookkeeping_sync"
    wait_e, wait_g = mean(name, eager, False, "sync_wait_ms"), mean(name, graph, False, "sync_wait_ms")
    where = f"`{name}`" if name == ASYNC_SYNC else "`_bookkeeping_sync`"
    return (f"**Eager vs CUDA graph replay:** an eager step (here {', '.join(map(str, eager))}: a prefill chunk in "
            f"the batch) launches every kernel from Python, layer by layer, so the CPU's `_model_forward` lasts as "
            f"long as the GPU's forward ({host_e:.2f} vs {dev_e:.2f} ms) and the sync point waits {wait_e:.2f} ms: it "
            f"looks synchronous; a graph replay (pure decodes) launches the whole forward in one call "
            f"({host_g:.3f} ms on the CPU for {dev_g:.2f} ms on the GPU), so the CPU runs ahead and waits at "
            f"{where} ({wait_g:.2f} ms)" + (" — one step later, with async scheduling" if name == ASYNC_SYNC else "")
            + ".")


def _captures_text(caps: pd.DataFrame, sizes: list[int]) -> str:
    """`15 CUDA graph captures (11 piecewise, 4 full; sizes 1, 2, 4, 8, 16, …, 64)`: FULL_AND_PIECEWISE
    captures the graph pieces of every size and a full graph for the sizes a decode-only batch can reach."""
    modes = caps["cudagraph_mode"].dropna().value_counts() if "cudagraph_mode" in caps else pd.Series(dtype=int)
    kinds = ", ".join(f"{int(modes[m])} {m.lower()}" for m in ("PIECEWISE", "FULL") if m in modes)
    what = f"{kinds}; " if len(modes) > 1 else ""
    return f"{len(caps)} CUDA graph captures ({what}sizes {sizes_text(sizes).split(';')[0]})"


def startup(df: pd.DataFrame) -> None:
    """Spans before the first step (engine start-up: load, KV cache, warm-up, CUDA graph capture)."""
    steps = df[df["name"] == "EngineCore.step"]
    first = steps["start_ns"].min() if not steps.empty else df["start_ns"].max() + 1
    up = df[df["step_id"].isna() & df["request_id"].isna() & (df["start_ns"] < first) & (df["lane"] != "device")]
    up = up[~up["name"].isin(["llm_request", "InputProcessor.process_inputs", "EngineCore.add_request"])]
    if up.empty:
        return
    up = up.sort_values("start_ns")
    caps = up[up["name"] == "CUDAGraph.capture"]
    sizes = sorted(set(caps["cudagraph_size"].dropna().astype(int)))  # piecewise and full share sizes
    summary = f" · {_captures_text(caps, sizes)} in {caps['dur_ms'].sum():.0f} ms" if not caps.empty else ""
    with st.expander(f"Start-up: {n_of(len(up), 'span')} before the first step{summary}"):
        st.dataframe(pd.DataFrame({"span": ["· " * int(d) + n for d, n in zip(up["depth"], up["name"])],
                                   "ms": up["dur_ms"].round(2),
                                   "capture size": ["" if pd.isna(v) else str(int(v)) for v in up["cudagraph_size"]]}),
                     hide_index=True, width="stretch")
        code_ref("vllm_anatomy/worker/model_runner_startup.py", "ModelRunnerStartupMixin.warm_up · "
                                                                "capture_model → CUDAGraphRunner.capture")


def flagged(flags: dict[int, str], cursor: int | None, steps: list[int]) -> None:
    if not flags:
        return
    if cursor in flags and "eager forward" not in flags[cursor]:     # an eager step is explained below
        c1, c2 = st.columns([4, 1], vertical_alignment="center")
        c1.warning(f"Step {cursor} is flagged — {flags[cursor]}. The other steps of the window are squeezed "
                   "beside it.", icon=":material/warning:")
        a, b = spans.representative_window(steps, flags, None, WINDOW)
        mid = steps[(steps.index(a) + steps.index(b)) // 2]
        c2.button("Show typical steps", key="tl_typical", on_click=show_step_here, args=(mid,))
    with st.expander(f"{n_of(len(flags), 'flagged step')} (✕ above): not representative, "
                     "the window opens away from them"):
        st.markdown("\n".join(f"- **step {s}** · {why}" for s, why in sorted(flags.items())))


def _window_caption(win: pd.DataFrame, a: int, b: int) -> None:
    """The window in one line: its spans, its sync points and what ran on the device."""
    sync = sync_points(win)
    ranks = win["rank"].dropna().nunique() if "rank" in win else 0
    if ranks > 1:       # each rank syncs with its own device: count the output rank's
        sync = sync[sync["rank"].isna() | (sync["rank"] == 0)]
    dev = win[(win["lane"] == "device") & ~win["host_timing"]]
    if dev.empty:
        device = ("no GPU: the device lane shows the host's own timings of the device work — every step is eager "
                  "and synchronous, nothing runs ahead of the CPU")
    else:
        modes = _forward_modes(win)
        n_graph = sum(m == "FULL" for m in modes.values())
        n_pieces = sum(m == "PIECEWISE" for m in modes.values())
        n_eager = len(modes) - n_graph - n_pieces
        pieces = f", {n_pieces} piecewise" if n_pieces else ""
        device = (f"GPU: {n_of(n_graph, 'CUDA graph replay')}{pieces} and {n_of(n_eager, 'eager forward')}; eager "
                  f"steps add a row of decoder layers and one of kernel "
                  f"launches (hover a kernel: grid, tokens, bytes, GB/s; one step's device lane, larger: the "
                  f"inspector's Worker tab)")
    if ranks > 1:
        device += (f"; {ranks} tensor-parallel ranks, each a worker lane (its GroupCoordinator spans are its "
                   f"collectives), the device lane and the sync points rank 0's")
    where = ("`AsyncGPUModelRunnerOutput.get_output` (async scheduling: nothing waits in `_bookkeeping_sync`)"
             if (sync["name"] == ASYNC_SYNC).any() else "`_bookkeeping_sync`")
    st.caption(f"{n_of(len(win), 'span')} in steps {a}–{b} · {len(sync)} sync points in {where}, total wait "
               f"{sync['sync_wait_ms'].fillna(0).sum():.3f} ms · {device}.")


# The article's sentence (§五), shown as a tooltip (a machine without CJK fonts shows no boxes).
ASYNC_ZH = "async scheduling 把最后那个同步点也拿掉了。采样结果留在 GPU，AsyncGPUModelRunnerOutput 在另一条 copy stream 上做 D2H"


def async_note(win: pd.DataFrame, meta: dict) -> None:
    """What async scheduling did to this window's steps (§五: it takes the last sync point away), or,
    when it is off, where the one sync point is."""
    on = ((meta.get("config") or {}).get("scheduler_config") or {}).get("async_scheduling")
    if on is None:
        return
    if not on:
        st.caption(":material/sync: Async scheduling is **off**: each step waits once, in `_bookkeeping_sync` "
                   "(the ▼ markers), for its sampled tokens before the scheduler runs again — the one CPU-waits-"
                   "for-GPU point of §五.")
        return
    sync = sync_points(win)
    moved = sync[sync["name"] == ASYNC_SYNC]
    waits = moved["sync_wait_ms"].fillna(0)
    steps = win[win["name"] == "EngineCore.step"].sort_values("start_ns")
    pairs = list(zip(steps.itertuples(), steps.iloc[1:].itertuples()))
    overlap = [(a.end_ns - b.start_ns) / 1e6 for a, b in pairs if b.start_ns < a.end_ns]
    box = st.container(border=True, key="async_note")
    box.markdown(f":material/fast_forward: **Async scheduling is on** — <span title=\"{ASYNC_ZH}\" style=\"border-bottom:1px dotted\">§五</span>: "
            "it takes the last sync point away. `_bookkeeping_sync` no longer waits: the sampled ids stay on the GPU, "
            "`AsyncGPUModelRunnerOutput` copies them to the host on a side stream, and `Scheduler.schedule` plans the "
            "next step with placeholder tokens while this one runs. The wait moves to "
            "`AsyncGPUModelRunnerOutput.get_output`, **one step later** (the ▼ markers): "
            + (f"{len(moved)} waits in this window, {waits.sum():.3f} ms in all (at most {waits.max():.3f} ms) — by "
               "then the GPU has usually finished. " if len(moved) else "no wait recorded in this window. ")
            + (f"{len(overlap)} of {len(pairs)} consecutive steps overlap (step N+1 starts before step N's span ends, "
               f"by {sum(overlap) / len(overlap):.2f} ms on average)." if overlap else
               f"None of the window's {len(pairs)} consecutive step pairs overlap." if pairs else ""),
            unsafe_allow_html=True)


def _eager_step_button(df: pd.DataFrame, steps_df: pd.DataFrame, flags: dict[int, str]) -> None:
    """A run with CUDA graphs and eager steps, but none of each in the window: a button to show the
    fastest eager step (not a JIT one) here."""
    modes = _forward_modes(df)
    if "FULL" in modes.values() and any(m != "FULL" for m in modes.values()):
        dur = dict(zip(steps_df["step_id"].astype(int), steps_df["dur_ms"]))
        eager = sorted((s for s, m in modes.items() if m == "NONE" and "JIT" not in flags.get(s, "")),
                       key=lambda s: dur.get(s, 0.0))
        if eager:
            st.button(f"Show an eager step (step {eager[0]}) beside CUDA graph replays", key="tl_eager",
                      icon=":material/compare:", on_click=show_step_here, args=(eager[0],))


def main() -> None:
    st.title("Timeline")
    cur = state.current()
    if cur is None:
        return
    path, info = cur
    df = spans.span_table(path, data.file_version(path), str(info["meta"].get("device")))
    if isinstance(df, data.RunError):
        state.show_error(df)
        return
    if df.empty or df["step_id"].isna().all():
        st.info("No step spans recorded yet (spans arrive in batches every 200 ms).")
        return
    steps = [s for s in info["steps"]]
    flags = spans.step_flags(df)
    steps_df = df[df["name"] == "EngineCore.step"].sort_values("step_id")
    _set_window(steps, flags)
    st.caption("Every step's duration (red ✕: flagged, see below). Click a point to show that step in the "
               "timeline below.")
    st.plotly_chart(step_duration_figure(steps_df, flags, _window_value()), width="stretch",
                    key="step_durations", on_select=on_click_open("step_durations", None), selection_mode="points",
                    config={"displayModeBar": False})
    flagged(flags, ss.get("cursor"), steps)
    a, b = window(steps, flags)
    win = df[df["step_id"].between(a, b)]
    st.caption("One row per nesting depth of each process's spans; the six spans of a step ("
               + ", ".join(f"`{v}`" for v in MAIN_SPANS.values()) + ") have a colour each and are labelled in the "
               "highlighted step. **Click a bar to open its step in the Step inspector**; drag to zoom, double-click "
               "to zoom out.")
    fig = timeline_figure(win, int(win["start_ns"].min()), ss.get("cursor"))
    st.plotly_chart(fig, width="stretch", key="timeline_chart", on_select=on_click_open("timeline_chart", "inspector"),
                    selection_mode="points")
    _window_caption(win, a, b)
    async_note(win, info["meta"])
    line = eager_vs_graph(win)
    if line:
        st.markdown(line)
    else:
        _eager_step_button(df, steps_df, flags)
    c1, c2 = st.columns([1, 3], vertical_alignment="bottom")
    state.pick_on_cursor("tl_pick", steps)
    pick = c1.selectbox("Open step", steps, key="tl_pick")
    c2.button("Open in the step inspector", key="tl_open", icon=":material/search:", on_click=open_view,
              args=("inspector", pick))
    code_ref("vllm_anatomy/engine/core.py", "EngineCore.step → Scheduler.schedule, Executor.execute_model, "
                                            "GPUModelRunner.*")
    startup(df)


main()
