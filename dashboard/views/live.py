"""Live run: start the default model on a scenario or your own prompts in a
background engine process (dashboard/live.py) and follow its steps as they are
committed to the run store. Pause/resume following, stop the engine."""
from __future__ import annotations

import os

import streamlit as st

from dashboard import data, state
from dashboard.components.block_pool import block_pool
from dashboard.components.budget import budget
from dashboard.components.code_ref import code_ref
from dashboard.components.live_form import live_form
from dashboard.components.queues import queues
from dashboard.components.run_picker import gpu_sample, gpu_sample_button
from dashboard.live import LiveRun
from dashboard.theme import req_chip

ss = st.session_state
TERMINAL = ("done", "stopped", "error", "crashed")


def start(spec: dict) -> None:
    old = ss.get("live")
    if old is not None:
        old.stop()
    try:
        ss.live = LiveRun.start(spec, state.trace_dir())
    except OSError as e:
        st.error(f"Could not start the engine process: {e}")
        return
    ss.following, ss.live_run_seen = True, None
    state.open_run(None)


def stop() -> None:
    ss.live.stop()


def controls(s: dict) -> None:
    c = st.columns([2, 2, 2, 6], vertical_alignment="center")
    alive = s["state"] not in TERMINAL
    c[0].button(":material/pause: Pause following" if ss.get("following", True) else ":material/play_arrow: Resume following", key="follow_btn",
                on_click=state.toggle, args=("following",), disabled=not alive)
    c[1].button(":material/stop: Stop engine", key="stop_btn", on_click=stop, disabled=not alive)
    c[2].button("Open in inspector", key="to_inspector", icon=":material/search:", disabled=not s.get("run_path"),
                on_click=state.goto, args=(ss.get("cursor") or 0, "inspector"))
    c[3].markdown(f"engine **{s['state']}** · step {s.get('step', 0)} · pid {ss.live.proc.pid}")


def latest_step(path: str) -> None:
    info = data.run_info(path, data.file_version(path))
    if isinstance(info, data.RunError) or not info["steps"]:
        st.caption("waiting for the first committed step …")
        return
    steps = info["steps"]
    if ss.get("following", True) or ss.get("cursor") not in steps:
        ss.cursor = steps[-1]
    d = data.step_data(path, ss.cursor)
    if isinstance(d, data.RunError):
        state.show_error(d)
        return
    step = d["step"]
    st.markdown(f"#### Step {ss.cursor} of {len(steps)} committed")
    c1, c2 = st.columns([2, 3])
    with c1:
        budget(step["scheduler"]["step_record"])
        queues(step)
    with c2:
        block_pool(step["scheduler"]["kv_cache"], step.get("block_pool_events", []), None)


def outputs(s: dict) -> None:
    texts = s.get("outputs") or {}
    if texts:
        st.markdown("<br>".join(f"{req_chip(r)} {t!s}".replace("\n", " ") for r, t in sorted(texts.items())),
                    unsafe_allow_html=True)


def follow() -> None:
    s = ss.live.status()
    controls(s)
    if s["state"] in ("error", "crashed"):
        st.error("The live engine failed. What it said:", icon=":material/error:")
        st.code(s.get("error") or "no message", language=None)
    path = s.get("run_path")
    if path and ss.get("live_run_seen") != path:
        ss.live_run_seen, ss.run_path = path, path
        st.rerun()          # the sidebar and the URL learn the new run
    if s["state"] in TERMINAL and ss.get("live_final") != (path, s["state"]):
        ss.live_final = (path, s["state"])
        st.rerun()          # a last full render, then the fragment stops ticking
    if path and os.path.exists(path):
        latest_step(path)
        outputs(s)


def main() -> None:
    st.title("Live run")
    st.caption("SmolLM2-135M-Instruct (the default model) in a background engine process, traced at level "
               "\"full\": every step is committed to the run store and shown here as it lands.")
    code_ref("dashboard/live.py", "LiveRun.start → LLMEngine.add_request / LLMEngine.step")
    samples = data.runs_in(state.samples_dir())
    if gpu_sample(samples) is not None:
        with st.container(border=True):
            c1, c2 = st.columns([3, 2], vertical_alignment="center")
            c1.markdown(":material/memory: **On a CPU every step runs eager**: no CUDA graphs, no device lane. "
                        "A run recorded on a GPU ships with the repository: graph replays padded to a "
                        "captured size, eager prefills, per-layer and per-kernel device timings.")
            with c2:
                gpu_sample_button(samples, "live_gpu_sample", type="primary")
    live = ss.get("live")
    running = live is not None and live.status()["state"] not in TERMINAL
    with st.expander("Start a run", expanded=not running):
        spec = live_form()
    if spec is not None:
        start(spec)
        live = ss.live
    if live is None:
        st.info("Pick a scenario and press **Start live run**, or open a recorded run in the sidebar.")
        return
    running = live.status()["state"] not in TERMINAL
    st.fragment(follow, run_every=1.0 if running else None)()


main()
