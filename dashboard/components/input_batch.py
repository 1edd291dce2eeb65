"""The persistent InputBatch of the worker: one row per request in the batch
(row index = position in the block table and the sampling tensors), and this
step's condense moves (a finished request's hole filled by the last row)."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.components.focus import style_focus
from dashboard.components.kv_memory import blocks_mb
from dashboard.theme import chip, short_req_id


def input_batch(mr: dict, per_block: int | None = None) -> None:
    ib = mr.get("input_batch") or {}
    rows = ib.get("rows", [])
    st.markdown(f"**InputBatch** · num_reqs {ib.get('num_reqs', 0)}")
    if rows:
        st.dataframe(style_focus(pd.DataFrame([{"row": r["index"], "req": short_req_id(r["req_id"]),
                                                "block_ids": str(r["block_ids"]),
                                                "KV": blocks_mb(len(r["block_ids"]), per_block),
                                                "num_tokens": r["num_tokens"], "num_prompt_tokens": r["num_prompt_tokens"],
                                                "num_computed_tokens": r["num_computed_tokens"]} for r in rows])),
                     hide_index=True, width="stretch", key="input_batch_rows",
                     column_config={"row": st.column_config.NumberColumn(help="row index in the persistent batch "
                                                                         "(= row of the block table and sampling "
                                                                         "tensors)", width="small"),
                                    "block_ids": st.column_config.TextColumn(help="this row of the worker's block "
                                                                             "table", width="medium"),
                                    "KV": st.column_config.TextColumn(help="KV blocks held, and their memory")})
    moves = ib.get("condense_moves", [])
    text = " ".join(chip(f"row {m[0]} → row {m[1]}" if isinstance(m, (list, tuple)) else
                         f"row {m.get('from')} → row {m.get('to')}", "#7E6BA6") for m in moves)
    st.markdown(f"condense moves this step: {text or 'none'}", unsafe_allow_html=True)
    code_ref("vllm_anatomy/worker/gpu_input_batch.py", "InputBatch.condense / add_request")
