"""Sidebar: the recorded runs of the trace directory (newest first), the sample runs
shipped with the repository (samples/*.sqlite, e.g. a run recorded on an H200),
and the live run's status.

A sample is opened like any run (also by `?run=<file name>`). On a machine
without a GPU the sample recorded on one is the only way to see CUDA graphs and
the device lane, so a button offers it whenever another run (or none) is open.
"""
from __future__ import annotations

import datetime
import os
import re

import streamlit as st

from dashboard import data, state
from vllm_anatomy.transformers_utils.default_model import DEFAULT_MODEL

ss = st.session_state


def _label(r: dict) -> str:
    name = os.path.basename(r["path"])
    if r.get("error"):
        return f"⚠ {name} (unreadable)"
    when = datetime.datetime.fromtimestamp((r.get("start_time_ns") or 0) / 1e9).strftime("%m-%d %H:%M:%S")
    live = "" if r.get("end_time_ns") else " · open/unfinished"
    return f"{when} · {r.get('run_id')} · {r.get('device')}{live}"


def sample_hardware(r: dict) -> str:
    """What a sample ran on: the first word of its file name when it names a chip
    (`h100-smollm2-full.sqlite` → H200), else the run's device."""
    first = os.path.basename(r["path"]).split("-")[0].split(".")[0]
    if any(c.isdigit() for c in first) and any(c.isalpha() for c in first):
        return first.upper()
    return str(r.get("device") or "?").upper()


def is_gpu(r: dict) -> bool:
    return str(r.get("device") or "").startswith("cuda")


def sample_variant(stem: str) -> tuple[str, str]:
    """(what sets a sample apart, the rest of its name): `smollm2-full-3proc` → ("3 processes",
    "smollm2"), `smollm2-tp3-full` → ("TP 3", "smollm2"), `smollm2-full` → ("1 process", "smollm2")."""
    parts = [p for p in stem.split("-") if p and p != "full"]
    what = []
    for p in list(parts):
        m = re.fullmatch(r"(\d+)proc", p) or re.fullmatch(r"tp(\d+)", p)
        if m:
            what.append(f"{m[1]} processes" if p.endswith("proc") else f"TP {m[1]}")
            parts.remove(p)
    return (" · ".join(what) or "1 process"), "-".join(parts)


def sample_label(r: dict) -> str:
    """`sample · H200 · 3 processes · smollm2` for samples/h100-smollm2-full-3proc.sqlite: what sets it apart
    first (the sidebar is narrow: a clipped label still tells two samples apart)."""
    name = os.path.basename(r["path"])
    if r.get("error"):
        return f"⚠ sample · {name} (unreadable)"
    hw, stem = sample_hardware(r), os.path.splitext(name)[0]
    if stem.lower().startswith(hw.lower() + "-"):
        stem = stem[len(hw) + 1:]
    what, rest = sample_variant(stem)
    return f"sample · {hw} · {what}" + (f" · {rest}" if rest else "")


def gpu_sample(samples: list[dict]) -> dict | None:
    """The first readable sample recorded on a GPU, if any: the default model's in one process first."""
    gpus = [r for r in samples if not r.get("error") and is_gpu(r)]
    # NOTE: the default model's run is the one a learner without a GPU would have
    # recorded; the article-size run (Llama-2-7B, scripts/record_article_latency.py)
    # is newer but shows only decode graphs of one shape per batch.
    def rank(r: dict) -> tuple[bool, bool]:
        stem = os.path.splitext(os.path.basename(r["path"]))[0]
        return DEFAULT_MODEL not in str(r.get("model") or ""), sample_variant(stem)[0] != "1 process"
    return min(gpus, key=rank) if gpus else None


def tp_sample(samples: list[dict]) -> dict | None:
    """The first readable tensor-parallel sample (`-tp<N>` in its file name), if any."""
    return next((r for r in samples if not r.get("error") and re.search(r"-tp\d+", os.path.basename(r["path"]))),
                None)


