"""Lesson 9 — the article's self-test, answered from a recorded trace.

What it teaches
    The article ends with five questions. Instead of reciting answers, this lesson records
    one run built to exercise every answer — requests that share a system prompt (prefix
    hits), requests that finish at different times (holes in the persistent batch, condense
    moves), and a KV pool small enough that freed cached blocks are later either hit again or
    evicted — and then answers each question by computing it from the run store:

    1. Scheduler.schedule -> a KV block allocated: which objects and methods ran
       (spans + step_record + block_pool_events + SchedulerOutput).
    2. What GPUModelRunner._update_states did in a given step (model_runner snapshots:
       rows removed / added, condense moves).
    3. How the block table reached the attention kernel (SchedulerOutput block ids ->
       InputBatch block-table row -> slot_mapping -> the paged KV cache's shape).
    4. What happened to a finished request's blocks (freed tail first, ref_cnt 0, hashed
       ones kept at the free queue's tail, later hit or evicted).
    5. The five accounts of one request: time, memory, communication, CPU, request states.

Run
    python lessons/09_self_test.py           # about 20-40 s on 2 CPU cores
"""
from __future__ import annotations

import math
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")   # shared 2-core machines: see the report / lesson 8
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (chat_prompts, check, dashboard_link, finish, greedy, make_llm, open_run,  # noqa: E402
                     say, snapshot, title)

SYSTEM = ("You are a patient tutor at a museum of computing history. Answer in one short sentence, "
          "in plain words, and never invent dates or names you are not sure of.")
PHASE_A = ["What was ENIAC?", "What is a transistor?", "Who was Ada Lovelace?"]
PHASE_A_TOKENS = [3, 6, 6]              # the first finishes early: a hole in the batch
PHASE_B_SHARED = ["What is a punched card?"]
PHASE_B_OTHER = ["Describe, step by step and in detail, how a mechanical calculator adds two "
                 "multi-digit numbers, including how carries move from one wheel to the next.",
                 "Explain carefully why early computers used vacuum tubes, what made them fail so "
                 "often, and how engineers kept large machines running for days at a time."]
NUM_BLOCKS = 11                          # 10 usable blocks of 16 tokens (block 0 is the null block)

EVENT_METHOD = {"hit": "BlockPool.touch", "evict": "BlockPool._maybe_evict_cached_block",
                "allocate": "BlockPool.get_new_blocks", "cache": "BlockPool.cache_full_blocks",
                "free": "BlockPool.free_blocks"}



def ms(ns: float) -> float:
    return ns / 1e6


def main() -> None:
    title("Lesson 9 — the self-test, answered from a recorded trace")
    llm = make_llm(num_gpu_blocks_override=NUM_BLOCKS, max_model_len=128)
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    a = llm.generate(chat_prompts(llm, PHASE_A, system=SYSTEM),
                     [greedy(n, ignore_eos=True) for n in PHASE_A_TOKENS], use_tqdm=False)
    b = llm.generate(chat_prompts(llm, PHASE_B_SHARED, system=SYSTEM) + chat_prompts(llm, PHASE_B_OTHER),
                     greedy(4, ignore_eos=True), use_tqdm=False)
    path = finish(llm)
    run = open_run(path)
    steps = run.steps()
    snap = {i: snapshot(run, i) for i in steps}
    mr = {i: snapshot(run, i, "model_runner") for i in steps}
    bs = snap[steps[0]]["scheduler"]["kv_cache"]["block_size"]
    say(f"""Recorded {len(steps)} steps: {len(a)} requests sharing a system prompt (max_tokens
        {PHASE_A_TOKENS}), then {len(b)} more — one with the same system prompt, {len(PHASE_B_OTHER)}
        long unrelated ones — on a pool of {NUM_BLOCKS - 1} usable KV blocks of {bs} tokens.""")

    q1(run, steps, snap)
    shown2 = q2(steps, snap, mr)
    q3(steps, snap, mr, bs)
    q4(run, steps, snap, a)
    q5(run, steps, snap, mr, b[0].request_id, weight_bytes)
    # The dashboard's Self-test page answers the same five questions from this run.
    dashboard_link(path, "selftest", shown2)


