"""Timeline: the spans of a window of steps, one lane per process plus the device
lane (on a GPU: phases, then the layers and kernels of eager steps); click a span
(or pick a step) to open that step in the inspector. Start-up spans (warm-up,
CUDA graph capture) are listed below."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import data, spans, state
from dashboard.components.code_ref import code_ref
from dashboard.components.sampled import sizes_text
from dashboard.components.timeline_fig import step_duration_figure, timeline_figure

ss = st.session_state
MAX_WINDOW = 60


def on_select() -> None:
    sel = ss.get("timeline_chart")
    points = (sel or {}).get("selection", {}).get("points", []) if isinstance(sel, dict) else \
        getattr(getattr(sel, "selection", None), "points", [])
    for p in points:
        step = (p.get("customdata") or [-1])[0]
        if step is not None and step >= 0:
            state.goto(step, "inspector")
            return


def window(steps: list[int]) -> tuple[int, int]:
    idx = state.cursor_index(steps)
    lo, hi = max(0, idx - 3), min(len(steps) - 1, idx + 3)
    if len(steps) == 1:
        return steps[0], steps[0]
    a, b = st.select_slider("Steps shown", options=steps, value=(steps[lo], steps[hi]), key="tl_window")
    if steps.index(b) - steps.index(a) >= MAX_WINDOW:
        st.caption(f"window capped at {MAX_WINDOW} steps")
        b = steps[steps.index(a) + MAX_WINDOW - 1]
    return a, b


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
    sizes = sorted(caps["cudagraph_size"].dropna().astype(int))
    summary = (f" · {len(caps)} CUDA graphs captured (sizes {sizes_text(sizes).split(';')[0]}) in "
               f"{caps['dur_ms'].sum():.0f} ms" if not caps.empty else "")
    with st.expander(f"Start-up: {len(up)} spans before the first step{summary}"):
        st.dataframe(pd.DataFrame({"span": ["· " * int(d) + n for d, n in zip(up["depth"], up["name"])],
                                   "ms": up["dur_ms"].round(2),
                                   "capture size": ["" if pd.isna(v) else str(int(v)) for v in up["cudagraph_size"]]}),
                     hide_index=True, width="stretch")
        code_ref("vllm_anatomy/worker/gpu_model_runner.py", "GPUModelRunner.warm_up · capture_model → "
                                                            "CUDAGraphRunner.capture")


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
    steps_df = df[df["name"] == "EngineCore.step"].sort_values("step_id")
    st.plotly_chart(step_duration_figure(steps_df), width="stretch", key="step_durations")
    a, b = window(info["steps"])
    win = df[df["step_id"].between(a, b)]
    fig = timeline_figure(win, int(win["start_ns"].min()), ss.get("cursor"))
    st.plotly_chart(fig, width="stretch", key="timeline_chart", on_select=on_select,
                    selection_mode="points")
    sync = win[(win["name"] == "GPUModelRunner._bookkeeping_sync") & (win["lane"] != "device")]
    dev = win[(win["lane"] == "device") & ~win["host_timing"]]
    if dev.empty:
        device = "no GPU: the device lane shows host timings"
    else:
        fwd = dev[dev["name"] == "GPU.model_forward"]
        n_graph = int((fwd["cudagraph_mode"] == "FULL").sum())
        n_eager = len(fwd) - n_graph
        device = (f"GPU: {n_graph} CUDA graph replay{'s' * (n_graph != 1)} and {n_eager} eager "
                  f"forward{'s' * (n_eager != 1)}; eager steps add a row of decoder layers and one of kernel "
                  f"launches (drag to zoom into a step; hover a kernel: grid, tokens, bytes, GB/s; one step's "
                  f"device lane, larger: the inspector's Worker tab)")
    st.caption(f"{len(win)} spans in steps {a}–{b} · {len(sync)} sync points, total wait "
               f"{sync['sync_wait_ms'].fillna(0).sum():.2f} ms · {device}. Click a bar to open its step.")
    c1, c2 = st.columns([1, 3], vertical_alignment="bottom")
    pick = c1.selectbox("Open step", info["steps"], index=state.cursor_index(info["steps"]), key="tl_pick")
    c2.button("Open in the step inspector", key="tl_open", icon=":material/search:", on_click=state.goto, args=(pick, "inspector"))
    code_ref("vllm_anatomy/engine/core.py", "EngineCore.step → Scheduler.schedule, Executor.execute_model, "
                                            "GPUModelRunner.*")
    startup(df)


main()
