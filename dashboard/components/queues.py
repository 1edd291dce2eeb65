"""Waiting and running queues with status colours, and the request state machine
with this step's transitions lit (statuses of the previous step vs this one).

The state machine is drawn small enough to keep its text at 12 px or more in a
column of the page (short edge labels, long names wrapped; the full wording is in
each node's and edge's tooltip), dark text on light fills."""
from __future__ import annotations

import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.components.kv_memory import blocks_mb, mb
from dashboard.theme import INK, STATUS_COLORS, chip, request_color, text_on

FINISH_STATUS = {"stop": "FINISHED_STOPPED", "length": "FINISHED_LENGTH_CAPPED", "abort": "FINISHED_ABORTED",
                 "error": "FINISHED_ERROR", "repetition": "FINISHED_REPETITION"}
NODES = ["WAITING", "RUNNING", "PREEMPTED", "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED"]
# (from, to, short label, tooltip)
EDGES = [("ARRIVAL", "WAITING", "arrives", "a request arrives: appended to the waiting queue (FCFS)"),
         ("WAITING", "RUNNING", "scheduled", "schedule() gave it tokens from the budget and allocate_slots() KV blocks"),
         ("RUNNING", "PREEMPTED", "no free block",
          "a running request needed a KV block and none was free: the newest running request is preempted, its "
          "blocks freed, num_computed_tokens reset to 0, and it goes back to the front of the waiting queue"),
         ("PREEMPTED", "RUNNING", "resumed",
          "rescheduled from the waiting queue: its tokens are recomputed (prefix-cache hits help)"),
         ("RUNNING", "FINISHED_STOPPED", "stop token", "EOS or a stop token id (update_from_output)"),
         ("RUNNING", "FINISHED_LENGTH_CAPPED", "max_tokens", "max_tokens or max_model_len reached"),
         ("RUNNING", "FINISHED_ABORTED", "aborted", "the client cancelled it (abort_requests)"),
         ("WAITING", "FINISHED_ABORTED", "aborted", "the client cancelled it before it ran")]
NODE_TIPS = {"WAITING": "in the waiting queue, no KV blocks yet", "RUNNING": "scheduled every step, holds KV blocks",
             "PREEMPTED": "evicted from the running batch, waiting to be recomputed",
             "FINISHED_STOPPED": "finished on EOS / a stop token", "FINISHED_LENGTH_CAPPED": "finished on max_tokens",
             "FINISHED_ABORTED": "cancelled"}
ACTIVE_EDGE = "#B0303F"     # dark red: 6:1 on white


def statuses(step: dict) -> dict[str, str]:
    sched = step["scheduler"]
    return {r["request_id"]: r["status"] for r in sched["waiting"] + sched["running"]}


def transitions(prev: dict | None, step: dict, finish_reasons: dict[str, str]) -> list[tuple[str, str, str]]:
    """(request, from, to) for every request whose status changed in this step."""
    before = statuses(prev) if prev else {}
    now = statuses(step)
    out = []
    for req, status in now.items():
        was = before.get(req, "ARRIVAL")
        if was != status:
            if was == "ARRIVAL" and status != "WAITING":
                out.append((req, "ARRIVAL", "WAITING"))
                was = "WAITING"
            if was == "PREEMPTED" and status == "WAITING":
                continue
            out.append((req, was, status))
    for req, was in before.items():
        if req not in now:
            out.append((req, was, FINISH_STATUS.get(finish_reasons.get(req, ""), "FINISHED_STOPPED")))
    return out


def _queue_html(reqs: list[dict], per_block: int | None) -> str:
    if not reqs:
        return "<span style='color:#4D4D4D'>empty</span>"
    return " ".join(chip(f"req {r['request_id']} · {r['num_computed_tokens']}/{r['num_tokens']} tok · "
                         f"{len(r['block_ids'])} blk", request_color(r["request_id"]),
                         title=f"num_computed_tokens / num_tokens; holds {blocks_mb(len(r['block_ids']), per_block)}"
                               f" {r['block_ids']}") +
                    chip(r["status"], STATUS_COLORS.get(r["status"], "#777"), title=NODE_TIPS.get(r["status"]))
                    for r in reqs)


def queues(step: dict, per_block: int | None = None) -> None:
    """The running and waiting queues; per_block (bytes of one KV block) adds MB to the block counts."""
    sched = step["scheduler"]
    held = sum(len(r["block_ids"]) for r in sched["running"])
    mem = f" · holding {blocks_mb(held, per_block)}" if held else ""
    st.markdown(f"**Running** ({len(sched['running'])}/{sched['max_num_seqs']} seqs{mem})<br>"
                f"{_queue_html(sched['running'], per_block)}", unsafe_allow_html=True)
    st.markdown(f"**Waiting** ({len(sched['waiting'])}, FCFS order)<br>{_queue_html(sched['waiting'], per_block)}",
                unsafe_allow_html=True)
    st.caption("Chip: `req id · num_computed_tokens/num_tokens tok · KV blocks held`"
               + (f" (one block = {mb(per_block)})" if per_block else "") + "; hover a chip for its block ids.")
    code_ref("vllm_anatomy/core/sched/scheduler.py", "Scheduler.snapshot · self.waiting / self.running")


def _wrap(status: str) -> str:
    return status.replace("FINISHED_", "FINISHED_\\n") if len(status) > 10 else status


def _ids(reqs: list[str]) -> str:
    return ", ".join(reqs[:4]) + (f" +{len(reqs) - 4}" if len(reqs) > 4 else "")


def state_machine_dot(moves: list[tuple[str, str, str]]) -> str:
    """The request state machine in DOT, this step's transitions lit (bold dark red, with the requests)."""
    lit: dict[tuple[str, str], list[str]] = {}
    for req, a, b in moves:
        lit.setdefault((a, b), []).append(req)
    lines = ["digraph G {", 'rankdir=LR; bgcolor="transparent"; nodesep=0.18; ranksep=0.3; margin=0;',
             f'node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=15 margin="0.08,0.04" '
             f'fontcolor="{INK}"];',
             f'edge [fontname="Helvetica" fontsize=14 color="#8A8A8A" fontcolor="{INK}" arrowsize=0.7];',
             'ARRIVAL [shape=point width=0.15 fillcolor="#555555" tooltip="arrival"];']
    active = {s for (_, s) in lit} | {a for (a, _) in lit}
    for n in NODES:
        pen = "3" if n in active else "1"
        fill = STATUS_COLORS[n]
        lines.append(f'{n} [label="{_wrap(n)}" fillcolor="{fill}" fontcolor="{text_on(fill)}" penwidth={pen} '
                     f'tooltip="{n}: {NODE_TIPS[n]}"];')
    for a, b, label, tip in EDGES:
        reqs = lit.get((a, b))
        if reqs:
            lines.append(f'{a} -> {b} [label="{label}\\nreq {_ids(reqs)}" color="{ACTIVE_EDGE}" penwidth=3 '
                         f'fontcolor="{ACTIVE_EDGE}" tooltip="{tip}" labeltooltip="{tip}"];')
        else:
            lines.append(f'{a} -> {b} [label="{label}" tooltip="{tip}" labeltooltip="{tip}"];')
    lines.append("}")
    return "\n".join(lines)


def state_machine(moves: list[tuple[str, str, str]]) -> None:
    lines = [state_machine_dot(moves)]
    st.graphviz_chart(lines[0], width="stretch")
    moved = ", ".join(f"req {r}: {a} → {b}" for r, a, b in moves) or "no status changed in this step"
    st.caption(f"This step: {moved}")
    code_ref("vllm_anatomy/core/request.py", "RequestStatus")
