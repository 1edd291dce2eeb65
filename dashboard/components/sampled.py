"""Sampled tokens of one step (token id and text per request) and how the forward
pass ran: CUDA graph replay or eager ("eager (CPU)" on a CPU run)."""
from __future__ import annotations

import streamlit as st

from dashboard import data
from dashboard.components.code_ref import code_ref
from dashboard.theme import req_chip


def execution_mode(meta: dict) -> str:
    device = str(meta.get("device", "?"))
    if device.startswith("cpu"):
        return "eager (CPU) — no CUDA graphs without a GPU"
    cfg = (meta.get("config") or {}).get("compilation_config") or {}
    return "CUDA graph replay" if cfg.get("cudagraph_mode") not in (None, "NONE", "none") else f"eager ({device})"


def sampled(meta: dict, step_id: int, tokens: dict, so: dict) -> None:
    picked = tokens["sampled"].get(step_id, {})
    st.markdown(f"**Sampled tokens** · forward pass: **{execution_mode(meta)}**")
    if not picked:
        st.caption("no request sampled in this step (only partial prefill chunks)")
    lines = []
    for req, (pos, tok) in picked.items():
        if tok is None:
            lines.append(f"{req_chip(req)} position {pos}: last token of the request (not fed back, so not "
                         f"in the run store)")
            continue
        text = data.decode(meta, [tok])
        lines.append(f"{req_chip(req)} position {pos}: token <code>{tok}</code> "
                     f"<code>{(text or '').replace('<', '&lt;')!r}</code>")
    st.markdown("<br>".join(lines), unsafe_allow_html=True)
    code_ref("vllm_anatomy/worker/gpu_model_runner.py", "GPUModelRunner.sample_tokens · _bookkeeping_sync")
