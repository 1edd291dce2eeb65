"""The SchedulerOutput of one step: new requests (first time on the worker),
cached requests (already there; resumed ones marked), tokens scheduled per
request, preempted and finished requests."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.components.focus import style_focus
from dashboard.theme import req_chip, short_req_id
from dashboard.words import n_of


# Key columns first (req, its blocks, its tokens), so they show without scrolling sideways.
HELP = {"req": st.column_config.TextColumn("req", help="request id, shortened as on the chips (prefix + its last 8 characters; hover a chip for the whole id)", width="medium"),
        "block_ids": st.column_config.TextColumn("block_ids", help="NewRequestData.block_ids: every KV block the "
                                                 "request holds (the worker copies them into its block table)",
                                                 width="medium"),
        "new_block_ids": st.column_config.TextColumn("new_block_ids", help="CachedRequestData.new_block_ids: "
                                                     "blocks allocated this step, appended to the worker's block "
                                                     "table ([] when the last block still has room)", width="medium"),
        "scheduled tokens": st.column_config.NumberColumn("scheduled tokens", help="num_scheduled_tokens[req]: "
                                                          "tokens it gets from this step's budget"),
        "prompt tokens": st.column_config.NumberColumn("prompt tokens", help="len(prompt_token_ids)"),
        "prefix-cached": st.column_config.NumberColumn("prefix-cached", help="num_computed_tokens on arrival: "
                                                       "tokens found in the prefix cache, not recomputed"),
        "num_computed_tokens": st.column_config.NumberColumn("num_computed_tokens", help="tokens already in the "
                                                             "KV cache before this step"),
        "num_output_tokens": st.column_config.NumberColumn("num_output_tokens", help="tokens generated so far, those still in flight (async scheduling) included, as v0.27.1 counts them"),
        "resumed": st.column_config.CheckboxColumn("resumed", help="back from PREEMPTED: its new block ids replace "
                                                   "its old row, and the worker gets its whole token list again "
                                                   "(all_token_ids, sent for every request not scheduled last step)")}


def _new_table(new: list[dict], n_sched: dict) -> pd.DataFrame:
    return pd.DataFrame([{"req": short_req_id(r["req_id"]), "block_ids": str(r["block_ids"][0] if r["block_ids"] else []),
                          "scheduled tokens": n_sched.get(r["req_id"], 0), "prompt tokens": len(r["prompt_token_ids"]),
                          "prefix-cached": r["num_computed_tokens"]} for r in new])


def _cached_table(c: dict, n_sched: dict) -> pd.DataFrame:
    resumed = set(c.get("resumed_req_ids", []))
    rows = []
    for i, req in enumerate(c["req_ids"]):
        nb = c["new_block_ids"][i]
        rows.append({"req": short_req_id(req), "new_block_ids": str(nb[0] if nb else []), "scheduled tokens": n_sched.get(req, 0),
                     "num_computed_tokens": c["num_computed_tokens"][i],
                     "num_output_tokens": c["num_output_tokens"][i], "resumed": req in resumed})
    return pd.DataFrame(rows)


def scheduler_output(so: dict, rec: dict) -> None:
    n_sched = so["num_scheduled_tokens"]
    st.markdown(f"**SchedulerOutput** · step {so.get('step_id')} · total_num_scheduled_tokens "
                f"**{so['total_num_scheduled_tokens']}** over {n_of(len(n_sched), 'request')}")
    st.markdown(f"`scheduled_new_reqs` ({len(so['scheduled_new_reqs'])}) — first time on the worker: the whole "
                f"request (prompt, sampling params, block_ids)")
    if so["scheduled_new_reqs"]:
        st.dataframe(style_focus(_new_table(so["scheduled_new_reqs"], n_sched)), hide_index=True, width="stretch",
                     column_config=HELP, key="sched_new")
    st.markdown(f"`scheduled_cached_reqs` ({len(so['scheduled_cached_reqs']['req_ids'])}) — already on the worker: "
                f"only what changed")
    if so["scheduled_cached_reqs"]["req_ids"]:
        st.dataframe(style_focus(_cached_table(so["scheduled_cached_reqs"], n_sched)), hide_index=True, width="stretch",
                     column_config=HELP, key="sched_cached")
    pre = " ".join(req_chip(r) for r in rec.get("preempted_req_ids", [])) or "none"
    fin = " ".join(req_chip(r) for r in so.get("finished_req_ids", [])) or "none"
    st.markdown(f"preempted this step: {pre} &nbsp; · &nbsp; finished_req_ids (freed on the worker): {fin}",
                unsafe_allow_html=True)
    code_ref("vllm_anatomy/core/sched/output.py", "SchedulerOutput, NewRequestData, CachedRequestData")
