"""Q4 — a request finishes: what the Scheduler and KVCacheManager.free did, and whether
its blocks could be used at once.

Scheduler.update_from_output (v0.27.1) sees the stop condition (EOS, stop token,
max_tokens, max_model_len), takes the request out of `running`, adds its id to
`finished_req_ids` (sent to the workers with the next SchedulerOutput, so they drop
its CachedRequestState and row) and returns its output with a finish reason; it
then calls KVCacheManager.free → BlockPool.free_blocks with the request's blocks
in reverse order: each ref_cnt drops by one, a block reaching 0 joins the free
queue (hashed: at the tail, still a prefix-cache entry; unhashed: at the front, to
be reused first), a block another request still holds (a shared prefix) is not
freed. Those blocks are then taken by a later prefix hit (the same content) or a
fresh allocation (which pops the queue's head and evicts the hash).

Read from: the queues of every step (when the request left them), the "free"
event of that step (stamped with request and call in newer runs; else matched
against the request's blocks), the pool of the steps before and after (ref_cnt,
hash, free-queue order), SchedulerOutput.finished_req_ids of the next step, the
request's llm_request span (finish reason), and every later event on the blocks.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from dashboard.answers.common import NOT_RECORDED, Answer, ShowMe, cannot, ids
from dashboard.answers.source import PoolReplay, RunSource


def finishes(src: RunSource) -> list[tuple[int, str]]:
    """(step, request) for every request that finished in the recorded steps: update_from_output of
    that step finished it (as dashboard/lessons.py reads it, through left_queues)."""
    unseen = {req for req in src.requests if req not in src.statuses}
    return left_queues(src.steps, src.statuses, last_scheduled(((s, src.record(s)) for s in src.steps), unseen))


def left_queues(steps: Sequence[int], statuses: Mapping[str, Mapping[int, str]],
                never_queued: Mapping[str, int]) -> list[tuple[int, str]]:
    """(step, request), in step order: a request the queues showed finished in the step after the last
    that showed it; one they never showed (never_queued: request -> the last step that scheduled it)
    in that step.

    NOTE: the queues are read after each step's update_from_output, so a request that finishes in
    the step that first schedules it (one output token, sampled by its prefill, without async
    scheduling) is in no step's queues: only the scheduled records say where it ran."""
    nxt = dict(zip(steps, steps[1:]))
    out = [(nxt[max(seen)], req) for req, seen in statuses.items() if seen and max(seen) in nxt]
    out += [(step, req) for req, step in never_queued.items() if req not in statuses]
    return sorted(out)


def last_scheduled(records: Iterable[tuple[int, dict]], reqs: set[str]) -> dict[str, int]:
    """request -> the last step whose scheduled records list it, for the requests in `reqs` (none
    asked: no record is read)."""
    out: dict[str, int] = {}
    if not reqs:
        return out
    for step, record in records:
        for e in record.get("scheduled", []):
            if (req := str(e["request_id"])) in reqs:
                out[req] = max(step, out.get(req, step))
    return out


def _free_event(src: RunSource, step: int, req: str, held: list[int]) -> tuple[int, dict] | None:
    """(step, event) of KVCacheManager.free for this request: in its finish step, or (async scheduling:
    events are drained with the next step's snapshot) the step after."""
    for s in (step, src.next_step(step)):
        if s is None:
            continue
        for e in src.events(s):
            if e["kind"] != "free":
                continue
            if "call" in e:
                if e.get("request_id") == req and e.get("call") == "free":
                    return s, e
            elif held and set(held) <= set(e["block_ids"]) and e["block_ids"][-1] == held[0]:
                return s, e
    return None


def _reason(src: RunSource, req: str) -> str | None:
    span = src.requests.get(req)
    if span is None:
        return None
    r = span.attributes.get("gen_ai.response.finish_reasons")
    return r[0] if isinstance(r, list) and r else r


def default_pick(src: RunSource, done: list[tuple[int, str]]) -> tuple[int, str]:
    """A request that finished on its own (stop / length), best one with a shared block and a later reuse
    (`done` is not empty: answer() says so before it picks)."""
    def score(d):
        a = _facts(src, *d)
        return (_reason(src, d[1]) in ("stop", "length"), bool(a and a["shared"]), bool(a and a["reused"]), -d[0])
    # (a big run finishes hundreds: the first MAX_LOOK are enough to find a telling one)
    return max(done[:MAX_LOOK], key=score)


MAX_LOOK = 40


