"""Colours shared by every panel: one colour per request (stable across pages and
steps), status colours for the request state machine, colours for chunk kinds,
block states and span families."""
from __future__ import annotations

# Okabe-Ito-like qualitative palette, then Tableau: readable on white, colour-blind friendly first.
REQUEST_PALETTE = [
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#8C564B",
    "#9467BD", "#17BECF", "#BCBD22", "#7F7F7F", "#1F77B4", "#FF7F0E", "#2CA02C", "#D62728",
]

STATUS_COLORS = {
    "WAITING": "#F2C14E",
    "RUNNING": "#2E9E5B",
    "PREEMPTED": "#D1495B",
    "FINISHED_STOPPED": "#4A6FA5",
    "FINISHED_LENGTH_CAPPED": "#6C8EBF",
    "FINISHED_ABORTED": "#8E8E8E",
    "FINISHED_IGNORED": "#A0A0A0",
    "FINISHED_ERROR": "#5B5B5B",
    "FINISHED_REPETITION": "#7E6BA6",
}

KIND_COLORS = {"prefill_chunk": "#F4A259", "final_prefill_chunk": "#E07A5F",
               "decode": "#3D9970", "resumed": "#B56576", "unused": "#E6E6E6"}

BLOCK_FREE = "#F3F3F3"      # free, never hashed
BLOCK_CACHED = "#D9D2E9"    # free but hashed: a prefix-cache candidate (evictable)
BLOCK_NULL = "#BDBDBD"      # the null block (block 0)

EVENT_COLORS = {"allocate": "#2E9E5B", "free": "#8E8E8E", "hit": "#0072B2",
                "evict": "#D1495B", "cache": "#7E6BA6"}

SPAN_COLORS = {"EngineCore": "#4A6FA5", "Scheduler": "#E69F00", "Executor": "#8C564B",
               "GPUModelRunner": "#009E73", "Worker": "#56B4E9", "llm_request": "#CC79A7",
               "device": "#D55E00",
               # device lane, finer grain (full names first: see span_color)
               "GPU.layer": "#F0A35E", "GPU.kernel.unified_attention": "#0072B2",
               "GPU.kernel.reshape_and_cache": "#6A3D9A", "GPU.kernel.compute_slot_mapping": "#CC79A7",
               "GPU.kernel": "#7F7F7F"}
CUDAGRAPH_COLORS = {"FULL": "#2E9E5B", "NONE": "#8E8E8E"}


def request_color(req_id: str | None) -> str:
    """Stable colour of a request id ("0", "1", ... map in order; other ids by hash)."""
    if req_id is None:
        return "#999999"
    key = int(req_id) if str(req_id).isdigit() else sum(map(ord, str(req_id))) * 7
    return REQUEST_PALETTE[key % len(REQUEST_PALETTE)]


def span_color(name: str) -> str:
    if name in SPAN_COLORS:
        return SPAN_COLORS[name]
    if name.startswith("GPU.kernel."):
        return SPAN_COLORS["GPU.kernel"]
    return SPAN_COLORS.get(name.split(".")[0], "#7F7F7F")


def chip(text: str, color: str, fg: str = "white") -> str:
    """An inline coloured label (HTML, for st.markdown(unsafe_allow_html=True))."""
    return (f"<span style='background:{color};color:{fg};border-radius:4px;padding:1px 6px;"
            f"margin:1px;font-size:0.82em;font-family:monospace;white-space:nowrap'>{text}</span>")


def req_chip(req_id: str, extra: str = "") -> str:
    return chip(f"req {req_id}{extra}", request_color(req_id))
