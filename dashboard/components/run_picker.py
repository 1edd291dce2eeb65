"""Sidebar: the trace directory, its recorded runs (newest first) and the live run's status."""
from __future__ import annotations

import datetime
import os

import streamlit as st

from dashboard import data, state

ss = st.session_state


def _label(r: dict) -> str:
    name = os.path.basename(r["path"])
    if r.get("error"):
        return f"⚠ {name} (unreadable)"
    when = datetime.datetime.fromtimestamp((r.get("start_time_ns") or 0) / 1e9).strftime("%m-%d %H:%M:%S")
    live = "" if r.get("end_time_ns") else " · open/unfinished"
    return f"{when} · {r.get('run_id')} · {r.get('device')}{live}"


def _on_pick() -> None:
    state.open_run(ss.picked_run)


def run_picker() -> None:
    tdir = state.trace_dir()
    st.caption(f"Runs in `{os.path.abspath(tdir)}`")
    runs = data.runs_in(tdir)
    paths = [r["path"] for r in runs]
    labels = {r["path"]: _label(r) for r in runs}
    cur = ss.get("run_path")
    if cur and cur not in labels:
        paths.insert(0, cur)
        labels[cur] = os.path.basename(cur)
    if not paths:
        st.info("No recorded run yet: start one on the Live run page.")
    else:
        ss.picked_run = cur if cur in labels else None
        st.selectbox("Open a run", paths, key="picked_run", index=None, format_func=labels.get,
                     placeholder="pick a recorded run", on_change=_on_pick)
    live = ss.get("live")
    if live is not None:
        s = live.status()
        st.caption(f"Live engine: **{s['state']}** · step {s.get('step', 0)}")
