"""Waiting and running queues with status colours, and the request state machine
with this step's transitions lit (statuses of the previous step vs this one).

The state machine is drawn small enough to keep its text at 12 px or more in a
column of the page (short edge labels, long names wrapped; the full wording is in
each node's and edge's tooltip), dark text on light fills."""
from __future__ import annotations

import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.components.kv_memory import blocks_mb, mb
from dashboard.theme import INK, STATUS_COLORS, chip, request_color, short_req_id, text_on
from vllm_anatomy.core.request import RequestStatus
from vllm_anatomy.core.sched.record import DeferReason
from vllm_anatomy.core.state_machine import (ARRIVAL, FINISH_REASONS, STATUS_DESCRIPTIONS, STATUS_TRANSITIONS,
                                             UNUSED_STATUSES, article_edges, finished_status_of)

NODES = [s.name for s in RequestStatus]
# Columns of the diagram, left to right (Graphviz ranks).
S = RequestStatus
RANKS = [[S.WAITING.name, S.WAITING_FOR_REMOTE_KVS.name, S.WAITING_FOR_STREAMING_REQ.name],
         [S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name, S.RUNNING.name, S.PREEMPTED.name],
         [s.name for s in S if S.is_finished(s)]]
ACTIVE_EDGE = "#B0303F"     # dark red: 6:1 on white


def statuses(step: dict) -> dict[str, str]:
    sched = step["scheduler"]
    return {r["request_id"]: r["status"]
            for r in sched["waiting"] + sched.get("skipped_waiting", []) + sched["running"]}


def transitions(prev: dict | None, step: dict, finish_reasons: dict[str, str]) -> list[tuple[str, str, str]]:
    """(request, from, to) for every request whose status changed in this step (or that
    ran on: RUNNING → RUNNING), as the code moves it."""
    before = statuses(prev) if prev else {}
    now = statuses(step)
    ran = {x["request_id"] for x in step["scheduler"]["step_record"]["scheduled"]}
    out = []
    for req, status in now.items():
        was = before.get(req, ARRIVAL)
        if was != status or (status == "RUNNING" and req in ran):
            out.append((req, was, status))
    for req, was in before.items():
        if req not in now:
            reason = finish_reasons.get(req, "")
            out.append((req, was, finished_status_of(reason) if reason in FINISH_REASONS.values()
                        else S.FINISHED_STOPPED.name))
    return out


def _tokens(r: dict) -> str:
    """num_computed_tokens/num_tokens, and "+N" for N output placeholders: with async scheduling a
    request is scheduled for its next token before the previous one is sampled, so N tokens are in
    flight and its computed positions run ahead of the tokens it has (36/35+2: two in flight; the
    second's position, 36, is fed once the first is sampled)."""
    extra = int(r.get("num_output_placeholders") or 0)
    return f"{r['num_computed_tokens']}/{r['num_tokens']}" + (f"+{extra}" if extra else "")


