"""The landing page: what this is and three ways in (the start strip), then the
live run: start the default model on a scenario or your own prompts in a
background engine process (dashboard/live.py), watch its start-up stages (from
the run store's start-up spans) and follow its steps as they are committed.
Pause/resume following, stop the engine."""
from __future__ import annotations

import os
import re

import streamlit as st

from dashboard import data, state
from dashboard.components.block_pool import block_pool
from dashboard.components.budget import budget
from dashboard.components.code_ref import code_ref
from dashboard.components.live_form import live_form
from dashboard.components.queues import queues
from dashboard.components.run_picker import gpu_sample, gpu_sample_button, open_sample
from dashboard import live as live_mod
from dashboard.live import STARTUP_SPANS, LiveRun
from dashboard.scenarios import SCENARIOS, build_spec
from dashboard.theme import req_chip

ss = st.session_state
TERMINAL = ("done", "stopped", "error", "crashed")
# NOTE: the article's title is Chinese; shown as a tooltip, so a machine without CJK fonts shows no boxes.
ARTICLE = ('<span title="vLLM 源码剖析 · 第 14 篇" style="border-bottom:1px dotted #4D4D4D"><b>vLLM Source '
           'Anatomy, part 14</b></span> (on vLLM v0.27.1)')


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


def start_tour() -> None:
    """Callback of the start strip's primary button: the guided-tour scenario as it is."""
    sc = SCENARIOS["tour"]
    ss.pending_spec = build_spec("tour", sc["prompts"], sc["engine_args"], sc["max_tokens"], sc["ignore_eos"],
                                 sc.get("step_delay_s", 0.0))


def start_strip(samples: list[dict], compact: bool) -> None:
    """One paragraph on what this is, and three ways in; one primary action."""
    if compact:
        with st.expander("What is this? · other ways in", expanded=False):
            _strip_body(samples, primary=False)
        return
    _strip_body(samples, primary=True)


def _strip_body(samples: list[dict], primary: bool) -> None:
    if primary:
        st.title("vllm_anatomy")
    st.markdown(
        "**A vLLM V1 engine you can watch, step by step.** `vllm_anatomy` re-implements vLLM's serving "
        "engine with the same objects and call chain (`Scheduler`, `KVCacheManager`, `GPUModelRunner`, "
        "`InputBatch`, …), runs a real model, and records every engine step (spans and state snapshots) "
        f"so this dashboard can replay it. It brings to life the article {ARTICLE}: the token budget, "
        "paged KV blocks and prefix hits, `slot_mapping`, the request state machine with preemption, and the "
        "step's one CPU↔GPU sync point.", unsafe_allow_html=True)
    c1, c2, c3 = st.columns(3)
    gpu = gpu_sample(samples)
    with c1.container(border=True, height="stretch"):
        st.markdown("**1 · Watch a live run**  \nThe default model (SmolLM2-135M) on this machine, on a guided "
                    "tour: prefix-cache hits, chunked prefill and a preemption in about 47 steps, 0.6 s apart so "
                    "you can follow them. Its start-up stages show below.")
        st.button("Start the guided tour", key="strip_start", icon=":material/play_arrow:", on_click=start_tour,
                  type="primary" if primary else "secondary", width="stretch")
    with c2.container(border=True, height="stretch"):
        if gpu is not None:
            st.markdown("**2 · Open the GPU sample**  \nA run recorded on an NVIDIA GPU: full and piecewise CUDA-graph "
                        "replays, eager prefills with per-layer and per-kernel timings on the device lane.")
            gpu_sample_button(samples, "strip_gpu_sample", width="stretch")
        else:
            st.markdown("**2 · Open a recorded run**  \nPick any run of the trace directory in the sidebar "
                        "(no GPU sample ships with this checkout).")
    _card_three(c3, samples, gpu)
    # NOTE: a page link's label is one line, clipped where the column ends: the knobs go in a caption.
    st.page_link("views/compare.py", label="Trade-offs: compare two runs, side by side",
                 icon=":material/compare_arrows:")
    st.caption("The same prompts with one knob changed: batch size, chunk size, prefix caching, async scheduling, "
               "CUDA graphs, TP, speculative decoding.")


def _card_three(c3, samples: list[dict], gpu: dict | None) -> None:
    with c3.container(border=True, height="stretch"):
        st.markdown("**3 · Follow the lessons, then the self-test**  \nLesson cards find each concept in the "
                    "open run; the nine CLI lessons (`vllm-anatomy lesson 1` … `9`, the self-test) record their "
                    "own runs and print links back here.")
        st.page_link("views/lessons.py", label="Open the lesson cards", icon=":material/school:", width="stretch")
        sample = None if ss.get("run_path") else (gpu or next((r for r in samples if not r.get("error")), None))
        if sample is None:
            st.page_link("views/selftest.py", label="Open the self-test", icon=":material/quiz:", width="stretch")
        else:
            # NOTE: the self-test answers from a run: with none open, the link opens a shipped sample on it.
            st.button("Open the self-test", key="strip_selftest", icon=":material/quiz:", width="stretch",
                      on_click=open_sample, args=(sample["path"], "selftest"),
                      help=f"no run is open: opens the sample {os.path.basename(sample['path'])} on the Self-test page")


def stop() -> None:
    ss.live.stop()


