"""Waiting and running queues with status colours, and the request state machine
with this step's transitions lit (statuses of the previous step vs this one)."""
from __future__ import annotations

import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.theme import STATUS_COLORS, chip, request_color

FINISH_STATUS = {"stop": "FINISHED_STOPPED", "length": "FINISHED_LENGTH_CAPPED", "abort": "FINISHED_ABORTED",
                 "error": "FINISHED_ERROR", "repetition": "FINISHED_REPETITION"}
NODES = ["WAITING", "RUNNING", "PREEMPTED", "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED"]
EDGES = [("ARRIVAL", "WAITING", "request arrives"), ("WAITING", "RUNNING", "scheduled, KV blocks allocated"),
         ("RUNNING", "PREEMPTED", "out of KV blocks"), ("PREEMPTED", "RUNNING", "rescheduled (recompute)"),
         ("RUNNING", "FINISHED_STOPPED", "stop token"), ("RUNNING", "FINISHED_LENGTH_CAPPED", "max_tokens"),
         ("RUNNING", "FINISHED_ABORTED", "aborted"), ("WAITING", "FINISHED_ABORTED", "aborted")]


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


def _queue_html(reqs: list[dict]) -> str:
    if not reqs:
        return "<span style='color:#999'>empty</span>"
    return " ".join(chip(f"req {r['request_id']} · {r['num_computed_tokens']}/{r['num_tokens']} tok · "
                         f"{len(r['block_ids'])} blk", request_color(r["request_id"])) +
                    chip(r["status"], STATUS_COLORS.get(r["status"], "#777"), "black") for r in reqs)


def queues(step: dict) -> None:
    sched = step["scheduler"]
    st.markdown(f"**Running** ({len(sched['running'])}/{sched['max_num_seqs']} seqs)<br>"
                f"{_queue_html(sched['running'])}", unsafe_allow_html=True)
    st.markdown(f"**Waiting** ({len(sched['waiting'])}, FCFS order)<br>{_queue_html(sched['waiting'])}",
                unsafe_allow_html=True)
    code_ref("vllm_anatomy/core/sched/scheduler.py", "Scheduler.snapshot · self.waiting / self.running")


def state_machine(moves: list[tuple[str, str, str]]) -> None:
    lit: dict[tuple[str, str], list[str]] = {}
    for req, a, b in moves:
        lit.setdefault((a, b), []).append(req)
    lines = ["digraph G {", 'rankdir=LR; bgcolor="transparent"; node [shape=box style="rounded,filled" '
             'fontname="Helvetica" fontsize=11]; edge [fontname="Helvetica" fontsize=9 color="#BBBBBB"];',
             'ARRIVAL [shape=point width=0.15 fillcolor="#555555"];']
    active = {s for (_, s) in lit} | {a for (a, _) in lit}
    for n in NODES:
        pen = "3" if n in active else "1"
        lines.append(f'{n} [fillcolor="{STATUS_COLORS[n]}" penwidth={pen}];')
    for a, b, label in EDGES:
        reqs = lit.get((a, b))
        if reqs:
            lines.append(f'{a} -> {b} [label="{label}\\nreq {", ".join(reqs)}" color="#D1495B" penwidth=3 '
                         f'fontcolor="#D1495B"];')
        else:
            lines.append(f'{a} -> {b} [label="{label}" fontcolor="#AAAAAA"];')
    lines.append("}")
    st.graphviz_chart("\n".join(lines), width="stretch")
    moved = ", ".join(f"req {r}: {a} → {b}" for r, a, b in moves) or "no status changed in this step"
    st.caption(f"This step: {moved}")
    code_ref("vllm_anatomy/core/request.py", "RequestStatus")
