"""What changed since the previous step, in one line per kind of change."""
from __future__ import annotations

import streamlit as st

from dashboard.components.queues import move_text
from dashboard.theme import req_chip
from dashboard.words import n_of


def changes(prev: dict | None, step: dict, moves: list[tuple[str, str, str]]) -> list[str]:
    rec = step["scheduler"]["step_record"]
    kv = step["scheduler"]["kv_cache"]
    out = []
    by_kind: dict[str, list[str]] = {}
    for req, a, b in moves:
        if (a, b) != ("RUNNING", "RUNNING"):       # running on is not a change
            by_kind.setdefault(move_text(a, b), []).append(req)
    for k, reqs in by_kind.items():
        out.append(f"{k}: " + " ".join(req_chip(r) for r in reqs))
    for h in rec.get("prefix_hits", []):
        if h["num_hit_tokens"]:
            out.append(f"prefix-cache hit: {req_chip(h['request_id'])} {h['num_hit_tokens']} of "
                       f"{n_of(h['num_query_tokens'], 'token')} from blocks {h['hit_block_ids']}")
    events: dict[str, int] = {}
    for e in step.get("block_pool_events", []):
        events[e["kind"]] = events.get(e["kind"], 0) + len(e["block_ids"])
    if events:
        out.append("blocks: " + ", ".join(f"{v} {k}" for k, v in events.items()))
    if prev:
        du = kv["usage"] - prev["scheduler"]["kv_cache"]["usage"]
        if abs(du) > 1e-9:
            out.append(f"KV usage {prev['scheduler']['kv_cache']['usage']:.0%} → {kv['usage']:.0%}")
    return out


def diff(prev: dict | None, step: dict, moves: list[tuple[str, str, str]]) -> None:
    items = changes(prev, step, moves)
    head = "Changes since the previous step" if prev else "First step of the run"
    body = "".join(f"<li>{i}</li>" for i in items) or "<li>nothing but decodes</li>"
    st.markdown(f"<div style='background:#FFF8E1;border-left:4px solid #E69F00;padding:4px 10px;"
                f"border-radius:4px'><b>{head}</b><ul style='margin:0'>{body}</ul></div>",
                unsafe_allow_html=True)
