"""The answers, cached per run version for the Streamlit pages (one RunSource per run
version in st.cache_resource; each answer in st.cache_data by its arguments)."""
from __future__ import annotations

import streamlit as st

from dashboard import data
from dashboard.answers import q1_allocation, q2_update_states, q3_block_table, q4_finish, q5_accounts
from dashboard.answers.common import Answer, cannot
from dashboard.answers.source import RunSource, RunSourceError


@st.cache_resource(max_entries=4, ttl=3600, show_spinner=False)
def source(path: str, version: tuple) -> RunSource | data.RunError:
    """The run's RunSource, or the RunError (shown by state.show_error) of a run whose spans cannot be read."""
    scan, statuses = data.step_scan(path, version), data.queue_statuses(path, version)
    try:
        return RunSource(path, scan=scan if isinstance(scan, dict) else None,
                         statuses=statuses if isinstance(statuses, dict) else None)
    except RunSourceError as e:
        return data.RunError(str(e))


def _safe(fn, *args) -> Answer:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a run missing a field gets a sentence, not a traceback
        return cannot(f"This run does not hold what this answer reads ({type(e).__name__}: {e}).")


@st.cache_data(max_entries=64, show_spinner=False)
def answer(path: str, version: tuple, key: str, step: int | None = None, request: str | None = None) -> Answer:
    src = source(path, version)
    if isinstance(src, data.RunError):
        return cannot(src.message)
    if key == "q1":
        return _safe(q1_allocation.answer, src, step, request)
    if key == "q2":
        return _safe(q2_update_states.answer, src, step)
    if key == "q3":
        return _safe(q3_block_table.answer, src, step, request)
    if key == "q4":
        return _safe(q4_finish.answer, src, step, request)
    return _safe(q5_accounts.answer, src, request)
