"""Colours and type shared by every panel: one colour per request (stable across pages
and steps), status colours for the request state machine, colours for chunk kinds,
block states and span families; the text colour that reads on each of them; the
font sizes every chart uses (no chart text under 12 px)."""
from __future__ import annotations

import html

# Chart type: nothing a learner must read is drawn under MIN_FONT_PX.
MIN_FONT_PX = 12
FONT_PX = 13
INK = "#1F1F1F"        # dark text on light fills
MUTED_INK = "#4D4D4D"  # secondary text that must still be read (never lighter than this on white)

# Okabe-Ito-like qualitative palette, then Tableau: readable on white, colour-blind friendly first.
REQUEST_PALETTE = [
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#E66E1E", "#F0E442", "#8C564B",
    "#845AB0", "#17BECF", "#BCBD22", "#939393", "#1F77B4", "#FF7F0E", "#2CA02C", "#D62728",
]

STATUS_COLORS = {
    "WAITING": "#F2C14E",
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": "#F7DE9C",
    "RUNNING": "#2E9E5B",
    "PREEMPTED": "#C8404F",
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
                "evict": "#C8404F", "cache": "#7E6BA6"}

SPAN_COLORS = {"EngineCore": "#4A6FA5", "Scheduler": "#E69F00", "Executor": "#8C564B",
               "GPUModelRunner": "#009E73", "Worker": "#56B4E9", "llm_request": "#CC79A7",
               "device": "#D55E00",
               # device lane, finer grain (full names first: see span_color)
               "GPU.layer": "#F0A35E", "GPU.kernel.unified_attention": "#0072B2",
               "GPU.kernel.prefill_attention": "#3B9AD9",     # VLLM_ANATOMY_PREFILL_KERNEL=1: attention's kin
               "GPU.kernel.reshape_and_cache": "#6A3D9A",
               "GPU.kernel.fused_qk_norm_rope_kvcache": "#6A3D9A",   # Qwen3's fused q/k norm + RoPE + KV write
               "GPU.kernel.fused_rope_kvcache": "#6A3D9A",           # Llama's fused RoPE + KV write
               "GPU.kernel.compute_slot_mapping": "#999933",     # olive: update_from_output has the pink
               "GPU.kernel": "#7F7F7F",
               "drafter": "#C71585"}       # speculative decoding's draft model: its phase and forwards
CUDAGRAPH_COLORS = {"FULL": "#2E9E5B", "PIECEWISE": "#7BAF3A", "NONE": "#8E8E8E"}


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


def _luminance(color: str) -> float:
    """WCAG relative luminance of a #RRGGBB colour."""
    h = color.lstrip("#")
    if len(h) == 3:
        h = "".join(c * 2 for c in h)
    rgb = [int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two #RRGGBB colours (1 to 21; body text wants 4.5)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_on(background: str) -> str:
    """The text colour that reads best on a #RRGGBB background: white or near-black,
    whichever has the higher contrast (white on yellow would not)."""
    if not background.startswith("#"):
        return INK
    return "white" if contrast("#FFFFFF", background) >= contrast(INK, background) else INK


def chip(text: str, color: str, fg: str | None = None, title: str | None = None) -> str:
    """An inline coloured label (HTML, for st.markdown(unsafe_allow_html=True)); the text
    colour is chosen for the fill unless given; `title` becomes its tooltip."""
    fg = fg or text_on(color)
    tip = f" title='{html.escape(title, quote=True)}'" if title else ""
    return (f"<span{tip} style='background:{color};color:{fg};border-radius:4px;padding:1px 6px;"
            f"margin:1px;font-size:0.85em;font-family:monospace;white-space:nowrap'>{text}</span>")


def short_req_id(req_id: str, limit: int = 16) -> str:
    """A request id short enough for a chip: the server's ids (`chatcmpl-<uuid>-<suffix>`, as
    vLLM makes them) keep their prefix and their last characters, `chatcmpl-…6bdac8dd`."""
    req_id = str(req_id)
    if len(req_id) <= limit:
        return req_id
    head = req_id.split("-", 1)[0][:8]
    return f"{head}-…{req_id[-8:]}"


def req_chip(req_id: str, extra: str = "") -> str:
    return chip(f"req {short_req_id(req_id)}{extra}", request_color(req_id), title=f"request {req_id}")


def style_figure(fig, *, legend_top: bool = False):
    """The chart type every Plotly figure shares: text at FONT_PX (never under
    MIN_FONT_PX, also inside bars, where a label that does not fit is hidden rather
    than shrunk), dark ink. legend_top puts a horizontal legend above the plot, clear
    of the x-axis title."""
    fig.update_layout(font=dict(size=FONT_PX, color=INK), hoverlabel=dict(font_size=FONT_PX),
                      uniformtext=dict(minsize=MIN_FONT_PX, mode="hide"),
                      legend=dict(font=dict(size=MIN_FONT_PX)))
    fig.update_xaxes(tickfont=dict(size=MIN_FONT_PX), title_font=dict(size=FONT_PX))
    fig.update_yaxes(tickfont=dict(size=MIN_FONT_PX), title_font=dict(size=FONT_PX))
    if legend_top:
        fig.update_layout(legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0))
    return fig