def controls(s: dict) -> None:
    c = st.columns([2, 2, 3, 5], vertical_alignment="center")
    alive = s["state"] not in TERMINAL
    c[0].button(":material/pause: Pause following" if ss.get("following", True) else ":material/play_arrow: Resume following", key="follow_btn",
                on_click=state.toggle, args=("following",), disabled=not alive)
    c[1].button(":material/stop: Stop engine", key="stop_btn", on_click=stop, disabled=not alive)
    c[2].button("Open in inspector", key="to_inspector", icon=":material/search:", disabled=not s.get("run_path"),
                on_click=state.goto, args=(ss.get("cursor") or 0, "inspector"))
    c[3].markdown(f"engine **{s['state']}** · step {s.get('step', 0)} · pid {ss.live.proc.pid}")


def startup_progress(s: dict, path: str | None) -> bool:
    """The start-up stages with their times; True once the first step is committed."""
    marks = data.startup_marks(path, STARTUP_SPANS) if path and os.path.exists(path) else {}
    stages = ss.live.startup(s, marks)
    done = sum(x["state"] == "done" for x in stages)
    if done == len(stages) and ss.get("startup_seen"):
        st.caption("Started in " + f"{sum(x['seconds'] for x in stages):.1f} s: " +
                   " · ".join(f"{x['name']} {x['seconds']:.1f} s" for x in stages))
        return True
    total = sum(x["seconds"] or 0 for x in stages)
    icon = {"done": ":material/check_circle:", "running": ":material/hourglass_top:",
            "waiting": ":material/radio_button_unchecked:"}
    lines = []
    for x in stages:
        secs = "" if x["seconds"] is None else f" · {x['seconds']:.1f} s" + ("…" if x["state"] == "running" else "")
        lines.append(f"{icon[x['state']]} **{x['name']}**{secs} — <span style='color:#4D4D4D'>{x['what']}</span>")
    with st.container(border=True):
        st.markdown(f"**Start-up** · {total:.1f} s since Start" +
                    (" · first step committed" if done == len(stages) else ""))
        st.progress(done / len(stages))
        st.markdown("  \n".join(lines), unsafe_allow_html=True)
    if done == len(stages):
        ss.startup_seen = True
        ss.startup_summary = stages
    return done == len(stages)


def latest_step(path: str) -> None:
    info = data.run_info(path, data.file_version(path))
    if isinstance(info, data.RunError) or not info["steps"]:
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
        budget(step["scheduler"]["step_record"], html_bar=True)
        queues(step)
    with c2:
        block_pool(step["scheduler"]["kv_cache"], step.get("block_pool_events", []), None)


def outputs(s: dict) -> None:
    texts = s.get("outputs") or {}
    if texts:
        st.markdown("<br>".join(f"{req_chip(r)} {t!s}".replace("\n", " ") for r, t in sorted(texts.items())),
                    unsafe_allow_html=True)


def _plain(text: str) -> str:
    """A message as plain text inside markdown (no stray emphasis, code, links or LaTeX). Underscores stay:
    inside a word (max_num_batched_tokens) they are no emphasis."""
    return re.sub(r"([\\`*\[\]<>#|~$])", r"\\\1", str(text)).replace("\n", "  \n")


def follow() -> None:
    s = ss.live.status()
    controls(s)
    if s["state"] in ("error", "crashed"):
        refused = str(s.get("error") or "").startswith("Not started:")
        st.error(("The live run was refused before it started:" if refused else "The live engine failed. What it "
                  "said:") + "  \n" + _plain(s.get("error") or "no message"), icon=":material/error:")
        st.caption(f"The engine's full log: `{ss.live.log_path}`")
    for i, why in sorted((s.get("refused") or {}).items()):
        st.warning(f"Request {int(i) + 1} was refused by the API server (the other requests ran on): "
                   + _plain(why), icon=":material/block:")
    path = s.get("run_path")
    if path and ss.get("live_run_seen") != path:
        ss.live_run_seen, ss.run_path = path, path
        ss.startup_seen = False
        st.rerun()          # the sidebar, the run header and the URL learn the new run
    if s["state"] in TERMINAL and ss.get("live_final") != (path, s["state"]):
        ss.live_final = (path, s["state"])
        st.rerun()          # a last full render, then the fragment stops ticking
    if s["state"] not in ("error", "crashed"):
        was_seen = ss.get("startup_seen")
        if startup_progress(s, path) and not was_seen:
            st.rerun()      # the first step: the run header (num_gpu_blocks is known now) and the sidebar
    if path and os.path.exists(path):
        latest_step(path)
        outputs(s)


def main() -> None:
    samples = data.runs_in(state.samples_dir())
    live = ss.get("live")
    pending = ss.pop("pending_spec", None)
    if pending is not None:
        start(pending)
        live = ss.live
    running = live is not None and live.status()["state"] not in TERMINAL
    if not running and st.context.headers:
        # a browser is looking at the landing page: get the next engine process's imports done now
        live_mod.prewarm(state.trace_dir())
    start_strip(samples, compact=live is not None)
    if live is not None:
        st.subheader("Live run")
        # NOTE: twice a second until the first step shows (the start-up stages move), then once.
        st.fragment(follow, run_every=(1.0 if ss.get("startup_seen") else 0.5) if running else None)()
    st.markdown("### Live run" if live is None else "#### Start another run")
    st.caption("SmolLM2-135M-Instruct (the default model) in a background engine process, traced at level "
               "\"full\": every step is committed to the run store and shown here as it lands. Pick a scenario "
               "(each shows one mechanism) or type your own prompts.")
    with st.expander("Scenario, prompts and engine arguments", expanded=live is None):
        spec = live_form()
    if spec is not None:
        start(spec)
        st.rerun()
    code_ref("dashboard/live.py", "LiveRun.start → LLMEngine.add_request / LLMEngine.step")


main()
