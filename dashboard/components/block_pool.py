"""The KV block pool of one step: one cell per block, coloured by its owner request
(striped when shared), with ref_cnt, hash, free-queue position and this step's
block-pool events (allocate / free / hit / evict / cache). Cells that changed
since the previous step are outlined."""
from __future__ import annotations

import html

import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.theme import BLOCK_CACHED, BLOCK_FREE, BLOCK_NULL, EVENT_COLORS, chip, request_color

MAX_CELLS = 768
EVENT_LETTER = {"allocate": "A", "free": "F", "hit": "H", "evict": "E", "cache": "C"}


def _fill(b: dict) -> str:
    if b["is_null"]:
        return BLOCK_NULL
    owners = b["owners"]
    if not owners:
        return BLOCK_CACHED if b["hash"] else BLOCK_FREE
    if len(owners) == 1:
        return request_color(owners[0])
    stops = ", ".join(f"{request_color(o)} {i * 100 // len(owners)}% {(i + 1) * 100 // len(owners)}%"
                      for i, o in enumerate(owners))
    return f"linear-gradient(135deg, {stops})"


def _events_by_block(events: list[dict]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for e in events:
        for b in e["block_ids"]:
            out.setdefault(b, []).append(e["kind"])
    return out


def _cell(b: dict, free_pos: dict, events: list[str], changed: bool) -> str:
    fg = "white" if b["owners"] else "#444"
    tip = html.escape(f"block {b['block_id']} · ref_cnt {b['ref_cnt']} · hash {b['hash']} · "
                      f"owners {b['owners']} · free-queue position {free_pos.get(b['block_id'], '-')} · "
                      f"events {events}")
    badges = "".join(f"<span style='background:{EVENT_COLORS[k]};color:white;border-radius:3px;padding:0 2px;"
                     f"font-size:9px;margin-left:1px'>{EVENT_LETTER[k]}</span>" for k in dict.fromkeys(events))
    border = "3px solid #D1495B" if changed else "1px solid #ccc"
    hash_line = f"#{b['hash'][:6]}" if b["hash"] else ("null" if b["is_null"] else "&nbsp;")
    pos = f"q{free_pos[b['block_id']]}" if b["block_id"] in free_pos else f"rc{b['ref_cnt']}"
    return (f"<div title='{tip}' style='background:{_fill(b)};color:{fg};border:{border};border-radius:4px;"
            f"width:64px;height:50px;padding:2px 3px;font:10px monospace;line-height:1.25;overflow:hidden'>"
            f"<b>{b['block_id']}</b>{badges}<br>{pos}<br>{hash_line}</div>")


def _signature(b: dict) -> tuple:
    return b["ref_cnt"], b["hash"], tuple(b["owners"])


def block_pool(kv: dict, events: list[dict], prev_kv: dict | None) -> None:
    blocks = kv["blocks"]
    free_pos = {bid: i for i, bid in enumerate(kv["free_queue"])}
    prev = {b["block_id"]: _signature(b) for b in prev_kv["blocks"]} if prev_kv else {}
    ev = _events_by_block(events)
    cells = [_cell(b, free_pos, ev.get(b["block_id"], []),
                   bool(prev) and prev.get(b["block_id"]) != _signature(b)) for b in blocks[:MAX_CELLS]]
    n_cached = sum(1 for b in blocks if not b["owners"] and b["hash"] and not b["is_null"])
    sparse = kv.get("sparse", False)
    hashed = "" if sparse else f" (of which {n_cached} still hashed = prefix-cache hits until evicted)"
    st.markdown(f"**KV block pool** · {kv['num_gpu_blocks']} blocks × {kv['block_size']} tokens · usage "
                f"**{kv['usage']:.0%}** · free {kv['num_free_blocks']}{hashed} · "
                f"prefix caching {'on' if kv['enable_caching'] else 'off'}")
    if sparse:
        st.caption(f"A GPU-sized pool: this step's snapshot lists only the {len(blocks)} blocks it touched, "
                   f"the head of the free queue and the null block (KVCacheManager.snapshot, \"sparse\"); "
                   f"the block tables below are complete.")
    st.markdown("<div style='display:flex;flex-wrap:wrap;gap:3px'>" + "".join(cells) + "</div>",
                unsafe_allow_html=True)
    if len(blocks) > MAX_CELLS:
        st.caption(f"showing the first {MAX_CELLS} of {len(blocks)} blocks")
    legend = " ".join(chip(f"{EVENT_LETTER[k]} {k}", c) for k, c in EVENT_COLORS.items())
    st.markdown(f"Cell: id + events · `qN` position in the free queue (q0 is taken next) or `rcN` ref_cnt · "
                f"hash. Outlined: changed since the previous step. Events: {legend} "
                f"{chip('free', BLOCK_FREE, '#444')}{chip('free, hashed', BLOCK_CACHED, '#444')}"
                f"{chip('null block', BLOCK_NULL, '#444')}", unsafe_allow_html=True)
    counts = {k: sum(len(e["block_ids"]) for e in events if e["kind"] == k) for k in EVENT_LETTER}
    st.caption("This step: " + (", ".join(f"{v} {k}" for k, v in counts.items() if v) or "no block-pool events")
               + f" · free queue (LRU, evicted from the front): {kv['free_queue'][:40]}"
               + (" …" if len(kv["free_queue"]) > 40 else ""))
    code_ref("vllm_anatomy/core/block_pool.py", "BlockPool · FreeKVCacheBlockQueue · KVCacheManager.snapshot")
