"""The KV block pool of one step: one cell per block, coloured by its owner request
(striped when shared), with ref_cnt, hash, free-queue position and this step's
block-pool events (allocate / free / hit / evict / cache). Cells that changed
since the previous step are outlined."""
from __future__ import annotations

import html

import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.components.kv_memory import mb
from dashboard.theme import BLOCK_CACHED, BLOCK_FREE, BLOCK_NULL, EVENT_COLORS, INK, chip, request_color, text_on
from dashboard.words import n_of

MAX_CELLS = 768
EVENT_LETTER = {"allocate": "A", "free": "F", "hit": "H", "evict": "E", "cache": "C"}
EVENT_MEANING = {"allocate": "handed to a request (popped from the free queue's head)",
                 "free": "released by its last holder (back to the free queue)",
                 "hit": "found by hash: a prefix-cache hit, shared instead of recomputed",
                 "evict": "a cached free block reused for new data: its hash is dropped",
                 "cache": "became full and got its hash (now findable by later requests)"}
GLOSSARY = ("**Reading a cell** — first line: block id and this step's events (A allocate, F free, H hit, E evict, "
            "C cache: hover a badge). Second line: `qN` = the block is free, at position N of the free queue (q0 is "
            "handed out next, LRU order), or `rcN` = ref_cnt, the number of requests holding it (rc2+ = shared "
            "through the prefix cache). Third line: `#a1b2c3` = the first 6 hex digits of the block's hash (only "
            "full blocks are hashed: same tokens after the same prefix, same hash); `null` = block 0, never handed "
            "out. Outlined in red: changed since the previous step.")


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


def _cell(b: dict, free_pos: dict, events: list[str], changed: bool, per_block: int | None = None) -> str:
    fill = _fill(b)
    shared = fill.startswith("linear-gradient")
    fg = INK if shared else text_on(fill)
    where = (f"free, position {free_pos[b['block_id']]} of the free queue" if b["block_id"] in free_pos
             else f"held by {n_of(b['ref_cnt'], 'request')} {b['owners']}")
    hashed = (f"hash {b['hash']}" if b["hash"] else "no hash (the null block holds no tokens)" if b["is_null"]
              else "no hash (only a full block is hashed, with prefix caching on)")
    tip = html.escape(f"block {b['block_id']} · {where} · ref_cnt {b['ref_cnt']} · {hashed} · "
                      + (f"{mb(per_block)} · " if per_block else "")
                      + ("events: " + ", ".join(f"{k} ({EVENT_MEANING[k]})" for k in dict.fromkeys(events))
                         if events else "no event this step"), quote=True)
    badges = "".join(f"<span style='background:{EVENT_COLORS[k]};color:{text_on(EVENT_COLORS[k])};border-radius:3px;"
                     f"padding:0 2px;margin-left:2px'>{EVENT_LETTER[k]}</span>" for k in dict.fromkeys(events))
    border = "3px solid #C8404F" if changed else "1px solid #BDBDBD"
    hash_line = f"#{b['hash'][:6]}" if b["hash"] else ("null" if b["is_null"] else "&nbsp;")
    pos = f"q{free_pos[b['block_id']]}" if b["block_id"] in free_pos else f"rc{b['ref_cnt']}"
    text = f"<b>{b['block_id']}</b>{badges}<br>{pos}<br>{hash_line}"
    if shared:   # striped fill: the text gets a light backing
        text = f"<span style='background:rgba(255,255,255,0.8);border-radius:2px'>{text}</span>"
    return (f"<div title='{tip}' data-block='{b['block_id']}' style='background:{fill};color:{fg};border:{border};"
            f"border-radius:4px;width:84px;height:62px;padding:2px 4px;font:12px/1.3 monospace;overflow:hidden'>"
            f"{text}</div>")


def _signature(b: dict) -> tuple:
    return b["ref_cnt"], b["hash"], tuple(b["owners"])


def block_pool(kv: dict, events: list[dict], prev_kv: dict | None, per_block: int | None = None) -> None:
    """The block grid; per_block (bytes of one block, dashboard/components/kv_memory.py) adds MB."""
    blocks = kv["blocks"]
    free_pos = {bid: i for i, bid in enumerate(kv["free_queue"])}
    prev = {b["block_id"]: _signature(b) for b in prev_kv["blocks"]} if prev_kv else {}
    ev = _events_by_block(events)
    cells = [_cell(b, free_pos, ev.get(b["block_id"], []),
                   bool(prev) and prev.get(b["block_id"]) != _signature(b), per_block) for b in blocks[:MAX_CELLS]]
    n_cached = sum(1 for b in blocks if not b["owners"] and b["hash"] and not b["is_null"])
    sparse = kv.get("sparse", False)
    hashed = "" if sparse else f" (of which {n_cached} still hashed = prefix-cache hits until evicted)"
    total = kv["num_gpu_blocks"]
    # NOTE: usage is BlockPool.get_usage: a share of the usable blocks (num_gpu_blocks − 1, block 0 is the
    # null block), while "pool" counts all of them: the line says which, or in use / pool ≠ usage.
    used = total - kv["num_free_blocks"] - 1
    size = (f" · one block = {mb(per_block)} (K and V of {kv['block_size']} tokens in every layer), pool "
            f"{mb(total * per_block)}, in use {mb(max(used, 0) * per_block)}" if per_block else "")
    st.markdown(f"**KV block pool** · {kv['num_gpu_blocks']} blocks × {kv['block_size']} tokens · usage "
                f"**{kv['usage']:.0%}** ({max(used, 0)} of {total - 1} usable blocks) · free {kv['num_free_blocks']}{hashed} · "
                f"prefix caching {'on' if kv['enable_caching'] else 'off'}{size}")
    if sparse:
        st.caption(f"A GPU-sized pool: this step's snapshot lists only the {n_of(len(blocks), 'block')} it touched, "
                   f"the head of the free queue and the null block (KVCacheManager.snapshot, \"sparse\"); "
                   f"the block tables below are complete.")
    st.markdown("<div style='display:flex;flex-wrap:wrap;gap:3px'>" + "".join(cells) + "</div>",
                unsafe_allow_html=True)
    if len(blocks) > MAX_CELLS:
        st.caption(f"showing the first {MAX_CELLS} of {n_of(len(blocks), 'block')}")
    legend = " ".join(chip(f"{EVENT_LETTER[k]} {k}", c, title=EVENT_MEANING[k]) for k, c in EVENT_COLORS.items())
    st.markdown(f"Events: {legend} · fills: request colour (striped: shared), "
                f"{chip('free', BLOCK_FREE, title='free, never hashed')}"
                f"{chip('free, hashed', BLOCK_CACHED, title='free but still hashed: a prefix-cache hit until evicted')}"
                f"{chip('null block', BLOCK_NULL, title='block 0: a placeholder, never allocated')}",
                unsafe_allow_html=True)
    st.caption(GLOSSARY)
    counts = {k: sum(len(e["block_ids"]) for e in events if e["kind"] == k) for k in EVENT_LETTER}
    st.caption("This step: " + (", ".join(f"{v} {k}" + (f" ({mb(v * per_block)})" if per_block else "")
                                          for k, v in counts.items() if v) or "no block-pool events")
               + f" · free queue (LRU, evicted from the front): {kv['free_queue'][:40]}"
               + (" …" if len(kv["free_queue"]) > 40 else ""))
    code_ref("vllm_anatomy/core/block_pool.py", "BlockPool · FreeKVCacheBlockQueue · KVCacheManager.snapshot")
