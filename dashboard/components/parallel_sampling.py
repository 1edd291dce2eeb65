"""Parallel sampling in the KV tab: which requests of the step are the n samples of one
request, and which prompt blocks they share.

The engine never sees a parent request (vllm_anatomy/engine/parallel_sampling.py): a
request with n > 1 reaches it as n requests named "{i}_{parent id}", i = 0..n-1, and
the prefix cache puts them on one set of prompt blocks. This note finds such sibling
groups by those ids (two or more children of one parent id) in a step's block tables
and says what the grid above shows: the blocks all of them hold (ref_cnt = n while they
all run) and the blocks each holds alone.
"""
from __future__ import annotations

import re

import streamlit as st

from dashboard.components.code_ref import code_ref

_CHILD_ID = re.compile(r"^(\d+)_(.+)$")


def sibling_groups(req_ids) -> dict[str, list[str]]:
    """Parent id -> its children among req_ids (by index), for parents with at least two."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for req_id in req_ids:
        m = _CHILD_ID.match(req_id)
        if m:
            groups.setdefault(m.group(2), []).append((int(m.group(1)), req_id))
    return {parent: [r for _, r in sorted(kids)] for parent, kids in groups.items() if len(kids) > 1}


def describe(kv: dict) -> list[str]:
    """One markdown line per sibling group of this step's block tables."""
    tables = kv["req_to_block_ids"]
    ref = {b["block_id"]: b["ref_cnt"] for b in kv["blocks"]}
    lines = []
    for parent, kids in sibling_groups(tables).items():
        shared = [b for b in tables[kids[0]] if all(b in tables[k] for k in kids)]
        own = {k: [b for b in tables[k] if b not in shared] for k in kids}
        rcs = sorted({ref.get(b, 0) for b in shared})
        head = (f"**Parallel sampling** · `{parent}`: {len(kids)} of its samples run now ("
                + ", ".join(f"`{k}`" for k in kids) + "). ")
        own_text = "; ".join(f"`{k}` {own[k]}" for k in kids)
        if not shared:
            # NOTE: siblings share the prompt's KV only through the prefix cache (a full block's hash):
            # none shared means caching is off, or no prompt block was full and hashed when they were scheduled.
            why = ("prefix caching is off in this run, and siblings find one copy of the prompt's KV only "
                   "through it" if kv.get("enable_caching") is False else
                   "no block of the prompt was found in the prefix cache for them (only full blocks are hashed)")
            lines.append(head + f"They share no block ({why}): each holds its own: {own_text}.")
            continue
        lines.append(
            head + f"They share blocks {shared} "
            f"(ref_cnt {'/'.join(map(str, rcs))}: one copy of the prompt's KV, found through the "
            f"prefix cache) and each holds its own: " + own_text
            + ". A shared block returns to the free queue only when the last child holding it finishes.")
    return lines


def parallel_sampling_note(kv: dict) -> None:
    """Under the block grid: the step's n > 1 requests and their shared blocks (nothing if none)."""
    lines = describe(kv)
    if not lines:
        return
    st.markdown("<br>".join(lines), unsafe_allow_html=True)
    code_ref("vllm_anatomy/engine/parallel_sampling.py", "ParentRequest · fan_out")
