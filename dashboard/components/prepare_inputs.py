"""The tensors GPUModelRunner._prepare_inputs built for this step: per token
(input_ids, positions, req_indices, slot_mapping, and slot_mapping split into
block_id and offset: slot = block_id × block_size + offset) and per request
(query_start_loc, seq_lens, logits_indices), each column coloured by its request."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.components.focus import style_focus
from dashboard.theme import request_color, short_req_id
from dashboard.words import n_of

MAX_COLS = 256


def _style_by_request(df: pd.DataFrame, owners: list[str]):
    colors = [f"background-color: {request_color(o)}22; border-top: 3px solid {request_color(o)}" for o in owners]
    return df.style.apply(lambda row: colors, axis=1)


def token_tensors(pi: dict, block_size: int | None = None) -> pd.DataFrame:
    """One column per token; with block_size, slot_mapping is also split into block_id and offset
    rows (-1 for a padding slot, as in slot_mapping)."""
    n = min(len(pi["input_ids"]), MAX_COLS)
    names = ["input_ids", "positions", "req_indices", "slot_mapping"]
    rows = [pi[k][:n] for k in names]
    if block_size:
        slots = pi["slot_mapping"][:n]
        rows += [[s // block_size if s >= 0 else -1 for s in slots], [s % block_size if s >= 0 else -1 for s in slots]]
        names += ["block_id", "offset"]
    return pd.DataFrame(rows, index=names, columns=[str(i) for i in range(n)])


def request_tensors(pi: dict) -> pd.DataFrame:
    qsl = pi["query_start_loc"]
    return pd.DataFrame({"req": [short_req_id(r) for r in pi["req_ids"]], "num_scheduled_tokens": pi["num_scheduled_tokens"],
                         "query_start_loc": qsl[:-1], "query_end": qsl[1:], "seq_lens": pi["seq_lens"],
                         "logits_indices": pi["logits_indices"][:len(pi["req_ids"])],
                         "sampled": [i not in set(pi.get("discard_request_indices", []))
                                     for i in range(len(pi["req_ids"]))]})


REQUEST_HELP = {
    "num_scheduled_tokens": st.column_config.NumberColumn(help="tokens of this request in this step's batch"),
    "query_start_loc": st.column_config.NumberColumn(help="where its tokens start in the flattened batch"),
    "query_end": st.column_config.NumberColumn(help="query_start_loc of the next request (exclusive end)"),
    "seq_lens": st.column_config.NumberColumn(help="tokens in its KV cache after this step (attention length)"),
    "logits_indices": st.column_config.NumberColumn(help="the batch token whose logits are sampled: its last one"),
    "sampled": st.column_config.CheckboxColumn(help="False = a partial prefill chunk: its row index is in "
                                               "discard_request_indices, its sampled token is thrown away")}


def prepare_inputs(pi: dict | None, block_size: int | None = None) -> None:
    if not pi:
        st.caption("no prepare_inputs recorded for this step")
        return
    st.markdown(f"**prepare_inputs** · {n_of(len(pi['input_ids']), 'token')}, {n_of(len(pi['req_ids']), 'request')} · "
                f"query_start_loc {pi['query_start_loc']}")
    tt = token_tensors(pi, block_size)
    owners = [pi["req_ids"][r] for r in pi["req_indices"][:tt.shape[1]]]
    st.dataframe(_style_by_request(tt, owners), width="stretch")
    if len(pi["input_ids"]) > MAX_COLS:
        st.caption(f"first {MAX_COLS} of {len(pi['input_ids'])} tokens")
    st.caption("Columns are the batch's tokens (first row of each request outlined in its colour). "
               + (f"`block_id` and `offset` split `slot_mapping`: slot = block_id × {block_size} + offset; "
                  "-1 = a padding token that writes no KV. " if block_size else ""))
    st.dataframe(style_focus(request_tensors(pi)), hide_index=True, width="stretch", column_config=REQUEST_HELP)
    st.caption("`discard_request_indices`: the rows (requests) whose sampled token is thrown away because they are "
               "in the middle of a chunked prefill — their last token is not the prompt's last, so there is nothing "
               "to sample yet (`sampled` False above). This step: "
               f"{pi.get('discard_request_indices') or 'none'}.")
    code_ref("vllm_anatomy/worker/gpu_model_runner.py", "GPUModelRunner._prepare_inputs")
