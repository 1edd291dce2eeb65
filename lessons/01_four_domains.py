"""Lesson 1: the four domains and the two keys (request_id, block_id).

Every object in the engine belongs to one of four domains:

* request domain    -- Request: status, token ids, num_computed_tokens, block hashes
* scheduling domain -- SchedulerOutput (the decision of one step), ModelRunnerOutput (its result)
* memory domain     -- KVCacheBlock (block_id, ref_cnt, hash) in the BlockPool, and block tables
* model domain      -- the weights and the KV-cache tensors the kernels read and write

Two keys tie them together: request_id (stable across processes) and block_id (an
index into the KV-cache tensor). This lesson runs the worker in its own process
(distributed_executor_backend="mp") and shows, from the recorded run, that only
ints cross from the scheduler to the worker: the worker rebuilds every block-table
row from the block ids in the SchedulerOutputs, and those rows equal the
scheduler's KVCacheBlock ids. ref_cnt and hashes never leave the engine process.

Run:  python lessons/01_four_domains.py      (or: vllm-anatomy lesson 1)
CPU, about 20 s (a third of it loading the model twice: engine + worker process).
"""
from __future__ import annotations

import os
import sys

# NOTE: one intra-op thread: on a small CPU shared with other work, torch's spinning worker
# threads make every step several times slower. OMP_NUM_THREADS=2 (or more) overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import msgspec  # noqa: E402

from _common import chat_prompts, check, dashboard_link, finish, greedy, make_llm, say, snapshot, title  # noqa: E402
from vllm_anatomy.core.sched.output import SchedulerOutput  # noqa: E402
from vllm_anatomy.engine.serial_utils import MsgpackEncoder  # noqa: E402
from vllm_anatomy.tracing.reader import open_run  # noqa: E402

QUESTIONS = ["What is a CPU?", "Why is the sky blue?", "Name three prime numbers."]
# Fields of KVCacheBlock (and of its snapshot): none of them may appear in what crosses to the worker.
BLOCK_INTERNALS = {"ref_cnt", "hash", "block_hash", "_block_hash", "prev_free_block", "next_free_block", "owners"}



def all_keys(obj) -> set[str]:
    """Every dict key anywhere inside a JSON-like value."""
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in all_keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in all_keys(v)}
    return set()


def block_id_values(so: dict) -> list:
    """Every value the SchedulerOutput carries in a block-id field (flattened)."""
    values = []
    for new in so["scheduled_new_reqs"]:
        values += [b for group in new["block_ids"] for b in group]
    for ids in so["scheduled_cached_reqs"]["new_block_ids"]:
        values += [b for group in (ids or []) for b in group]
    return values


def replay_block_tables(so: dict, tables: dict[str, list[int]]) -> None:
    """What the worker's _update_states does with block ids, from the message alone."""
    for req_id in so["finished_req_ids"]:
        tables.pop(req_id, None)
    for new in so["scheduled_new_reqs"]:
        tables[new["req_id"]] = list(new["block_ids"][0])
    cached = so["scheduled_cached_reqs"]
    for req_id, ids in zip(cached["req_ids"], cached["new_block_ids"]):
        if req_id in cached["resumed_req_ids"]:
            tables[req_id] = list(ids[0])          # resumed: the new ids replace the row
        elif ids is not None:
            tables[req_id].extend(ids[0])          # running: the new ids are appended


