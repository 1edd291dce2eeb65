"""The SchedulerOutput of one step: new requests (first time on the worker),
cached requests (already there; resumed ones marked), tokens scheduled per
request, preempted and finished requests."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.theme import req_chip


def _new_table(new: list[dict], n_sched: dict) -> pd.DataFrame:
    return pd.DataFrame([{"req": r["req_id"], "prompt tokens": len(r["prompt_token_ids"]),
                          "prefix-cached (num_computed_tokens)": r["num_computed_tokens"],
                          "scheduled tokens": n_sched.get(r["req_id"], 0),
                          "block_ids": str(r["block_ids"][0] if r["block_ids"] else [])} for r in new])


def _cached_table(c: dict, n_sched: dict) -> pd.DataFrame:
    resumed = set(c.get("resumed_req_ids", []))
    rows = []
    for i, req in enumerate(c["req_ids"]):
        nb = c["new_block_ids"][i]
        rows.append({"req": req, "resumed": req in resumed, "num_computed_tokens": c["num_computed_tokens"][i],
                     "num_output_tokens": c["num_output_tokens"][i], "scheduled tokens": n_sched.get(req, 0),
                     "new_block_ids": str(nb[0] if nb else [])})
    return pd.DataFrame(rows)


def scheduler_output(so: dict, rec: dict) -> None:
    n_sched = so["num_scheduled_tokens"]
    st.markdown(f"**SchedulerOutput** · step {so.get('step_id')} · total_num_scheduled_tokens "
                f"**{so['total_num_scheduled_tokens']}** over {len(n_sched)} requests")
    c1, c2 = st.columns(2)
    with c1:
        st.markdown(f"scheduled_new_reqs ({len(so['scheduled_new_reqs'])})")
        if so["scheduled_new_reqs"]:
            st.dataframe(_new_table(so["scheduled_new_reqs"], n_sched), hide_index=True, width="stretch")
    with c2:
        st.markdown(f"scheduled_cached_reqs ({len(so['scheduled_cached_reqs']['req_ids'])})")
        if so["scheduled_cached_reqs"]["req_ids"]:
            st.dataframe(_cached_table(so["scheduled_cached_reqs"], n_sched), hide_index=True,
                         width="stretch")
    pre = " ".join(req_chip(r) for r in rec.get("preempted_req_ids", [])) or "none"
    fin = " ".join(req_chip(r) for r in so.get("finished_req_ids", [])) or "none"
    st.markdown(f"preempted this step: {pre} &nbsp; · &nbsp; finished_req_ids (freed on the worker): {fin}",
                unsafe_allow_html=True)
    code_ref("vllm_anatomy/core/sched/output.py", "SchedulerOutput, NewRequestData, CachedRequestData")
