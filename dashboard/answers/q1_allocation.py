"""Q1 — from Scheduler.schedule() to a KV block allocated, with one allocation's values.

The chain (v0.27.1): Scheduler.schedule → KVCacheManager.get_computed_blocks (the
prefix-cache lookup, admission only) → KVCacheManager.allocate_slots (how many new
blocks: ⌈tokens that need a slot / block_size⌉ minus the blocks held) →
BlockPool.touch (the hit blocks leave the free queue) → BlockPool.get_new_blocks
(pops the free queue's head; a popped block that still had a hash is evicted first)
→ the request's block list (SingleTypeKVCacheManager.req_to_blocks) →
SchedulerOutput (NewRequestData.block_ids for a new request, CachedRequestData.new_block_ids
for a running or resumed one).

Read from: the step record (scheduled entries with their new block ids, prefix
hits), the block-pool events (stamped with request and call in runs that record
it; else matched by block ids), the previous step's free queue (replayed through
the events: dashboard/answers/source.PoolReplay), the KVCacheManager.* spans, and
SchedulerOutput.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dashboard.answers.common import NOT_RECORDED, Answer, ShowMe, cannot, ids
from dashboard.answers.source import EVENT_METHOD, RunSource
from dashboard.words import n_of


def allocations(src: RunSource) -> list[tuple[int, str]]:
    """(step, request) of every allocate_slots call that got new blocks from the pool."""
    out = []
    for step in src.steps:
        for s in src.record(step).get("scheduled", []):
            hit = _hit(src, step, s["request_id"])
            if [b for b in s.get("new_block_ids") or [] if b not in hit["hit_block_ids"]]:
                out.append((step, str(s["request_id"])))
    return out


def default_pick(src: RunSource, allocs: list[tuple[int, str]]) -> tuple[int, str]:
    """An allocation that shows the most: a prefix hit and an eviction, else either, else the first
    (`allocs` is not empty: answer() says so before it picks)."""
    def score(a):
        step, req = a
        evs = _my_events(src, step, req)
        return (bool(_hit(src, step, req)["hit_block_ids"]) and any(e["kind"] == "evict" for e in evs),
                any(e["kind"] == "evict" for e in evs), bool(_hit(src, step, req)["hit_block_ids"]), -step)
    return max(allocs, key=score)


def _hit(src: RunSource, step: int, req: str) -> dict:
    for h in src.record(step).get("prefix_hits", []):
        if str(h["request_id"]) == str(req):
            return h
    return {"num_hit_tokens": 0, "hit_block_ids": [], "num_query_tokens": None}


def _entry(src: RunSource, step: int, req: str) -> dict | None:
    return next((s for s in src.record(step).get("scheduled", []) if str(s["request_id"]) == str(req)), None)


def _my_events(src: RunSource, step: int, req: str) -> list[dict]:
    """The block-pool events of this request's allocate_slots call in this step."""
    evs = src.events(step)
    if evs and "call" in evs[0]:
        return [e for e in evs if e.get("request_id") == str(req) and e.get("call") == "allocate_slots"]
    # Older runs: match by block ids (hits = its hit blocks, allocate = its new blocks, evict/cache ⊂ them).
    ent = _entry(src, step, req) or {}
    hit = _hit(src, step, req)["hit_block_ids"]
    new = [b for b in ent.get("new_block_ids") or [] if b not in hit]
    mine = set(new) | set(hit)
    out = []
    for e in evs:
        if e["kind"] == "allocate" and e["block_ids"] == new:
            out.append(e)
        elif e["kind"] == "hit" and hit and e["block_ids"] == hit and not any(x["kind"] == "hit" for x in out):
            out.append(e)
        elif e["kind"] in ("evict",) and set(e["block_ids"]) <= set(new):
            out.append(e)
        elif e["kind"] == "cache" and set(e["block_ids"]) <= mine and out:
            out.append(e)
    return out


