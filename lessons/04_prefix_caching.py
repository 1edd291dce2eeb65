"""Lesson 4: prefix caching -- chained hashes, shared blocks, and where freed blocks go.

The memory domain is the only one shared across requests. A full block gets a hash
chained from its parent's hash and its own token ids, so equal hashes mean an equal
*prefix*, not only equal tokens. Requests that start the same way point at the same
physical blocks (ref_cnt counts them). This lesson, on one engine with 13 usable blocks:

1. P1 (a 48-token shared prefix + a question) runs alone: we recompute its block hashes
   ourselves with vllm_anatomy.core.kv_cache_utils and compare with the recorded ones;
   when it finishes, its blocks are freed tail first: hashed ones to the *tail* of the
   free queue (kept for reuse), the unhashed partial block to the *front*.
2. P2 and P3 (same prefix, other questions) run together: three blocks with ref_cnt 2.
3. P4 is exactly the prefix (48 tokens, three cached blocks) yet still computes 16 tokens:
   the last prompt token must be recomputed to get logits, and hits are whole blocks.
4. P5, a long unrelated prompt, needs more blocks than the never-cached ones: the
   allocation takes the free queue from the front and evicts the cached blocks it
   reaches, in LRU order -- chain tails before chain heads.
5. P6 repeats P1: it hits exactly the part of the chain that survived.
6. P7 asks for n=3 samples (parallel sampling). The frontend fans it out into three child
   requests, 0_P7, 1_P7 and 2_P7 (engine/parallel_sampling.py); the prefix cache puts all three
   on one set of prompt blocks (ref_cnt 3), and a shared block goes back to the free queue only
   when the last child that holds it finishes -- the article's "shared blocks wait for every holder".

Run:  python lessons/04_prefix_caching.py      (or: vllm-anatomy lesson 4)
CPU, about 15 s.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

# NOTE: one intra-op thread: on a small CPU shared with other work, torch's spinning worker
# threads make every step several times slower. OMP_NUM_THREADS=2 (or more) overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (check, dashboard_link, finish, fixed_len, greedy, make_llm, say, snapshot,  # noqa: E402
                     title)
from vllm_anatomy import SamplingParams  # noqa: E402
from vllm_anatomy.core import kv_cache_utils  # noqa: E402
from vllm_anatomy.tracing.reader import open_run  # noqa: E402

BS, MAX_MODEL_LEN = 16, 192
PREFIX_TEXT = ("You are the guide of a small museum of computing history. Visitors ask short questions "
               "about old machines; answer in one friendly sentence and never invent dates.")
QUESTIONS = {"P1": " Who built the first mouse?", "P2": " What did ENIAC compute?", "P3": " Why were punch cards used?",
             "P7": " Name an early video game."}
# P7: three samples of one prompt. NOTE: sampled (temperature > 0): vLLM refuses n > 1 with greedy
# decoding, whose n answers would be identical. The seed makes the run repeatable (child i: seed + i).
# Each child ends at its first sentence (a stop string), so they finish at different steps.
PARALLEL = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=24, stop=["."])
UNRELATED = "Rivers carve valleys slowly, grain by grain, over thousands of years of patient water."




def run_requests(engine, requests: dict[str, tuple[list[int], int]]) -> None:
    for req_id, (ids, max_tokens) in requests.items():
        engine.add_request(req_id, {"prompt_token_ids": ids}, greedy(max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def chain_hashes(token_ids: list[int]) -> list[str]:
    """The block hashes of every full block, computed here from the token ids alone."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - BS + 1, BS):
        parent = kv_cache_utils.hash_block_tokens(kv_cache_utils.sha256, parent, token_ids[start:start + BS])
        hashes.append(parent.hex()[:8])
    return hashes


