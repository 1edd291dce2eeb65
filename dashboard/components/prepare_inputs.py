"""The tensors GPUModelRunner._prepare_inputs built for this step: per token
(input_ids, positions, req_indices, slot_mapping) and per request (query_start_loc,
seq_lens, logits_indices), each column coloured by its request."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.theme import request_color

MAX_COLS = 256


def _style_by_request(df: pd.DataFrame, owners: list[str]):
    colors = [f"background-color: {request_color(o)}22; border-top: 3px solid {request_color(o)}" for o in owners]
    return df.style.apply(lambda row: colors, axis=1)


def token_tensors(pi: dict) -> pd.DataFrame:
    n = min(len(pi["input_ids"]), MAX_COLS)
    names = ["input_ids", "positions", "req_indices", "slot_mapping"]
    return pd.DataFrame([pi[k][:n] for k in names], index=names, columns=[str(i) for i in range(n)])


def request_tensors(pi: dict) -> pd.DataFrame:
    qsl = pi["query_start_loc"]
    return pd.DataFrame({"req": pi["req_ids"], "num_scheduled_tokens": pi["num_scheduled_tokens"],
                         "query_start_loc": qsl[:-1], "query_end": qsl[1:], "seq_lens": pi["seq_lens"],
                         "logits_indices": pi["logits_indices"][:len(pi["req_ids"])],
                         "sampled": [i not in set(pi.get("discard_request_indices", []))
                                     for i in range(len(pi["req_ids"]))]})


def prepare_inputs(pi: dict | None) -> None:
    if not pi:
        st.caption("no prepare_inputs recorded for this step")
        return
    st.markdown(f"**prepare_inputs** · {len(pi['input_ids'])} tokens, {len(pi['req_ids'])} requests · "
                f"query_start_loc {pi['query_start_loc']}")
    tt = token_tensors(pi)
    owners = [pi["req_ids"][r] for r in pi["req_indices"][:tt.shape[1]]]
    st.dataframe(_style_by_request(tt, owners), width="stretch")
    if len(pi["input_ids"]) > MAX_COLS:
        st.caption(f"first {MAX_COLS} of {len(pi['input_ids'])} tokens")
    st.dataframe(request_tensors(pi), hide_index=True, width="stretch")
    st.caption("Rows whose `sampled` is False are partial prefill chunks: their logits are computed and "
               "discarded (discard_request_indices).")
    code_ref("vllm_anatomy/worker/gpu_model_runner.py", "GPUModelRunner._prepare_inputs")