def _facts(src: RunSource, step: int, req: str) -> dict | None:
    prev = src.prev_step(step)
    held = src.blocks_of(prev, req) if prev is not None else []
    found = _free_event(src, step, req, held)
    if found is None:
        return None
    fstep, ev = found
    # ref_cnt before / after and the end each block joined: recorded, else replayed from the pool before.
    replay = src.pool_replay(fstep) or PoolReplay({}, src.enable_caching)
    did = {}
    for e in src.events(fstep):
        d = replay.apply(e)
        if e is ev:
            did = d
            break
    after = ev.get("ref_cnts") or did.get("ref_after") or []
    before = [a + 1 for a in after] if ev.get("ref_cnts") is not None else did.get("ref_before", [])
    ends = ev.get("queue_ends")
    if ends is None:
        ends = did.get("ends", [])
    hashes = did.get("hashes") or [None] * len(ev["block_ids"])
    kv = src.kv(fstep)
    fq = kv.get("free_queue", [])
    owners = {b["block_id"]: b.get("owners", []) for b in kv.get("blocks", [])}
    # NOTE: a freed block without a hash was never cached: prefix caching is off, or it was not full
    # (KVCacheManager.cache_blocks hashes only blocks full of computed tokens; with caching on, such a
    # block joins the free queue's front, as the "free queue" column beside it says).
    no_hash = (NOT_RECORDED if "hashes" not in did else "none (prefix caching off)" if not src.enable_caching
               else "none (not full: only full blocks are hashed)")
    rows = []
    for i, b in enumerate(ev["block_ids"]):
        end = ends[i] if i < len(ends) else None
        rows.append({"block": b, "ref_cnt before → after": f"{before[i] if i < len(before) else '?'} → "
                                                             f"{after[i] if i < len(after) else '?'}",
                     "hash": hashes[i] or no_hash,
                     "free queue": (f"{end} (position {fq.index(b)} of {len(fq)} after step {fstep})" if end and b in fq
                                    else end or "not freed: still held by " + (", ".join(map(str, owners.get(b, []))) or "another request")),
                     "hash kept": ("yes" if end else "yes (still held)") if hashes[i]
                     else NOT_RECORDED if no_hash == NOT_RECORDED else "no hash to keep"})
    freed = [r["block"] for r, e in zip(rows, ends) if e]
    shared = [r["block"] for r, e in zip(rows, ends) if not e]
    # Later: the first hit / allocate touching each freed block.
    # NOTE: from the free event on, in fstep itself too: with async scheduling the free (the previous
    # step's update_from_output) is drained into the events of a step whose schedule() then allocates,
    # so a freed block can be handed out again in the very step that lists its free.
    reused = {}
    for s in src.steps:
        if s < fstep:
            continue
        evs = src.events(s)
        if s == fstep:
            at = next((i for i, e in enumerate(evs) if e is ev or e == ev), len(evs))
            evs = evs[at + 1:]
        for e in evs:
            if e["kind"] in ("hit", "allocate"):
                for b in e["block_ids"]:
                    if b in freed and b not in reused:
                        reused[b] = {"step": s, "how": "prefix hit (BlockPool.touch): same content, reused as is"
                                     if e["kind"] == "hit" else "fresh allocation (get_new_blocks)"
                                     + (": its hash evicted" if any(x["kind"] == "evict" and b in x["block_ids"]
                                                                   for x in src.events(s)) else ""),
                                     "by": e.get("request_id") or _who(src, s, b)}
        if len(reused) == len(freed):
            break
    return {"fstep": fstep, "event": ev, "rows": rows, "freed": freed, "shared": shared, "reused": reused,
            "held": held, "replay_ok": replay.ok, "replay_problem": replay.problem}


def _who(src: RunSource, step: int, block: int) -> str:
    for s in src.record(step).get("scheduled", []):
        if block in (s.get("new_block_ids") or []):
            return str(s["request_id"])
    for h in src.record(step).get("prefix_hits", []):
        if block in h.get("hit_block_ids", []):
            return str(h["request_id"])
    return "?"