# -- 1 ---------------------------------------------------------------------------------------
def q1(run, steps, snap) -> None:
    title("1. From Scheduler.schedule() to a KV block: which objects and methods?")
    # The step with the richest allocation story: prefer one with a hit and an eviction.
    def richness(i):
        kinds = {e["kind"] for e in snap[i]["block_pool_events"]}
        return (bool(snap[i]["scheduler_output"]["scheduled_new_reqs"]), "evict" in kinds, "hit" in kinds)
    step = max(steps, key=richness)
    s = snap[step]
    so, rec, events = s["scheduler_output"], s["scheduler"]["step_record"], s["block_pool_events"]
    [schedule_span] = [x for x in run.spans("Scheduler.schedule")
                       if x.parent_id == next(p.span_id for p in run.spans("EngineCore.step") if p.step_id == step)]
    hits = {h["request_id"]: h for h in rec["prefix_hits"]}
    print(f"  step {step}: Scheduler.schedule ran {ms(schedule_span.duration_ns):.3f} ms "
          f"(EngineCore.step -> Scheduler.schedule span); inside it:")
    ok = True
    allocated_in_step = {b for e in events if e["kind"] == "allocate" for b in e["block_ids"]}
    for new in so["scheduled_new_reqs"]:
        rid, blocks = new["req_id"], new["block_ids"][0]
        h = hits.get(rid, {"num_hit_tokens": 0, "hit_block_ids": []})
        print(f"   request {rid}: KVCacheManager.get_computed_blocks -> {h['num_hit_tokens']} cached tokens "
              f"(blocks {h['hit_block_ids']}); KVCacheManager.allocate_slots ->")
        # This request's block-pool events, in order: the ones that touched only its blocks.
        for e in events:
            if e["kind"] != "free" and set(e["block_ids"]) <= set(blocks) and (
                    e["kind"] != "hit" or e["block_ids"] == h["hit_block_ids"]):
                print(f"      {EVENT_METHOD[e['kind']]:<38} {e['kind']:<8} blocks {e['block_ids']}"
                      + (f" hashes {e['block_hashes']}" if e["block_hashes"] else ""))
        print(f"      -> SchedulerOutput.scheduled_new_reqs[{rid}].block_ids = {blocks}")
        n_hit = len(h["hit_block_ids"])
        ok &= blocks[:n_hit] == h["hit_block_ids"]
        ok &= (not n_hit) or any(e["kind"] == "hit" and e["block_ids"] == h["hit_block_ids"] for e in events)
        ok &= any(e["kind"] == "allocate" and e["block_ids"] == blocks[n_hit:] for e in events)
    evicted = [b for e in events if e["kind"] == "evict" for b in e["block_ids"]]
    ok &= set(evicted) <= allocated_in_step
    say("""So the chain is Scheduler.schedule -> KVCacheManager.get_computed_blocks (the prefix-cache
        lookup; step_record.prefix_hits) -> KVCacheManager.allocate_slots, which first takes a
        reference on the hit blocks (BlockPool.touch), then pops fresh blocks from the free queue's
        front (BlockPool.get_new_blocks — evicting the stale hash of any block that still carried
        one), then hashes the blocks that are now full (BlockPool.cache_full_blocks); the block ids
        land in the request's block table and in SchedulerOutput.""")
    check(ok, f"step {step}: for every new request, hit blocks + newly allocated blocks = the block ids "
              "in SchedulerOutput, and every evicted block was one of the allocated ones")


# -- 2 ---------------------------------------------------------------------------------------
def q2(steps, snap, mr) -> int:
    title("2. What did GPUModelRunner._update_states do in one step?")
    step = next((i for i in steps if mr[i]["input_batch"]["condense_moves"]), None)
    if step is None:
        raise AssertionError("lesson fact does not hold: some step condensed the persistent batch")
    prev = max(i for i in steps if i < step)
    before = {r["index"]: r["req_id"] for r in mr[prev]["input_batch"]["rows"]}
    after = {r["index"]: r["req_id"] for r in mr[step]["input_batch"]["rows"]}
    so = snap[step]["scheduler_output"]
    removed = sorted(set(before.values()) - set(after.values()))
    added = sorted(set(after.values()) - set(before.values()))
    moves = mr[step]["input_batch"]["condense_moves"]
    print(f"  step {step}: rows before {before}")
    print(f"  SchedulerOutput.finished_req_ids = {so['finished_req_ids']}, new = "
          f"{[r['req_id'] for r in so['scheduled_new_reqs']]}")
    print(f"  removed {removed}, added {added}, condense moves (src row -> dst row) {moves}")
    print(f"  rows after  {after}")
    say(f"""_update_states made the persistent InputBatch agree with the scheduler by a diff, not
        a rebuild: it dropped the finished request(s) {removed}, which left hole(s) in the rows;
        added {added or 'no'} new request(s) into the lowest holes; then condense() moved the last
        occupied row into each remaining hole ({moves}), so rows 0..{len(after) - 1} are dense
        again. Everything else — token ids, sampling parameters, block-table rows of the
        requests that stayed — was kept from the previous step; that is why the batch persists.""")
    moved_ok = all(before.get(src) == after.get(dst) for src, dst in moves)
    check(set(removed) <= set(so["finished_req_ids"]) | (set(before.values()) - set(so["num_scheduled_tokens"])),
          f"step {step}: the rows removed {removed} are the finished (or unscheduled) requests")
    check(set(added) == {r["req_id"] for r in so["scheduled_new_reqs"]} - set(before.values()),
          f"step {step}: the rows added are SchedulerOutput's new requests ({added})")
    check(moved_ok and sorted(after) == list(range(len(after))),
          f"step {step}: each condense move carried its request to the hole, leaving rows 0..{len(after) - 1} dense")
    return step