def main() -> None:
    title("Lesson 1: four domains, two keys")
    llm = make_llm(max_model_len=256, distributed_executor_backend="mp")
    prompts = chat_prompts(llm, QUESTIONS)
    outputs = llm.generate(prompts, greedy(6), use_tqdm=False)
    path = finish(llm)
    run = open_run(path)
    steps = run.steps()
    num_gpu_blocks = run.meta["config"]["cache_config"]["num_gpu_blocks"]
    block_size = run.meta["config"]["cache_config"]["block_size"]
    first = snapshot(run, steps[0])
    mr_first = snapshot(run, steps[0], "model_runner")

    # -- the request domain ------------------------------------------------------------
    say(f"""We sent {len(prompts)} chat requests (prompts of {', '.join(str(len(p['prompt_token_ids']))
        for p in prompts)} tokens) and let each generate {len(outputs[0].outputs[0].token_ids)} tokens
        greedily; the engine took {len(steps)} steps. The request domain is the Request object
        the scheduler mutates. After step {steps[0]} it looked like this:""")
    for r in first["scheduler"]["running"]:
        print(f"    request_id={r['request_id']!r:5} status={r['status']:8} num_tokens={r['num_tokens']:3} "
              f"num_computed_tokens={r['num_computed_tokens']:3} block_ids={r['block_ids']}")
    print()

    # -- the memory domain ---------------------------------------------------------------
    kv = first["scheduler"]["kv_cache"]
    owned = [b for b in kv["blocks"] if b["owners"]]
    say(f"""The memory domain is the BlockPool: {kv['num_gpu_blocks']} KVCacheBlocks of {block_size}
        token slots (block 0 is the null placeholder). Each block's metadata -- ref_cnt, the
        prefix-cache hash of a full block, which requests hold it -- lives only in the engine
        process. The blocks held after step {steps[0]}:""")
    for b in owned:
        print(f"    block_id={b['block_id']:3} ref_cnt={b['ref_cnt']} hash={b['hash']} owners={b['owners']}")
    print()
    shared = [b for b in owned if b["ref_cnt"] > 1]
    if shared:
        say(f"""Block{'s' if len(shared) > 1 else ''} {[b['block_id'] for b in shared]} {'are' if len(shared) > 1 else 'is'}
             held by {shared[0]['ref_cnt']} requests at once: the chat template starts every prompt with
             the same system prompt, so the first full block(s) are computed once and shared through
             the prefix cache (lesson 4). Only full blocks get a hash; the partial last block of
             each request has none.""")

    # -- the scheduling domain and what crosses ------------------------------------------
    so_first = first["scheduler_output"]
    wire = MsgpackEncoder().encode(msgspec.convert(so_first, SchedulerOutput))
    so_second = snapshot(run, steps[1])["scheduler_output"] if len(steps) > 1 else None
    say(f"""The scheduling domain is the SchedulerOutput: one per step, the only thing sent to the
        worker. Step {steps[0]}'s message was {len(wire)} bytes of msgpack: for each new request its
        prompt token ids, sampling params and block ids -- {', '.join(f"{n['req_id']!r}: {n['block_ids'][0]}"
        for n in so_first['scheduled_new_reqs'])} -- plain ints. From then on only the diff travels:
        in step {steps[1]} the cached requests got new_block_ids
        {so_second['scheduled_cached_reqs']['new_block_ids'] if so_second else '-'} (None = no new block).""")

    # -- the model domain -----------------------------------------------------------------
    shape = mr_first["kv_cache_shape"]
    say(f"""The model domain is the worker's: the weights and {mr_first['num_kv_cache_layers']} KV-cache
        tensors of shape {shape} ([K/V, num_blocks, block_size, kv_heads, head_dim]). A block id
        is nothing but an index into dimension 1 of these tensors; that is why an int is all the
        worker needs.""")

    # -- the two processes -----------------------------------------------------------------
    engine_pids = {s.pid for s in run.spans("EngineCore.step")}
    worker_pids = {s.pid for s in run.spans("GPUModelRunner.execute_model")}
    step_procs = {s.process for s in run.snapshots("step")}
    mr_procs = {s.process for s in run.snapshots("model_runner")}
    say(f"""The scheduler ran in process {sorted(engine_pids)} and the model runner in process
        {sorted(worker_pids)}: the SchedulerOutput crossed a real process boundary (shared-memory
        queue, msgpack). The worker rebuilt its block table rows from those ints alone.""")

    # -- checks ------------------------------------------------------------------------------
    check(bool(engine_pids and worker_pids and not engine_pids & worker_pids and step_procs != mr_procs),
          f"scheduler (pid {sorted(engine_pids)}) and model runner (pid {sorted(worker_pids)}) ran in different processes")
    check(all(type(v) is int for s in steps for v in block_id_values(snapshot(run, s)["scheduler_output"])),
          f"every block id in all {len(steps)} recorded SchedulerOutputs is a plain int")
    leaked = set().union(*(all_keys(snapshot(run, s)["scheduler_output"]) & BLOCK_INTERNALS for s in steps))
    check(not leaked, "no KVCacheBlock field (ref_cnt, hash, owners, free-list links) is in any SchedulerOutput")
    leaked_worker = set().union(*(all_keys(snapshot(run, s, "model_runner")) & BLOCK_INTERNALS for s in steps))
    check(not leaked_worker and {"ref_cnt", "hash"} <= set(kv["blocks"][0]),
          "the worker's state holds no ref_cnt or hash; only the engine's block pool has them")
    check(all(isinstance(msgspec.convert(snapshot(run, s)["scheduler_output"], SchedulerOutput), SchedulerOutput)
              for s in steps), "each recorded SchedulerOutput decodes back into the wire type SchedulerOutput")

    tables: dict[str, list[int]] = {}
    rows_checked = sched_checked = 0
    replay_ok = sched_ok = True
    for s in steps:
        step, mr = snapshot(run, s), snapshot(run, s, "model_runner")
        replay_block_tables(step["scheduler_output"], tables)
        for row in mr["input_batch"]["rows"]:
            rows_checked += 1
            replay_ok &= row["block_ids"] == tables.get(row["req_id"])
        kv_tables = step["scheduler"]["kv_cache"]["req_to_block_ids"]
        for row in mr["input_batch"]["rows"]:
            if row["req_id"] in kv_tables:   # finished in this step: the scheduler already freed it
                sched_checked += 1
                sched_ok &= row["block_ids"] == kv_tables[row["req_id"]]
    check(replay_ok and rows_checked > 0,
          f"replaying only the block ids of the SchedulerOutputs gives the worker's block-table rows "
          f"({rows_checked} rows over {len(steps)} steps)")
    check(sched_ok and sched_checked > 0,
          f"each worker block-table row equals the scheduler's KVCacheBlock ids for that request_id "
          f"({sched_checked} rows)")

    used = {b for s in steps for ids in snapshot(run, s)["scheduler"]["kv_cache"]["req_to_block_ids"].values()
            for b in ids}
    check(shape[1] == num_gpu_blocks and bool(used) and all(0 < b < num_gpu_blocks for b in used),
          f"block ids {sorted(used)} index dimension 1 of the KV tensor ({num_gpu_blocks} blocks, 0 = null block)")

    span_ids = {s.request_id for s in run.requests()}
    sched_ids = {r for s in steps for r in snapshot(run, s)["scheduler_output"]["num_scheduled_tokens"]}
    worker_ids = {row["req_id"] for s in steps for row in snapshot(run, s, "model_runner")["input_batch"]["rows"]}
    check(span_ids == sched_ids == worker_ids == {o.request_id for o in outputs},
          f"request_id is the one key shared by the frontend span, the scheduler and the worker: {sorted(span_ids, key=str)}")

    say("""Open the step inspector at step 1: its KV cache tab shows the scheduler's blocks (with ref_cnt
        and hashes); its Worker tab, the worker's block-table rows (bare ids).""")
    dashboard_link(path, "inspector", steps[0], tab="kv")
    run.close()


if __name__ == "__main__":
    main()