def answer(src: RunSource, step: int | None = None, req: str | None = None) -> Answer:
    done = finishes(src)
    if not done:
        return cannot("No request finished in this run's recorded steps (each one was still queued or "
                      "running at its last step), so there is no finish to show.")
    if step is None or req is None or (step, str(req)) not in done:
        step, req = default_pick(src, done)
    req = str(req)
    f = _facts(src, step, req)
    if f is None:
        return cannot(f"Request {req} left the queues at step {step}, but no free event of its blocks was "
                      "recorded (block-pool events are kept at trace level full only).")
    nxt = src.next_step(step)
    # NOTE: the first schedule() after the finish lists it in finished_req_ids. Without async scheduling
    # that is the next step's (the finish happened in this step's update_from_output, after its
    # schedule()); with it, this step's own: step N's update_from_output (of step N-1's tokens) runs after
    # step N's snapshot, so the request is first missing from step N+1's queues, whose schedule() says so.
    told_step = next((s for s in (step, nxt) if s is not None and req in
                      [str(x) for x in src.scheduler_output(s).get("finished_req_ids", [])]),
                     None)
    told = told_step is not None
    reason = _reason(src, req)
    fstep = f["fstep"]
    reuse_rows = [{"block": b, "step": r["step"], "by request": r["by"], "how": r["how"]}
                  for b, r in sorted(f["reused"].items(), key=lambda x: x[1]["step"])]
    first_reuse = min((r["step"] for r in f["reused"].values()), default=None)
    summary = (f"Request **{req}** finished in **step {step}** ({reason or 'reason not recorded'}): "
               f"`Scheduler.update_from_output` took it out of `running` and returned its last output; "
               + (f"step {told_step}'s `SchedulerOutput.finished_req_ids` told the worker. " if told else "")
               + f"`KVCacheManager.free` handed `BlockPool.free_blocks` its blocks in reverse order "
               f"{ids(f['event']['block_ids'])}: "
               + (f"**{ids(f['freed'])}** reached ref_cnt 0 and joined the free queue" if f["freed"] else "none reached 0")
               + (f"; **{ids(f['shared'])}** stayed held (shared with another request)" if f["shared"] else "")
               + ". "
               + (f"They could be used at once — and were: first in **step {first_reuse}** ({reuse_rows[0]['how']})."
                  if first_reuse is not None else "None of them was reused before the run ended."))
    return Answer(
        ok=True, subject=f"request {req}, finished at step {step}", summary=summary,
        chain=[{"#": "1", "call": "Scheduler.update_from_output", "what happened here":
                f"stop check → {reason or '?'}; request {req} out of running; its output returned"},
               {"#": "2", "call": "Scheduler._free_request → KVCacheManager.free", "what happened here":
                f"blocks {ids(f['held'] or list(reversed(f['event']['block_ids'])))} handed back, tail first"},
               {"#": "3", "call": "BlockPool.free_blocks", "what happened here":
                f"ref_cnt −1 each; {ids(f['freed'])} to the free queue, {ids(f['shared']) if f['shared'] else 'none'} kept"},
               {"#": "4", "call": "SchedulerOutput.finished_req_ids (the next schedule())", "what happened here":
                (f"step {told_step}: the worker drops its CachedRequestState and row" if told else
                 "not seen in a recorded step")}],
        tables={"KVCacheManager.free, block by block": f["rows"], "later use of the freed blocks": reuse_rows},
        notes=_notes(src, f, step, req), show_me=_show_me(step, req, first_reuse, reuse_rows),
        facts={"step": step, "request": req, "free_step": fstep, "freed_order": list(f["event"]["block_ids"]),
               "freed": f["freed"], "shared": f["shared"], "reused": {b: r["step"] for b, r in f["reused"].items()},
               "told_next_step": told, "told_step": told_step, "finishes": done})


def _notes(src: RunSource, f: dict, step: int, req: str) -> list[str]:
    notes = []
    if "call" not in f["event"]:
        notes.append("This run's free event does not carry ref_cnt and queue ends (recorded before that was added): "
                     "they are replayed from the previous step's pool.")
    if not f["replay_ok"]:
        notes.append(f"The replay disagrees with the run ({f['replay_problem']}).")
    if src.async_scheduling:
        last = max((s for s in src.steps if s < step and any(str(x["request_id"]) == req for x in
                                                             src.record(s).get("scheduled", []))), default=None)
        after = src.next_step(last) if last is not None else None
        if last is not None and after is not None:
            notes.append(f"Async scheduling: request {req}'s last token came from step {last}; step {last}'s "
                         f"update_from_output, which saw it finish and freed its blocks, ran after step {after}'s "
                         f"schedule() (step N+1 is scheduled before step N's output is processed, and each snapshot is "
                         f"taken right after schedule()): so it leaves the queues in step {step}'s snapshot, and its "
                         f"free is listed with step {f['fstep']}'s events.")
    return notes


def _show_me(step: int, req: str, first_reuse: int | None, reuse_rows: list[dict]) -> list[ShowMe]:
    show = [ShowMe(f"step {step}, KV cache tab, request {req} (its F events and the free queue)", "inspector",
                   step, "kv", req)]
    if first_reuse is not None:
        by = reuse_rows[0]["by request"]
        show.append(ShowMe(f"step {first_reuse}, KV cache tab: block {reuse_rows[0]['block']} reused"
                           + (f" by request {by}" if by and by != "?" else ""), "inspector", first_reuse, "kv",
                           by if by and by != "?" else None))
    return show