def tp_sample_button(key: str, page: str, label: str, current: str | None = None, where=st, **kw) -> bool:
    """A button that opens the shipped tensor-parallel sample on `page` (unless it is the run
    `current`); False when there is none to open."""
    tp = tp_sample(data.runs_in(state.samples_dir()))
    if tp is None or (current is not None and os.path.abspath(tp["path"]) == os.path.abspath(current)):
        return False
    where.button(label, key=key, icon=":material/call_split:", on_click=open_sample, args=(tp["path"], page),
                 help=f"{os.path.basename(tp['path'])}: " + (tp.get("description") or "a tensor-parallel run")
                 + " — every rank all-reduces after o_proj and down_proj of every layer.", **kw)
    return True


def open_sample(path: str, page: str | None = "inspector") -> None:
    """Callback: open a sample run at its first CUDA graph replay (the last step if none)."""
    state.open_run(path, data.first_graph_step(path))
    if page:
        ss.goto_page = page


def gpu_sample_button(samples: list[dict], key: str, **kw) -> bool:
    """"No GPU here? Open the H200 sample run" (in the inspector, on a graph replay); False
    when no sample was recorded on a GPU."""
    gpu = gpu_sample(samples)
    if gpu is None:
        return False
    st.button(f"No GPU here? Open the {sample_hardware(gpu)} sample run", key=key, icon=":material/memory:",
              on_click=open_sample, args=(gpu["path"],),
              help=f"{os.path.basename(gpu['path'])}: " + (gpu.get("description") or "recorded on a GPU at trace "
                   "level full") + " — full and piecewise CUDA graph replays with padding, eager prefills with "
                   "per-layer and per-kernel device spans.", **kw)
    return True


def _on_pick() -> None:
    state.open_run(ss.picked_run)


def run_picker() -> None:
    tdir = state.trace_dir()
    st.caption(f"Runs in `{os.path.abspath(tdir)}` (and its `lessons/`), then the sample runs shipped in `samples/`")
    runs = data.runs_in(tdir)
    lessons = data.runs_in(state.lessons_dir()) if os.path.abspath(state.lessons_dir()) != os.path.abspath(tdir) else []
    samples = data.runs_in(state.samples_dir())
    paths = [r["path"] for r in runs] + [r["path"] for r in lessons] + [r["path"] for r in samples]
    labels = {r["path"]: _label(r) for r in runs}
    labels.update({r["path"]: "lesson · " + _label(r) for r in lessons})
    labels.update({r["path"]: sample_label(r) for r in samples})
    cur = ss.get("run_path")
    if cur and cur not in labels:
        paths.insert(0, cur)
        labels[cur] = os.path.basename(cur)
    if not paths:
        st.info("No recorded run yet: start one on the Live run page.")
    else:
        ss.picked_run = cur if cur in labels else None
        st.selectbox("Open a run", paths, key="picked_run", index=None, format_func=labels.__getitem__,
                     placeholder="pick a recorded or sample run", on_change=_on_pick)
    gpu = gpu_sample(samples)
    if gpu is not None and cur != gpu["path"]:
        gpu_sample_button(samples, "open_gpu_sample")


def _live_status_line() -> None:
    live = ss.get("live")
    if live is None:
        return
    s = live.status()
    step = s.get("step") or 0
    where = f"step {step}" + ("" if ss.get("following", True) else " · following paused")
    if not step and s["state"] in ("starting", "loading", "running"):
        from dashboard.live import STARTUP_SPANS
        path = s.get("run_path")
        marks = data.startup_marks(path, STARTUP_SPANS) if path and os.path.exists(path) else {}
        stage = next((x for x in live.startup(s, marks) if x["state"] == "running"), None)
        where = f"starting: {stage['name']} · {stage['seconds']:.0f} s" if stage else "starting"
    st.caption(f"Live engine: **{s['state']}** · {where}")


def live_status() -> None:
    """The live engine's state and step in the sidebar, refreshed every second while it runs
    (a fragment of its own: the page's fragment cannot redraw the sidebar)."""
    live = ss.get("live")
    if live is None:
        return
    running = live.status()["state"] not in ("done", "stopped", "error", "crashed")
    st.fragment(_live_status_line, run_every=1.0 if running else None)()
