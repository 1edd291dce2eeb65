"""Q2 — what GPUModelRunner._update_states did in one step, and why the batch persists.

_update_states (v0.27.1 vllm/v1/worker/gpu_model_runner.py) applies the step's
SchedulerOutput to the worker's mirror: finished requests leave (their
CachedRequestState is dropped, their InputBatch row freed), rows not scheduled
(preempted or skipped) leave the batch but keep their state, new requests get a
CachedRequestState and a row, cached requests get their num_computed_tokens
and appended block ids, and condense() moves tail rows into the holes.

Read from: SchedulerOutput (the step snapshot), the InputBatch rows of this step
and of the previous one (model_runner snapshots: rows, condense_moves), the
worker's CachedRequestStates and the scheduler's Requests of the same step.
"""
from __future__ import annotations

from dashboard.answers.common import Answer, ShowMe, cannot, ids
from dashboard.answers.source import RunSource
from dashboard.words import agree, n_of


def _rows(mr: dict) -> dict[int, dict]:
    return {r["index"]: r for r in (mr.get("input_batch") or {}).get("rows", [])}


def candidate_steps(src: RunSource) -> list[int]:
    """Steps after the first (each is diffed against the one before it)."""
    return list(src.steps[1:])


def default_step(src: RunSource) -> int | None:
    """A step that shows the most: rows removed and added and condense moves, else any two of them.
    Looks at the steps where a request finished, was preempted or arrived (from the step records),
    at most MAX_LOOK of them: the worker's snapshots are read only for those."""
    def busy(s):
        rec, prev = src.record(s), src.prev_step(s)
        return bool(rec.get("preempted_req_ids")) or any(e["kind"] != "decode" for e in rec.get("scheduled", [])) \
            or (prev is not None and len(src.record(prev).get("scheduled", [])) != len(rec.get("scheduled", [])))
    look = [s for s in src.steps[1:] if busy(s)][:MAX_LOOK] or src.steps[1:MAX_LOOK + 1]
    best: int | None = None
    best_score: tuple[int, ...] = (-1,)
    for s in look:
        mr, prev = src.mr(s), src.mr(src.prev_step(s))
        if mr.get("input_batch") is None or prev.get("input_batch") is None:
            continue
        before = {r["req_id"] for r in _rows(prev).values()}
        after = {r["req_id"] for r in _rows(mr).values()}
        moves = (mr.get("input_batch") or {}).get("condense_moves") or []
        so = src.scheduler_output(s)
        appended = sum(1 for x in so.get("scheduled_cached_reqs", {}).get("new_block_ids", []) if x)
        score = (bool(before - after) + bool(after - before) + bool(moves), bool(appended), -s)
        if score > best_score:
            best, best_score = s, score
    return best


MAX_LOOK = 60