def _queue_html(reqs: list[dict], per_block: int | None) -> str:
    if not reqs:
        return "<span style='color:#4D4D4D'>empty</span>"
    return " ".join(chip(f"req {short_req_id(r['request_id'])} · {_tokens(r)} tok · "
                         f"{len(r['block_ids'])} blk", request_color(r["request_id"]),
                         title=f"request {r['request_id']}: num_computed_tokens / num_tokens"
                               + (" + output placeholders (tokens scheduled, not sampled yet)"
                                  if r.get("num_output_placeholders") else "") + "; holds "
                               f"{blocks_mb(len(r['block_ids']), per_block)} {r['block_ids']}") +
                    chip(r["status"], STATUS_COLORS.get(r["status"], "#777"), title=STATUS_DESCRIPTIONS.get(r["status"]))
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
    skipped = sched.get("skipped_waiting") or []
    if skipped:
        st.markdown(f"**Skipped waiting** ({len(skipped)}: passed over by an earlier step, looked at first)<br>"
                    f"{_queue_html(skipped, per_block)}", unsafe_allow_html=True,
                    help="v0.27.1's second waiting queue: " + "; or ".join(d.description for d in DeferReason))
    deferred = (sched.get("step_record") or {}).get("deferred_reasons") or {}
    if deferred:
        st.caption("Passed over this step: " + "; ".join(
            f"req {short_req_id(r)}: {DeferReason(c).description if c in DeferReason._value2member_map_ else c}"
            for r, c in deferred.items()))
    placeholders = any(r.get("num_output_placeholders") for r in sched["running"] + sched["waiting"] + skipped)
    st.caption("Chip: `req id · num_computed_tokens/num_tokens tok · KV blocks held`"
               + (f" (one block = {mb(per_block)})" if per_block else "") + "; hover a chip for its block ids."
               + (" `+N`: output placeholders, N tokens scheduled but not sampled yet (async scheduling schedules "
                  "a request's next token before its last one is sampled), which is why num_computed_tokens can run "
                  "ahead of num_tokens." if placeholders else ""))
    code_ref("vllm_anatomy/core/sched/scheduler.py", "Scheduler.snapshot · self.waiting / self.running")


def _wrap(status: str) -> str:
    """Long names on two or three lines: after FINISHED_ / WAITING_FOR_, then at the
    underscore nearest the middle of what is left (DOT's line break is a literal \\n)."""
    for head in ("FINISHED_", "WAITING_FOR_"):
        if status.startswith(head):
            rest = status[len(head):]
            if len(rest) > 12 and "_" in rest:
                cut = min((i for i, c in enumerate(rest) if c == "_"), key=lambda i: abs(i - len(rest) / 2))
                rest = rest[:cut + 1] + "\\n" + rest[cut + 1:]
            return head + "\\n" + rest
    return status


def _ids(reqs: list[str]) -> str:
    """At most two ids, one a line (DOT's \\n): a lit edge's label stays narrow, so the diagram is not
    scaled down to fit its column (its text stays at 12 px or more)."""
    return "\\n".join(short_req_id(r) for r in reqs[:2]) + (f" +{len(reqs) - 2}" if len(reqs) > 2 else "")


# NOTE: a request that arrives and is scheduled in the same step is never WAITING in a snapshot,
# but schedule() took it from the waiting queue: the diagram lights both edges it passed.
SAME_STEP = {(ARRIVAL, "RUNNING"): (ARRIVAL, "WAITING", "RUNNING")}


def _edges(move: tuple[str, str]) -> list[tuple[str, str]]:
    path = SAME_STEP.get(move)
    return list(zip(path, path[1:])) if path else article_edges(move)


def move_text(a: str, b: str) -> str:
    """A move in words, through the statuses the diagram lights: "arrived → WAITING → RUNNING"."""
    path = SAME_STEP.get((a, b)) or (a, b)
    return " → ".join("arrived" if s == ARRIVAL else s for s in path)


def state_machine_dot(moves: list[tuple[str, str, str]]) -> str:
    """All twelve RequestStatus values and the transitions of vllm_anatomy.core.state_machine
    in DOT: the article's edges solid, this engine's extra ones dashed, what it never
    does greyed; this step's moves lit (bold dark red, with the requests), each on the
    edges the article draws for it."""
    lit: dict[tuple[str, str], list[str]] = {}
    for req, a, b in moves:
        for edge in _edges((a, b)):
            lit.setdefault(edge, []).append(req)
    lines = ["digraph G {", 'rankdir=LR; bgcolor="transparent"; nodesep=0.12; ranksep=0.55; margin=0;',
             f'node [shape=box style="rounded,filled" fontname="Helvetica" fontsize=15 margin="0.08,0.04" '
             f'fontcolor="{INK}"];',
             f'edge [fontname="Helvetica" fontsize=13 color="#8A8A8A" fontcolor="{INK}" arrowsize=0.7];',
             f'{ARRIVAL} [shape=point width=0.15 fillcolor="#555555" tooltip="a request arrives"];']
    active = {n for edge in lit for n in edge}
    for rank in RANKS:
        lines.append("{rank=same; " + "; ".join(rank) + "}")
    for n in NODES:
        unused = n in UNUSED_STATUSES
        fill = "#F2F2F2" if unused else STATUS_COLORS.get(n, "#DDDDDD")
        style = '"rounded,filled,dashed"' if unused else '"rounded,filled"'
        pen = "3" if n in active else "1"
        lines.append(f'{n} [label="{_wrap(n)}" fillcolor="{fill}" fontcolor="{text_on(fill)}" style={style} '
                     f'color="{"#9A9A9A" if unused else "#333333"}" penwidth={pen} tooltip="{n}: {STATUS_DESCRIPTIONS.get(n, "")}"];')
    for t in STATUS_TRANSITIONS:
        tip = t.how.replace('"', "'")
        reqs = lit.get((t.source, t.target))
        if reqs:
            who = f"{len(reqs)} requests" if t.source == t.target and len(reqs) > 1 else f"req {_ids(reqs)}"
            lines.append(f'{t.source} -> {t.target} [label="{t.label}\\n{who}" color="{ACTIVE_EDGE}" '
                         f'penwidth=3 fontcolor="{ACTIVE_EDGE}" tooltip="{tip}" labeltooltip="{tip}"];')
            continue
        style = "solid" if t.in_article else "dashed"
        color = "#8A8A8A" if t.used else "#C4C4C4"
        lines.append(f'{t.source} -> {t.target} [label="{t.label}" style={style} color="{color}" '
                     f'tooltip="{tip}" labeltooltip="{tip}"];')
    lines.append("}")
    return "\n".join(lines)


def state_machine(moves: list[tuple[str, str, str]]) -> None:
    st.graphviz_chart(state_machine_dot(moves), width="stretch")
    moved = ", ".join(f"req {short_req_id(r)}: {move_text(a, b)}" for r, a, b in moves if (a, b) != ("RUNNING", "RUNNING")) \
        or "no status changed in this step"
    st.caption(f"This step: {moved}. Solid edges are the article's diagram (§四.1), dashed ones what this engine "
               "also does, grey dashed boxes the statuses it never enters (hover for why). NOTE: as in vLLM's "
               "code, a preempted request keeps the status PREEMPTED while it sits in the waiting queue and "
               "becomes RUNNING when rescheduled: the article's PREEMPTED → WAITING edge is that wait.")
    code_ref("vllm_anatomy/core/state_machine.py", "STATUS_TRANSITIONS (the engine's own definitions)")