def answer(src: RunSource, step: int | None = None, req: str | None = None) -> Answer:
    allocs = allocations(src)
    if not allocs:
        return cannot("No step of this run allocated a KV block (no allocate event with new blocks).")
    if step is None or req is None or (step, str(req)) not in allocs:
        step, req = default_pick(src, allocs)
    req = str(req)
    a = _allocation(src, step, req)
    q = _free_queue_at_allocation(src, step, req)
    evicted, popped = q["evicted"], q["popped"]
    ev_rows = [{"event": e["kind"], "BlockPool method": EVENT_METHOD.get(e["kind"], ""), "blocks": ids(e["block_ids"]),
                "hashes": ", ".join(x for x in (e.get("block_hashes") or []) if x) or _no_hashes(e["kind"]),
                "request": e.get("request_id") or NOT_RECORDED, "call": e.get("call") or NOT_RECORDED}
               for e in q["events"]]
    notes = [HASHES_NOTE] if any(not e.get("block_hashes") for e in q["events"]) else []
    if not src.attributed:
        notes.append("This run's block-pool events do not name their request and call (recorded before that was "
                     "added): this request's events were matched by block ids.")
    replay = q["replay"]
    if replay is not None and not replay.ok:
        notes.append(f"The free-queue replay does not agree with the run ({replay.problem}): the popped blocks shown "
                     "are the allocated ones.")
    new_req, cached, ci, hit_ids, new_blocks = a.new_req, a.cached, a.ci, a.hit_ids, a.new_blocks
    ok_so = (new_req is not None and new_req["block_ids"][0] == hit_ids + new_blocks) or \
            (ci is not None and (cached["new_block_ids"][ci] or [[]])[0] == (hit_ids + new_blocks if a.resumed else new_blocks))
    return Answer(
        ok=True, subject=f"request {req} at step {step}", summary=_summary(step, req, a, q),
        chain=_chain(src, step, req, a, q),
        tables={"block-pool events of this step, in order": ev_rows}, notes=notes,
        show_me=[ShowMe(f"step {step}, KV cache tab, request {req}", "inspector", step, "kv", req),
                 ShowMe(f"step {step}, Scheduler tab (budget and SchedulerOutput)", "inspector", step, "scheduler", req)],
        facts={"step": step, "request": req, "hit_block_ids": hit_ids, "new_block_ids": new_blocks,
               "popped": popped if popped is not None else new_blocks, "evicted": [b for b, _ in evicted],
               "table": a.table, "need_blocks": a.need_blocks, "scheduler_output_agrees": bool(ok_so),
               "allocations": allocs})


@dataclass
class _Allocation:
    """One allocate_slots call's numbers: what it was asked for, what it found, what it took."""
    ent: dict                   # the request's scheduled entry in the step record
    hit: dict                   # its prefix hit (get_computed_blocks)
    hit_ids: list[int]
    new_req: dict | None        # its NewRequestData in SchedulerOutput, if admitted new
    cached: dict                # SchedulerOutput.scheduled_cached_reqs
    ci: int | None              # its index there, if running or resumed
    resumed: bool
    admitted: bool
    new_blocks: list[int]
    held_before: list[int]
    computed_before: int
    need_tokens: int
    need_blocks: int
    table: list[int]            # its block list afterwards


def _no_hashes(kind: str) -> str:
    """The hashes cell of an event without them: only "cache" and "evict" events carry block hashes
    (BlockPoolEvent.block_hashes, HASHES_NOTE); an "allocate", "hit" or "free" event names its blocks alone."""
    if kind in ("cache", "evict"):
        return NOT_RECORDED
    return f"not in {'an' if kind[:1] in 'aeiou' else 'a'} {kind} event"


HASHES_NOTE = ("Block hashes travel in cache and evict events only (BlockPoolEvent.block_hashes): an allocate, "
               "hit or free event names its blocks alone.")


def _allocation(src: RunSource, step: int, req: str) -> _Allocation:
    bs = src.block_size
    ent = _entry(src, step, req)
    assert ent is not None, "answer() picks (step, req) from allocations(): the step scheduled it"
    hit = _hit(src, step, req)
    hit_ids = list(hit["hit_block_ids"])
    so = src.scheduler_output(step)
    new_req = next((r for r in so.get("scheduled_new_reqs", []) if str(r["req_id"]) == req), None)
    cached = so.get("scheduled_cached_reqs", {})
    ci = next((i for i, r in enumerate(cached.get("req_ids", [])) if str(r) == req), None)
    resumed = ent["kind"] == "resumed"
    admitted = new_req is not None or resumed
    new_blocks = [b for b in ent.get("new_block_ids") or [] if b not in hit_ids] if admitted \
        else list(ent.get("new_block_ids") or [])
    prev = src.prev_step(step)
    held_before = [] if admitted else (src.blocks_of(prev, req) if prev is not None else [])
    computed_before = ent["num_computed_tokens_before"]          # after this step's prefix hit
    need_tokens = computed_before + ent["num_tokens"]
    if src.max_model_len:
        need_tokens = min(need_tokens, src.max_model_len)
    return _Allocation(ent, hit, hit_ids, new_req, cached, ci, resumed, admitted, new_blocks, held_before,
                       computed_before, need_tokens, math.ceil(need_tokens / bs), held_before + hit_ids + new_blocks)


def _free_queue_at_allocation(src: RunSource, step: int, req: str) -> dict:
    """The free queue as it was when get_new_blocks ran: the previous step's (the fresh pool's
    before step 1: RunSource.pool_replay), replayed through this step's events up to (and including) this request's allocate; what it popped, evicted, cached."""
    evs = src.events(step)
    mine = _my_events(src, step, req)
    alloc_ev = next((e for e in mine if e["kind"] == "allocate"), None)
    replay = src.pool_replay(step)
    popped = queue_before = None
    for e in evs:
        if replay is None:
            break
        did = replay.apply(e)
        if e is alloc_ev:
            popped, queue_before = did.get("popped"), did["queue_before"]
            break
    evicted = [(b, h) for e in mine if e["kind"] == "evict" for b, h in zip(e["block_ids"], e.get("block_hashes") or [None] * len(e["block_ids"]))]
    cached_now = [(b, h) for e in mine if e["kind"] == "cache" for b, h in zip(e["block_ids"], e.get("block_hashes") or [])]
    return {"events": evs, "replay": replay, "popped": popped, "queue_before": queue_before, "evicted": evicted,
            "cached_now": cached_now}