def answer(src: RunSource, step: int | None = None) -> Answer:
    steps = candidate_steps(src)
    if step not in steps or src.mr(step).get("input_batch") is None:
        step = default_step(src)
    if step is None:
        return cannot("This run has no two consecutive steps with the worker's InputBatch recorded "
                      "(model_runner snapshots), so there is nothing to diff.")
    prev = src.prev_step(step)
    assert prev is not None, "step is a candidate_steps() one: never the first"
    snap = src.snap(step) or {}
    mr = src.mr(step)
    before, after = _rows(src.mr(prev)), _rows(mr)
    so = src.scheduler_output(step)
    d = _row_diff(before, after, so, mr)
    removed, added, appended, moves = d["removed"], d["added"], d["appended"], d["moves"]
    mirror = _mirror(snap, so, mr, after, d["a_req"])
    n_rows = len(after)
    summary = (f"In **step {step}**, `_update_states` turned the {n_of(len(before), 'row')} of step {prev} into {n_of(n_rows, 'row')} "
               f"by a diff: **{len(removed)} removed** {ids([r['request'] for r in removed])}, "
               f"**{len(added)} added** {ids([a['request'] for a in added])}, block ids appended to "
               f"{n_of(len(appended), 'request')}, `num_computed_tokens` written for {n_of(len(d['nct']), 'cached request')}, "
               f"**{n_of(len(moves), 'condense move')}** {ids([f'{a}→{b}' for a, b in moves])}. "
               f"{len(d['kept'])} of {n_of(n_rows, 'row')} {agree(len(d['kept']), 'was', 'were')} **kept as "
               f"{agree(len(d['kept']), 'it was', 'they were')}** (same row, same token ids and block table: only "
               f"{agree(len(d['kept']), 'its', 'their')} num_computed_tokens scalar written) — the InputBatch persists "
               "across steps; nothing is rebuilt.")
    notes = ["CachedRequestState is the worker's read-only mirror of the scheduler's Request: it is updated only "
             "from CachedRequestData, never written back. The step snapshot is taken after "
             + ("schedule() (async scheduling)" if src.async_scheduling else "update_from_output")
             + ", the worker's after sampling: the scheduler advanced num_computed_tokens by this step's tokens "
               "when it scheduled them (optimistically), the worker holds the value it was sent — so they agree "
               "as worker + scheduled = scheduler."]
    return Answer(
        ok=True, subject=f"step {step}", summary=summary, chain=_chain(d),
        tables={"rows removed": removed, "rows added": added, "block ids appended": appended,
                "condense moves": d["move_rows"], "CachedRequestState (worker) beside Request (scheduler)": mirror,
                "InputBatch rows before (step %d)" % prev: [{"row": i, "request": r["req_id"], "block_ids": ids(r["block_ids"])}
                                                         for i, r in sorted(before.items())],
                "InputBatch rows after (step %d)" % step: [{"row": i, "request": r["req_id"], "block_ids": ids(r["block_ids"])}
                                                        for i, r in sorted(after.items())]},
        notes=notes,
        show_me=[ShowMe(f"step {step}, Worker tab (InputBatch rows and condense moves)", "inspector", step, "worker")],
        facts={"step": step, "prev": prev, "removed": [r["request"] for r in removed],
               "added": [a["request"] for a in added], "moves": [list(m) for m in moves],
               "appended": {a["request"]: a["block ids appended"] for a in appended},
               "kept": sorted(d["kept"]), "rows_after": n_rows, "mirror_agrees": all(m["agree"] != "no" for m in mirror),
               "candidates": steps})


def _row_diff(before: dict[int, dict], after: dict[int, dict], so: dict, mr: dict) -> dict:
    """What _update_states did to the rows: removed, added, blocks appended, num_computed_tokens written,
    condense moves, and the rows kept as they were."""
    b_req = {r["req_id"]: i for i, r in before.items()}
    a_req = {r["req_id"]: i for i, r in after.items()}
    finished = [str(r) for r in so.get("finished_req_ids", [])]
    new_ids = [str(r["req_id"]) for r in so.get("scheduled_new_reqs", [])]
    cached = so.get("scheduled_cached_reqs", {})
    resumed = {str(r) for r in cached.get("resumed_req_ids", [])}
    moves = (mr.get("input_batch") or {}).get("condense_moves") or []
    removed = []
    for req, row in sorted(b_req.items(), key=lambda x: x[1]):
        if req not in a_req:
            why = ("finished (in finished_req_ids: its CachedRequestState is dropped too)" if req in finished
                   else "not scheduled this step (preempted or out of budget): the row goes, its "
                        "CachedRequestState stays")
            removed.append({"row": row, "request": req, "why": why})
    added = []
    for req, row in sorted(a_req.items(), key=lambda x: x[1]):
        if req not in b_req:
            why = ("new: NewRequestData → a new CachedRequestState and a row" if req in new_ids else
                   "resumed after preemption: its block ids replace the old ones" if req in resumed else
                   "back in the batch (its CachedRequestState was kept)")
            added.append({"row": row, "request": req, "why": why, "block_ids": ids(after[row]["block_ids"])})
    appended = []
    for i, req in enumerate(cached.get("req_ids", [])):
        nb = (cached.get("new_block_ids") or [None] * (i + 1))[i]
        if nb and str(req) not in resumed:
            appended.append({"request": str(req), "block ids appended": ids(nb[0]),
                             "row": a_req.get(str(req))})
    # num_computed_tokens: what the scheduler sent for each cached request.
    nct = [{"request": str(r), "num_computed_tokens": n, "row": a_req.get(str(r))}
           for r, n in zip(cached.get("req_ids", []), cached.get("num_computed_tokens", []))]
    move_rows = [{"from row": src_row, "to row": dst_row, "request": after.get(dst_row, {}).get("req_id")}
                 for src_row, dst_row in moves]
    # Rows that changed structurally vs rows kept: kept = same request at the same row, no block appended.
    touched = {a["request"] for a in added} | {m["request"] for m in move_rows} | {a["request"] for a in appended}
    kept = [req for req, row in a_req.items() if b_req.get(req) == row and req not in touched]
    return {"a_req": a_req, "finished": finished, "new_ids": new_ids, "moves": moves, "removed": removed,
            "added": added, "appended": appended, "nct": nct, "move_rows": move_rows, "kept": kept}