def main() -> None:
    title("Lesson 4: prefix caching")
    llm = make_llm(max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=14, block_size=BS)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    path = llm.llm_engine.recorder.run_path
    prefix = fixed_len(tok, PREFIX_TEXT, 3 * BS)
    prompt = {r: prefix + tok.encode(q) for r, q in QUESTIONS.items()}
    prompt["P4"] = list(prefix)

    run_requests(engine, {"P1": (prompt["P1"], 3)})
    run_requests(engine, {"P2": (prompt["P2"], 3), "P3": (prompt["P3"], 3)})
    run_requests(engine, {"P4": (prompt["P4"], 2)})
    # Size P5 from the pool as P4 left it: two blocks more than the never-cached free blocks.
    # NOTE: the engine's own pool, not the last snapshot: with async scheduling (a GPU's
    # default) a step's snapshot is taken as the step is launched, and the blocks it fills
    # are cached (hashed) only when its tokens come back, a step later.
    pool = engine.engine_core.scheduler.kv_cache_manager.block_pool
    n_unhashed = sum(1 for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is None)
    prompt["P5"] = fixed_len(tok, UNRELATED, min((n_unhashed + 2) * BS - 4, MAX_MODEL_LEN - 4))
    run_requests(engine, {"P5": (prompt["P5"], 2)})
    prompt["P6"] = list(prompt["P1"])
    run_requests(engine, {"P6": (prompt["P6"], 2)})
    engine.add_request("P7", {"prompt_token_ids": prompt["P7"]}, PARALLEL)
    while engine.has_unfinished_requests():
        engine.step()
    path = finish(llm)

    run = open_run(path)
    steps = run.steps()
    snaps = {s: snapshot(run, s) for s in steps}
    tables = {s: snaps[s]["scheduler"]["kv_cache"]["req_to_block_ids"] for s in steps}
    blocks = {s: {b["block_id"]: b for b in snaps[s]["scheduler"]["kv_cache"]["blocks"]} for s in steps}

    def first_step(pred: Callable[[int], bool], what: str) -> int:
        """The first recorded step where pred holds: each one the scenario above brings about."""
        found = next((s for s in steps if pred(s)), None)
        assert found is not None, f"no recorded step {what}"
        return found

    def hit(req_id: str) -> tuple[int, dict[str, Any]]:
        """The step that admitted req_id and its prefix-cache lookup.
        NOTE: with prefix caching on, the scheduler records a lookup for every request it
        admits (Scheduler: step.prefix_hits), and every request here was admitted."""
        for s in steps:
            for h in snaps[s]["scheduler"]["step_record"]["prefix_hits"]:
                if h["request_id"] == req_id:
                    return s, h
        raise AssertionError(f"no recorded prefix-cache lookup of {req_id}")

    # 1. chained hashes and freeing order ----------------------------------------------------
    s1 = first_step(lambda s: "P1" in tables[s], "holding P1")
    t1 = tables[s1]["P1"]
    recorded = [blocks[s1][b]["hash"] for b in t1]
    mine = chain_hashes(prompt["P1"])
    unchained = kv_cache_utils.hash_block_tokens(kv_cache_utils.sha256, None, prompt["P1"][BS:2 * BS]).hex()[:8]
    f1 = first_step(lambda s: s > s1 and "P1" not in tables[s], f"after {s1} without P1")
    free_ev = [e for e in snaps[f1]["block_pool_events"] if e["kind"] == "free"]
    fq1 = snaps[f1]["scheduler"]["kv_cache"]["free_queue"]
    hashed1 = [b for b in t1 if blocks[s1][b]["hash"]]
    unhashed1 = [b for b in t1 if not blocks[s1][b]["hash"]]
    say(f"""P1 has {len(prompt['P1'])} prompt tokens, so blocks {t1} ({BS} tokens each): the first
         {len(mine)} are full and hashed, the last one is partial and is not. Recomputing the chain
         from the token ids: {mine}; recorded: {recorded}. The same tokens as block 1 without
         its parent would hash to {unchained}: a hash names the whole prefix up to that block.""")
    say(f"""P1 finished at step {f1}. Its blocks were freed tail first ({free_ev[0]['block_ids'] if free_ev else '?'}):
         the unhashed block went to the front of the free queue (reused first, it can never be a hit)
         and the hashed ones to the tail, so the free queue is now {fq1}.""")
    check(recorded[:len(mine)] == mine and all(h is None for h in recorded[len(mine):]) and unchained != mine[1],
          f"block hashes recomputed from token ids ({', '.join(mine)}) match the recorded ones; the parent hash changes the result")
    check(len(free_ev) == 1 and free_ev[0]["block_ids"] == list(reversed(t1)),
          f"a finished request's blocks are freed in reverse order: {list(reversed(t1))}")
    check(fq1[:len(unhashed1)] == list(reversed(unhashed1)) and fq1[-len(hashed1):] == list(reversed(hashed1)),
          f"unhashed block {unhashed1} went to the front of the free queue, hashed {list(reversed(hashed1))} to the tail")

    print()

    # 2. two live requests sharing blocks ------------------------------------------------------
    s2 = first_step(lambda s: "P2" in tables[s] and "P3" in tables[s], "holding P2 and P3")
    shared = [b for b in tables[s2]["P2"] if b in tables[s2]["P3"]]
    _, h2 = hit("P2")
    _, h3 = hit("P3")
    say(f"""P2 and P3 start with the same 48 tokens. At step {s2} both found them cached
         ({h2['num_hit_tokens']} and {h3['num_hit_tokens']} hit tokens) and now share blocks
         {shared}: {', '.join(f"block {b} ref_cnt={blocks[s2][b]['ref_cnt']} owners={blocks[s2][b]['owners']}" for b in shared)}.
         Their block tables are {tables[s2]['P2']} and {tables[s2]['P3']}; only the last block differs.""")
    check(shared == t1[:3] and all(blocks[s2][b]["ref_cnt"] == 2 and sorted(blocks[s2][b]["owners"]) == ["P2", "P3"]
                                   for b in shared),
          f"two live requests share P1's cached blocks {shared} with ref_cnt 2")
    check(h2["num_hit_tokens"] == h3["num_hit_tokens"] == 3 * BS and h2["hit_block_ids"] == shared,
          f"both prefix lookups hit {3 * BS} tokens = 3 whole blocks")

    print()

    # 3. the last-token recompute --------------------------------------------------------------
    s4, h4 = hit("P4")
    cached_before = {b["hash"] for b in blocks[s4 - 1].values() if b["hash"]}
    p4_hashes = chain_hashes(prompt["P4"])
    p4_sched = snaps[s4]["scheduler_output"]["num_scheduled_tokens"].get("P4")
    p4_pi = snapshot(run, s4, "model_runner")["prepare_inputs"]
    p4_pos = [p for p, r in zip(p4_pi["positions"], p4_pi["req_indices"]) if p4_pi["req_ids"][r] == "P4"]
    say(f"""P4 is the bare {len(prompt['P4'])}-token prefix; all {len(p4_hashes)} of its block hashes were
         cached before it arrived. Still, the lookup returned only {h4['num_hit_tokens']} tokens and
         step {s4} computed {p4_sched} (positions {p4_pos[0] if p4_pos else '?'}..{p4_pos[-1] if p4_pos else '?'}):
         a hit may cover at most num_tokens - 1 tokens, because the last prompt token has to run
         through the model to produce the logits of the first output token -- and hits come in
         whole blocks, so here a whole block is recomputed.""")
    check(set(p4_hashes) <= cached_before and h4["num_hit_tokens"] < len(prompt["P4"])
          and h4["num_hit_tokens"] == (len(prompt["P4"]) - 1) // BS * BS
          and p4_sched == len(prompt["P4"]) - h4["num_hit_tokens"] and bool(p4_pos) and p4_pos[-1] == len(prompt["P4"]) - 1,
          f"a fully cached {len(prompt['P4'])}-token prompt still computes {p4_sched} tokens, its last one included")

    print()

    # 4. eviction ---------------------------------------------------------------------------------
    s5 = first_step(lambda s: "P5" in tables[s], "holding P5")
    fq_before = snaps[s5 - 1]["scheduler"]["kv_cache"]["free_queue"]
    hash_before = {b: blocks[s5 - 1][b]["hash"] for b in fq_before}
    ev5 = snaps[s5]["block_pool_events"]
    alloc5 = [b for e in ev5 if e["kind"] == "allocate" for b in e["block_ids"]]
    evicted = [(b, h) for e in ev5 if e["kind"] == "evict" for b, h in zip(e["block_ids"], e["block_hashes"])]
    expect_evicted = [b for b in fq_before[:len(alloc5)] if hash_before[b]]
    survivors = [b for b in fq_before[len(alloc5):] if hash_before[b]]
    say(f"""Before P5 the free queue was {fq_before}, with cached (hashed) blocks
         {[b for b in fq_before if hash_before[b]]} at the tail. P5 ({len(prompt['P5'])} tokens) needed
         {len(alloc5)} blocks and took them from the front: {alloc5}. Reaching cached blocks, it
         evicted {[b for b, _ in evicted]} (hashes {[h for _, h in evicted]}): the least recently freed,
         which are chain tails -- a block is only useful if every block before it also hits, so the
         heads {survivors} stay cached longest.""")
    check(alloc5 == fq_before[:len(alloc5)],
          f"allocation pops the free queue from the front: {alloc5}")
    check(bool(evicted) and [b for b, _ in evicted] == expect_evicted
          and all(hash_before[b] == h for b, h in evicted),
          f"evicted first: the cached blocks nearest the front, {expect_evicted}; never-cached blocks were used before them")

    print()

    # 5. what survived ------------------------------------------------------------------------------
    s6, h6 = hit("P6")
    cached6 = {b["hash"] for b in blocks[s6 - 1].values() if b["hash"]}
    p6_hashes = chain_hashes(prompt["P6"])
    expect6 = next((i for i, h in enumerate(p6_hashes) if h not in cached6), len(p6_hashes)) * BS
    say(f"""P6 repeats P1's prompt. Of its {len(p6_hashes)} full-block hashes, the cache still held
         {[h for h in p6_hashes if h in cached6]}; the lookup walks the chain and stops at the first
         miss, so it hit {h6['num_hit_tokens']} tokens.""")
    check(h6["num_hit_tokens"] == min(expect6, (len(prompt["P6"]) - 1) // BS * BS)
          and h6["num_hit_tokens"] < len(p6_hashes) * BS,
          f"after eviction P6 hits {h6['num_hit_tokens']} tokens: the chain up to the first evicted block")
    invariant = all(b["ref_cnt"] == len(b["owners"]) for s in steps for b in blocks[s].values() if not b["is_null"])
    check(invariant, f"at every one of {len(steps)} steps, each block's ref_cnt equals the number of requests holding it")

    print()

    # 6. parallel sampling: one prompt, three requests, one set of prompt blocks ---------------------
    children = [f"{i}_P7" for i in range(PARALLEL.n)]
    s7 = first_step(lambda s: all(c in tables[s] for c in children), f"holding all of {children}")
    shared7 = [b for b in tables[s7][children[0]] if all(b in tables[s7][c] for c in children)]
    own7 = {c: [b for b in tables[s7][c] if b not in shared7] for c in children}
    hits7 = {c: hit(c)[1] for c in children}
    def finished(child: str) -> int:
        return first_step(lambda s: s > s7 and child not in tables[s], f"after {s7} without {child}")
    done7 = {c: finished(c) for c in children}
    last7 = max(done7.values())
    say(f"""P7 asked for n={PARALLEL.n} samples of one {len(prompt['P7'])}-token prompt. The engine never saw
         a parent: the frontend added three ordinary requests {children} with the same prompt (and seeds
         {PARALLEL.seed}, {PARALLEL.seed + 1}, {PARALLEL.seed + 2}). The prefix cache did the rest: the prompt's
         full blocks {shared7} are held by all three at step {s7}
         ({', '.join(f"block {b} ref_cnt={blocks[s7][b]['ref_cnt']}" for b in shared7)}), so they are stored
         once and computed at most once (0_P7 itself found {hits7[children[0]]['num_hit_tokens']}
         of its tokens still cached from P6; 1_P7 and 2_P7 found the same blocks, now held by 0_P7). Each child writes only its own
         last prompt block and its outputs ({', '.join(f"{c}: {own7[c]}" for c in children)} at step {s7}).
         Each child stopped at its first sentence, at steps {[done7[c] for c in children]}: after each
         finish the shared blocks' ref_cnt was {[blocks[done7[c]][shared7[0]]['ref_cnt'] for c in sorted(children, key=done7.__getitem__)]},
         and they went back to the free queue (still hashed: a hit for the next such prompt) only at
         step {last7}, when the last holder finished.""")
    check(len(shared7) == len(prompt["P7"]) // BS and all(
        blocks[s7][b]["ref_cnt"] == 3 and sorted(blocks[s7][b]["owners"]) == children for b in shared7),
          f"n=3: the three child requests hold the prompt's {len(shared7)} full blocks {shared7}, ref_cnt 3")
    check(all(hits7[c]["num_hit_tokens"] == len(shared7) * BS for c in children[1:]),
          f"children 1 and 2 found those blocks by hash: {len(shared7) * BS} hit tokens each, nothing recomputed")
    check(len({b for c in children for b in own7[c]}) == sum(len(v) for v in own7.values()),
          "every child's own blocks (the partial prompt block, the outputs) are its alone")
    held = all(blocks[s][b]["ref_cnt"] == sum(c in tables[s] for c in children)
               and (b in snaps[s]["scheduler"]["kv_cache"]["free_queue"]) == (s >= last7)
               for s in steps if s >= s7 for b in shared7) and all(blocks[last7][b]["hash"] for b in shared7)
    check(held, f"from step {s7} on, each shared block's ref_cnt counts the children still running, and it "
                f"joins the free queue, still hashed, only at step {last7}, when the last of them finishes")

    print()
    say(f"""The step inspector's KV cache tab at step {s7} shows the block grid with P7's three shared
         blocks at ref_cnt 3 (rc3, striped with the three children's colours) and the free queue below
         it; step {s2} shows P2 and P3 sharing P1's blocks at rc2.""")
    dashboard_link(path, "inspector", s7, tab="kv")
    run.close()


if __name__ == "__main__":
    main()