def _chain(src: RunSource, step: int, req: str, a: _Allocation, q: dict) -> list[dict]:
    """The call chain ①–⑦ with this allocation's values."""
    # Spans under this step's Scheduler.schedule: the KVCacheManager calls for this request.
    spans = [s for s in src.spans_of_step(step) if s.name.startswith("KVCacheManager.")
             and str(s.attributes.get("vllm_anatomy.request_id")) == req]
    gcb = next((s for s in spans if s.name == "KVCacheManager.get_computed_blocks"), None)
    als = next((s for s in spans if s.name == "KVCacheManager.allocate_slots"
                and s.attributes.get("vllm_anatomy.new_block_ids") is not None), None)
    sched = next((s for s in src.spans_of_step(step) if s.name == "Scheduler.schedule"), None)
    ms = lambda s: f" ({(s.end_ns - s.start_ns) / 1e6:.3f} ms)" if s is not None else ""  # noqa: E731
    ent, hit, hit_ids, new_blocks, cached, ci = a.ent, a.hit, a.hit_ids, a.new_blocks, a.cached, a.ci
    popped, queue_before, evicted, cached_now = q["popped"], q["queue_before"], q["evicted"], q["cached_now"]
    so_field = (f"SchedulerOutput.scheduled_new_reqs[{req}].block_ids = {ids(a.new_req['block_ids'][0])}"
                if a.new_req is not None else
                f"SchedulerOutput.scheduled_cached_reqs.new_block_ids[{ci}] (request {req}) = "
                f"{ids((cached['new_block_ids'][ci] or [[]])[0])}" + (" (resumed: replaces its table)" if a.resumed else "")
                if ci is not None else "not in SchedulerOutput")
    why_n = (f"{a.computed_before} computed + {ent['num_tokens']} new tokens = {a.need_tokens} tokens need a slot → "
             f"⌈{a.need_tokens} / {src.block_size}⌉ = {a.need_blocks} blocks; it holds {len(a.held_before) + len(hit_ids)}"
             + (f" ({len(hit_ids)} from the prefix hit)" if hit_ids else "") + f" → {len(new_blocks)} new")
    return [
        {"#": "①", "call": "Scheduler.schedule" + ms(sched),
         "what happened here": f"step {step}: request {req} gets {n_of(ent['num_tokens'], 'token')} ({ent['kind']})"},
        {"#": "②", "call": "KVCacheManager.get_computed_blocks" + ms(gcb),
         "what happened here": (f"prefix-cache lookup: {hit['num_hit_tokens']} of {hit['num_query_tokens']} tokens "
                                f"cached, blocks {ids(hit_ids)}" if a.admitted else
                                "not called: the request is already running (only admissions look up the cache)")},
        {"#": "③", "call": "KVCacheManager.allocate_slots" + ms(als), "what happened here": why_n},
        {"#": "④", "call": "BlockPool.touch",
         "what happened here": (f"takes a reference on the hit blocks {ids(hit_ids)} (out of the free queue if "
                                "they were in it)" if hit_ids else "no hit blocks: nothing to touch")},
        {"#": "⑤", "call": "BlockPool.get_new_blocks",
         "what happened here": (f"pops {ids(popped if popped is not None else new_blocks)} from the free queue's head"
                                + (f" (head was {ids(queue_before[:len(new_blocks) + 3])}…)" if queue_before else "")
                                + ("; evicts " + ", ".join(f"block {b} (hash {h})" for b, h in evicted)
                                   + " first: their cached content is overwritten" if evicted
                                   else "; none of them carried a hash: nothing evicted"))},
        {"#": "⑥", "call": "SingleTypeKVCacheManager.req_to_blocks",
         "what happened here": f"request {req}'s block list becomes {ids(a.table)}"
                               + (f"; BlockPool.cache_full_blocks hashes the now-full {ids([b for b, _ in cached_now])}"
                                  if cached_now else "")},
        {"#": "⑦", "call": "SchedulerOutput", "what happened here": so_field},
    ]


def _summary(step: int, req: str, a: _Allocation, q: dict) -> str:
    popped, evicted = q["popped"], q["evicted"]
    return (f"In **step {step}**, `Scheduler.schedule` gave request **{req}** {n_of(a.ent['num_tokens'], 'token')}; "
            + (f"`get_computed_blocks` found {n_of(a.hit['num_hit_tokens'], 'token')} cached (blocks {ids(a.hit_ids)}); "
               if a.admitted else "it was already running, so no prefix lookup; ")
            + f"`allocate_slots` needed {n_of(len(a.new_blocks), 'new block')}, and `get_new_blocks` popped "
            f"**{ids(popped if popped is not None else a.new_blocks)}** from the free queue's head"
            + (f", evicting the cached hash of {ids([b for b, _ in evicted])}" if evicted else "")
            + f". They were appended to its block list ({ids(a.table)}) and sent to the worker as "
            + ("`NewRequestData.block_ids`." if a.new_req is not None else "`CachedRequestData.new_block_ids`."))