def _mirror(snap: dict, so: dict, mr: dict, after: dict[int, dict], a_req: dict) -> list[dict]:
    """The mirror: CachedRequestState (worker) beside Request (scheduler), same step (`so`: its SchedulerOutput)."""
    sched = snap.get("scheduler", {})
    reqs = {str(r["request_id"]): r for r in sched.get("running", []) + sched.get("waiting", [])}
    r2b = sched.get("kv_cache", {}).get("req_to_block_ids", {})
    n_sched = {str(k): v for k, v in so.get("num_scheduled_tokens", {}).items()}
    mirror = []
    for c in mr.get("cached_requests", []):
        rid = str(c["req_id"])
        r = reqs.get(rid)
        row = after.get(a_req[rid]) if rid in a_req else None
        if r is None:
            continue
        n = n_sched.get(rid, 0)
        blocks_w = row["block_ids"] if row else None
        blocks_s = r2b.get(rid, r.get("block_ids"))
        agree_nct = c["num_computed_tokens"] + n == r["num_computed_tokens"] or c["num_computed_tokens"] == r["num_computed_tokens"]
        mirror.append({"request": rid, "Request.num_computed_tokens (scheduler)": r["num_computed_tokens"],
                       "CachedRequestState.num_computed_tokens (worker)": c["num_computed_tokens"],
                       "scheduled this step": n,
                       "Request.num_tokens": r["num_tokens"], "CachedRequestState.num_tokens": c["num_tokens"],
                       "Request block ids": ids(blocks_s or []), "worker row's block ids": ids(blocks_w) if blocks_w is not None else "— (not in batch)",
                       "agree": ("stale by design: not in the batch this step (e.g. preempted); a resume "
                                 "sends its blocks and tokens again" if row is None and n == 0 else
                                 "yes" if agree_nct and (blocks_w is None or list(blocks_w) == list(blocks_s or []))
                                 else "no")})
    return mirror


def _chain(d: dict) -> list[dict]:
    """_update_states' steps 1-5 with this step's requests."""
    removed, finished = d["removed"], d["finished"]
    return [{"#": "1", "call": "finished_req_ids → requests.pop, remove_request", "what happened here":
             ids([r["request"] for r in removed if r["request"] in finished]) or "none"},
            {"#": "2", "call": "rows not scheduled → remove_request (state kept)", "what happened here":
             ids([r["request"] for r in removed if r["request"] not in finished]) or "none"},
            {"#": "3", "call": "scheduled_new_reqs → CachedRequestState, add_request", "what happened here":
             ids(d["new_ids"]) or "none"},
            {"#": "4", "call": "scheduled_cached_reqs → num_computed_tokens, block_ids.extend", "what happened here":
             f"{len(d['nct'])} updated, blocks appended to {ids([a['request'] for a in d['appended']])}"},
            {"#": "5", "call": "InputBatch.condense()", "what happened here":
             ", ".join(f"row {a} → {b}" for a, b in d["moves"]) or "no hole left: no move"}]
