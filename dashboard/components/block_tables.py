"""Per-request block tables (KVCacheManager.req_to_block_ids): a request's logical
blocks in order, shared blocks (ref_cnt > 1) marked, prefix-cached blocks counted."""
from __future__ import annotations

import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.components.kv_memory import blocks_mb
from dashboard.theme import chip, req_chip, request_color


def block_tables(kv: dict, per_block: int | None = None) -> None:
    ref = {b["block_id"]: b["ref_cnt"] for b in kv["blocks"]}
    cached = kv.get("num_cached_block", {})
    lines = []
    for req, ids in kv["req_to_block_ids"].items():
        cells = " ".join(chip(f"{bid}{'*' if ref.get(bid, 0) > 1 else ''}", request_color(req),
                              title=f"logical block {i} → physical block {bid}, ref_cnt {ref.get(bid, '?')}")
                         for i, bid in enumerate(ids))
        lines.append(f"{req_chip(req)} → [{cells}] &nbsp; <span style='color:#4D4D4D;font-size:0.9em'>"
                     f"{blocks_mb(len(ids), per_block)}, {cached.get(req, 0)} full and hashed</span>")
    st.markdown("**Block tables** (logical block i → physical block id; * shared, ref_cnt > 1)<br>" +
                ("<br>".join(lines) or "no request holds blocks"), unsafe_allow_html=True)
    code_ref("vllm_anatomy/core/kv_cache_manager.py", "KVCacheManager.get_block_ids / req_to_blocks")