# -- 3 ---------------------------------------------------------------------------------------
def q3(steps, snap, mr, bs) -> None:
    title("3. How did the block table reach the attention kernel?")
    # A decode step with a request whose block table is longer than one block.
    step = next(i for i in reversed(steps) if mr[i]["prepare_inputs"]
                and any(len(r["block_ids"]) > 1 for r in mr[i]["input_batch"]["rows"]))
    pi, rows = mr[step]["prepare_inputs"], {r["index"]: r for r in mr[step]["input_batch"]["rows"]}
    row = max(rows.values(), key=lambda r: len(r["block_ids"]))
    rid = row["req_id"]
    # Rebuild the block table from SchedulerOutputs alone: new-request block ids, then appended ones.
    table: list[int] = []
    for i in steps:
        if i > step:
            break
        so = snap[i]["scheduler_output"]
        for new in so["scheduled_new_reqs"]:
            if new["req_id"] == rid:
                table = list(new["block_ids"][0])
        c = so["scheduled_cached_reqs"]
        for j, r in enumerate(c["req_ids"]):
            if r == rid and c["new_block_ids"][j] is not None:
                table = (list(c["new_block_ids"][j][0]) if r in c["resumed_req_ids"]
                         else table + list(c["new_block_ids"][j][0]))
    toks = [k for k, ri in enumerate(pi["req_indices"]) if ri == row["index"]]
    k = toks[-1]
    p, slot = pi["positions"][k], pi["slot_mapping"][k]
    shape = mr[step]["kv_cache_shape"]
    print(f"  step {step}, request {rid}:")
    print(f"   SchedulerOutput block ids, accumulated      {table}")
    print(f"   InputBatch row {row['index']} block table (model_runner)  {row['block_ids']}")
    print(f"   token at position {p}: block index {p} // {bs} = {p // bs} -> physical block "
          f"{row['block_ids'][p // bs]}, offset {p % bs}")
    print(f"   slot_mapping = {row['block_ids'][p // bs]} * {bs} + {p % bs} = {slot}")
    print(f"   KV cache per layer: shape {shape} = [K/V, num_blocks, block_size, kv_heads, head_dim]")
    say(f"""The scheduler only ever sends block ids: the full list for a new request, then the
        newly appended ones in later steps. _update_states appends them to the request's row of
        the InputBatch block table; _prepare_inputs turns each scheduled token's position into a
        slot (block_ids[pos // {bs}] * {bs} + pos % {bs}) in slot_mapping, which the cache-write
        kernel uses to store the new K and V at [block, offset] of the paged cache of shape
        {shape}. The attention kernel gets the block table rows and seq_lens: for each request
        it walks block after block of its table, reading K and V of the first seq_len tokens.""")
    check(table == row["block_ids"], f"request {rid}: the block ids sent in SchedulerOutputs equal its "
                                     f"InputBatch block-table row {row['block_ids']}")
    rows_ok = all(slot_ == rows[ri]["block_ids"][pos // bs] * bs + pos % bs
                  for ri, pos, slot_ in zip(pi["req_indices"], pi["positions"], pi["slot_mapping"]))
    check(rows_ok, f"step {step}: all {len(pi['slot_mapping'])} slot_mapping entries are "
                   f"block_table[pos // {bs}] * {bs} + pos % {bs}")
    check(max(pi["slot_mapping"]) < shape[1] * shape[2], "every slot lies inside the paged KV cache")


# -- 4 ---------------------------------------------------------------------------------------
def q4(run, steps, snap, finished_outputs) -> None:
    title("4. What happened to the blocks of a finished request?")
    rid = finished_outputs[0].request_id       # the one that finished first
    last_step = max(i for i in steps if rid in snap[i]["scheduler"]["kv_cache"]["req_to_block_ids"])
    seen_table = snap[last_step]["scheduler"]["kv_cache"]["req_to_block_ids"][rid]
    # Freed in the step it finished; that step may have appended one more block first.
    fstep, free_ev = next((i, e) for i in steps if i > last_step for e in snap[i]["block_pool_events"]
                          if e["kind"] == "free" and set(seen_table) <= set(e["block_ids"]))
    last_table = seen_table + [b for b in reversed(free_ev["block_ids"]) if b not in seen_table]
    kv = snap[fstep]["scheduler"]["kv_cache"]
    blocks = {b["block_id"]: b for b in kv["blocks"]}
    free_queue = kv["free_queue"]
    print(f"  request {rid} held blocks {last_table}; in step {fstep} BlockPool.free_blocks got "
          f"{free_ev['block_ids']} (reverse order: the tail block first)")
    for bid in free_ev["block_ids"]:
        b = blocks[bid]
        where = (f"free queue position {free_queue.index(bid)} of {len(free_queue)}" if bid in free_queue
                 else "still held")
        print(f"   block {bid:>3}: ref_cnt {b['ref_cnt']}, hash {b['hash']}, owners {b['owners']}, {where}")
    # What became of them later: hit again (touched) or evicted (popped and its hash dropped).
    fate = {}
    for i in steps:
        if i <= fstep:
            continue
        for e in snap[i]["block_pool_events"]:
            for bid in e["block_ids"]:
                if bid in free_ev["block_ids"] and bid not in fate and e["kind"] in ("hit", "evict", "allocate"):
                    fate[bid] = (e["kind"], i)
    print("  later: " + ", ".join(f"block {bid} {k} in step {i}" for bid, (k, i) in sorted(fate.items())))
    say(f"""When request {rid} finished, Scheduler.update_from_output removed it from running and
        called KVCacheManager.free, which hands its blocks to BlockPool.free_blocks in reverse order.
        Each block's ref_cnt dropped by one; a block reaching 0 became free — but a block shared
        with a running request (the system prompt's) stayed held. Freed blocks with a hash went to
        the free queue's tail, still findable by the prefix cache; unhashed ones to the front, to
        be reused first. So yes, they can be taken at once — by a prefix hit that wants exactly
        that content, or, once the front of the queue is used up, by an allocation that evicts
        the hash.""")
    hashed = [bid for bid in free_ev["block_ids"] if blocks[bid]["hash"] and blocks[bid]["ref_cnt"] == 0]
    unhashed = [bid for bid in free_ev["block_ids"] if not blocks[bid]["hash"] and blocks[bid]["ref_cnt"] == 0]
    check(free_ev["block_ids"] == list(reversed(last_table)),
          f"the blocks were freed in reverse order {free_ev['block_ids']}")
    check(all(blocks[bid]["ref_cnt"] == len(blocks[bid]["owners"]) for bid in free_ev["block_ids"])
          and all((blocks[bid]["ref_cnt"] == 0) == (bid in free_queue) for bid in free_ev["block_ids"]),
          "after the free each block's ref_cnt equals its remaining owners; exactly the ref_cnt-0 ones are free")
    check(bool(hashed) and all(free_queue.index(h) > free_queue.index(u) for h in hashed for u in unhashed),
          f"the freed hashed blocks {hashed} sit behind the unhashed ones {unhashed} in the free queue")
    check({k for k, _ in fate.values()} >= {"hit", "evict"},
          "later, some of those blocks were hit again by a prefix-cache lookup and some were evicted")


# -- 5 ---------------------------------------------------------------------------------------
def q5(run, steps, snap, mr, rid, weight_bytes) -> None:
    title(f"5. The five accounts of one request (request {rid})")
    [req] = [r for r in run.requests() if r.request_id == rid]
    ev = {e["name"]: e["time_ns"] for e in req.events}
    n_out = req.attributes["gen_ai.usage.output_tokens"]
    served = [s for s in run.spans("EngineCore.step") if any(lk["span_id"] == req.span_id for lk in s.links)]
    ttft, decode = ms(ev["FIRST_TOKEN"] - req.start_ns), ms(ev["FINISHED"] - ev["FIRST_TOKEN"])
    print(f"  time:    queued {ms(ev['SCHEDULED'] - ev['QUEUED']):.1f} ms, TTFT {ttft:.1f} ms "
          f"(prefill {ms(ev['FIRST_TOKEN'] - ev['SCHEDULED']):.1f} ms), decode {decode:.1f} ms for "
          f"{n_out - 1} more tokens (TPOT {decode / max(n_out - 1, 1):.1f} ms)")
    shape = mr[steps[0]]["kv_cache_shape"]
    dtype = run.meta["config"]["model_config"]["dtype"].replace("torch.", "")
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    layers = mr[steps[0]]["num_kv_cache_layers"]
    per_block = shape[0] * math.prod(shape[2:]) * itemsize * layers
    held = max(len(snap[i]["scheduler"]["kv_cache"]["req_to_block_ids"].get(rid, [])) for i in steps)
    print(f"  memory:  at most {held} KV blocks x {per_block / 1e6:.2f} MB "
          f"({shape[0]} x {'x'.join(map(str, shape[2:]))} x {itemsize} B x {layers} layers) = "
          f"{held * per_block / 1e6:.1f} MB of KV, against {weight_bytes / 1e6:.0f} MB of weights")
    pids = {s.pid for s in run.spans()}
    backend = run.meta["config"]["parallel_config"]["distributed_executor_backend"]
    world = run.meta["config"]["parallel_config"]["world_size"]
    print(f"  comms:   {len(served)} steps served it; executor backend {backend!r}, world size {world}, "
          f"{len(pids)} process: 0 messages crossed a process boundary and 0 all-reduces ran")
    cpu_names = {"Scheduler.schedule", "GPUModelRunner._update_states", "GPUModelRunner._prepare_inputs",
                 "GPUModelRunner._bookkeeping_sync", "Scheduler.update_from_output"}
    fwd_names = {"GPUModelRunner._model_forward", "GPUModelRunner.compute_logits", "GPUModelRunner._sample"}
    traces = {s.trace_id for s in served}
    in_steps = [s for s in run.spans() if s.trace_id in traces]
    cpu = ms(sum(s.duration_ns for s in in_steps if s.name in cpu_names))
    fwd = ms(sum(s.duration_ns for s in in_steps if s.name in fwd_names))
    print(f"  CPU:     schedule + _update_states + _prepare_inputs + bookkeeping + update_from_output "
          f"= {cpu:.2f} ms over those steps, against {fwd:.1f} ms of forward/logits/sampling")
    states: list[tuple[str, int]] = []
    for i in steps:
        sched = snap[i]["scheduler"]
        st = next((r["status"] for r in sched["running"] + sched["waiting"] if r["request_id"] == rid), None)
        if st and (not states or states[-1][0] != st):
            states.append((st, i))
    print(f"  request: engine events {' -> '.join(e['name'] for e in req.events)}; scheduler status by step "
          f"{' -> '.join(f'{s}@{i}' for s, i in states)} -> finished "
          f"({req.attributes['gen_ai.response.finish_reasons']})")
    say(f"""Five numbers, none of which says much alone. This request ran with its neighbours in
        one process on one device, so its communication account is empty here; with
        `--distributed-executor-backend mp` each of its {len(served)} steps would cross the
        shared-memory queue twice each way (execute_model and sample_tokens, with their replies), and with
        tensor parallelism every layer would add all-reduces. Its KV ({held * per_block / 1e6:.1f} MB)
        is tiny next to the weights, but the weights are paid once for everyone while the KV grows
        with every request and token — which is what the scheduler rations.""")
    check(ev["QUEUED"] <= ev["SCHEDULED"] <= ev["FIRST_TOKEN"] <= ev["FINISHED"],
          "request: QUEUED <= SCHEDULED <= FIRST_TOKEN <= FINISHED")
    check(len(served) == n_out, f"time: {len(served)} steps served the request, one per output token")
    check(held == math.ceil((req.attributes["gen_ai.usage.input_tokens"] + n_out - 1) / shape[2]),
          f"memory: it held ceil((prompt + output - 1) / {shape[2]}) = {held} blocks at its peak")
    check(backend == "uni" and len(pids) == 1, "communication: one process (UniProcExecutor), no IPC")
    check(0 < cpu < fwd if run.meta["device"] == "cpu" else cpu > 0,
          f"CPU: the control-plane spans ({cpu:.2f} ms) are a small part next to the forward ({fwd:.1f} ms)")
    check([s for s, _ in states][:1] in (["WAITING"], ["RUNNING"]) and states[-1][0] == "RUNNING",
          f"request: its scheduler states were {[s for s, _ in states]}")


if __name__ == "__main__":
    main()
