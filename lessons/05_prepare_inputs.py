"""Lesson 5: the translation layer -- SchedulerOutput -> GPU tensors (prepare_inputs).

The scheduler says "request r computes n more tokens". The kernels need something else:
one flat list of tokens (input_ids) with their positions, where each request's slice
starts (query_start_loc), how long each sequence is (seq_lens), where each token's K/V
must be written (slot_mapping) and which blocks each request may read (block_table).
GPUModelRunner._prepare_inputs builds all of them from the persistent InputBatch, whose
rows the runner keeps in step with the SchedulerOutputs (_update_states + condense()).

The scenario: four requests (prompts of 11, 5, 14 and 7 tokens, block_size 8); the
second one stops after 2 tokens, leaving a hole in row 1 of the batch, and condense()
moves the last row into it. Every tensor of every step is recomputed here from the
SchedulerOutput and the block tables and compared with what the runner recorded:
slot = block_table[row][pos // block_size] * block_size + pos % block_size.

Run:  python lessons/05_prepare_inputs.py      (or: vllm-anatomy lesson 5)
CPU, about 12 s.
"""
from __future__ import annotations

import os
import sys

# NOTE: one intra-op thread: on a small CPU shared with other work, torch's spinning worker
# threads make every step several times slower. OMP_NUM_THREADS=2 (or more) overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (check, dashboard_link, finish, fixed_len, greedy, make_llm, say, snapshot,  # noqa: E402
                     title)
from vllm_anatomy.tracing.reader import open_run  # noqa: E402

BS = 8
REQUESTS = {  # request id: (prompt text, prompt length, max_tokens)
    "r0": ("The clockmaker opened his shop at dawn and", 11, 6),
    "r1": ("Snow fell on the quiet", 5, 2),
    "r2": ("A ship carrying spices and silk left the harbour before the storm", 14, 6),
    "r3": ("Seven owls sat on a branch", 7, 6),
}




def computed_before(so: dict) -> dict[str, int]:
    """num_computed_tokens of each scheduled request before this step, from the SchedulerOutput alone."""
    before = {n["req_id"]: n["num_computed_tokens"] for n in so["scheduled_new_reqs"]}
    cached = so["scheduled_cached_reqs"]
    before.update(zip(cached["req_ids"], cached["num_computed_tokens"]))
    return before


def expected_tensors(so: dict, row_req_ids: list[str], rows: dict[str, list[int]], tokens: dict[str, list[int]]):
    """prepare_inputs, redone by hand: the flat batch in InputBatch row order."""
    before = computed_before(so)
    out = {"input_ids": [], "positions": [], "query_start_loc": [0], "seq_lens": [], "slot_mapping": []}
    for req_id in row_req_ids:
        n = so["num_scheduled_tokens"][req_id]
        for pos in range(before[req_id], before[req_id] + n):
            out["positions"].append(pos)
            out["input_ids"].append(tokens[req_id][pos])
            out["slot_mapping"].append(rows[req_id][pos // BS] * BS + pos % BS)
        out["query_start_loc"].append(out["query_start_loc"][-1] + n)
        out["seq_lens"].append(before[req_id] + n)
    out["logits_indices"] = [q - 1 for q in out["query_start_loc"][1:]]
    return out


def show(pi: dict, rows: dict[str, list[int]], width: int = 88) -> None:
    def line(name: str, values: list) -> None:
        text = f"    {name:16} {values}"
        print(text if len(text) <= width else text[:width - 4] + " ...]")
    for name in ("req_ids", "num_scheduled_tokens", "input_ids", "positions", "query_start_loc", "seq_lens",
                 "slot_mapping", "logits_indices"):
        line(name, pi[name])
    line("block_table", [rows[r] for r in pi["req_ids"]])
    print()


def main() -> None:
    title("Lesson 5: the translation layer (prepare_inputs)")
    llm = make_llm(max_model_len=64, block_size=BS)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    prompts = {r: fixed_len(tok, text, n) for r, (text, n, _) in REQUESTS.items()}
    for r, (_, _, max_tokens) in REQUESTS.items():
        engine.add_request(r, {"prompt_token_ids": prompts[r]}, greedy(max_tokens, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    path = finish(llm)
    tokens = {r: prompts[r] + list(outputs[r].outputs[0].token_ids) for r in REQUESTS}

    run = open_run(path)
    steps = run.steps()
    snaps = {s: snapshot(run, s) for s in steps}
    mrs = {s: snapshot(run, s, "model_runner") for s in steps}

    def rows_of(s: int) -> dict[str, list[int]]:
        return {row["req_id"]: row["block_ids"] for row in mrs[s]["input_batch"]["rows"]}

    def index_of(s: int) -> dict[str, int]:
        return {row["req_id"]: row["index"] for row in mrs[s]["input_batch"]["rows"]}

    def sampled_before(s: int, req_id: str) -> int | None:
        """The token the latest earlier step sampled for req_id (what async scheduling splices in)."""
        for prev in reversed([p for p in steps if p < s and mrs[p]["prepare_inputs"] is not None]):
            pi = mrs[prev]["prepare_inputs"]
            if req_id in pi["req_ids"]:
                got = (mrs[prev].get("sampled_token_ids") or [])
                row = pi["req_ids"].index(req_id)
                return got[row][-1] if row < len(got) and got[row] else None
        return None

    first = steps[0]
    so1 = snaps[first]["scheduler_output"]
    say(f"""Step {first}'s SchedulerOutput: {so1['num_scheduled_tokens']} tokens to compute, and for each
         new request its block ids {{{', '.join(f"{n['req_id']}: {n['block_ids'][0]}" for n in so1['scheduled_new_reqs'])}}}.
         The runner gave each request a row of the InputBatch and flattened everything into one
         batch of {so1['total_num_scheduled_tokens']} tokens:""")
    show(mrs[first]["prepare_inputs"], rows_of(first))
    say(f"""Read it column by column: token i belongs to the request whose slice of query_start_loc
         contains i; its position is where that request's computed tokens end plus its offset in
         the slice; its K/V goes to slot block_table[row][position // {BS}] * {BS} + position % {BS}.
         logits_indices picks the last token of each request: the only rows that need logits.""")

    cstep = next((s for s in steps if mrs[s]["input_batch"]["condense_moves"]), None)
    # (None unless a step condensed: then the condense check below fails, saying so)
    prev: int | None = None
    src = dst = moved = None
    if cstep is not None:
        prev = steps[steps.index(cstep) - 1]
        (src, dst), = mrs[cstep]["input_batch"]["condense_moves"] or [(None, None)]
        moved = next((r for r, i in index_of(cstep).items() if i == dst), None)
        if "r1" in snaps[cstep]["scheduler_output"]["finished_req_ids"]:
            why = f"""step {cstep}'s SchedulerOutput listed it in finished_req_ids, so _update_states
                   removed its row {index_of(prev).get('r1')}"""
        else:
            # NOTE: async scheduling: the step that samples r1's last token is still in
            # flight when step cstep is scheduled; cstep does not schedule r1 (one more step
            # would be thrown away), and _update_states takes unscheduled requests out of the
            # persistent batch (their CachedRequestState stays). finished_req_ids lists r1
            # a step later, once its last token has arrived.
            why = f"""step {cstep} did not schedule it (with async scheduling the step sampling its
                   last token was still in flight; finished_req_ids lists it a step later), so
                   _update_states took its row {index_of(prev).get('r1')} out of the persistent batch"""
        say(f"""r1 stopped after {len(outputs['r1'].outputs[0].token_ids)} tokens; {why}
             and left a hole. condense() moved the last row ({src}, {moved}) into the
             hole ({dst}), taking its token ids, sampling params and block-table row along (moves
             recorded: {mrs[cstep]['input_batch']['condense_moves']}). Row numbers are only valid for one step;
             request ids are the stable key. Step {cstep}, a pure decode step:""")
        show(mrs[cstep]["prepare_inputs"], rows_of(cstep))
        r1_blocks = set(rows_of(prev).get("r1", []))
        reused = sorted({(r, b) for s in steps[steps.index(cstep):] for r, ids in rows_of(s).items()
                         for b in ids if b in r1_blocks and r != "r1"})
        if reused:
            say(f"""Blocks are recycled: r1's block {sorted(r1_blocks)} went back to the free queue when it
                 finished, and {', '.join(f'{r} later received block {b}' for r, b in reused)} -- the same KV
                 slots, overwritten by another request's tokens.""")

    # -- checks -----------------------------------------------------------------------------------
    names = ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping", "logits_indices")
    mismatches, n_tokens, n_spliced = [], 0, 0
    # NOTE: with async scheduling (a GPU's default) a step may be launched with nothing to
    # compute (every running request's last token already in flight): no prepare_inputs.
    computed = [s for s in steps if mrs[s]["prepare_inputs"] is not None]
    for s in computed:
        pi = mrs[s]["prepare_inputs"]
        exp = expected_tensors(snaps[s]["scheduler_output"], pi["req_ids"], rows_of(s), tokens)
        n_tokens += len(pi["slot_mapping"])
        mismatches += [(s, k) for k in names if k != "input_ids" and exp[k] != pi[k]]
        # With async scheduling the host never saw a decode's input token: it is the one
        # the previous step sampled, spliced into input_ids on the device; -1 marks it.
        for i, (got, want) in enumerate(zip(pi["input_ids"], exp["input_ids"])):
            if got == -1 and want == sampled_before(s, pi["req_ids"][pi["req_indices"][i]]):
                n_spliced += 1
            elif got != want:
                mismatches.append((s, "input_ids"))
    scheduled = sum(snaps[s]["scheduler_output"]["total_num_scheduled_tokens"] for s in steps)
    check(not mismatches and n_tokens == scheduled,
          f"input_ids, positions, query_start_loc, seq_lens, slot_mapping and logits_indices of all {len(computed)} "
          f"steps that computed ({n_tokens} tokens) recomputed from SchedulerOutput + block tables match the "
          f"recorded tensors" + (f" ({n_spliced} input ids spliced on the device: the previous step's samples)"
                                 if n_spliced else ""))
    same_tables = all(rows_of(s)[r] == snaps[s]["scheduler"]["kv_cache"]["req_to_block_ids"][r]
                      for s in steps for r in rows_of(s) if r in snaps[s]["scheduler"]["kv_cache"]["req_to_block_ids"])
    check(same_tables, "every block_table row equals the scheduler's KVCacheBlock ids for that request")
    check(all(len(set(mrs[s]["prepare_inputs"]["slot_mapping"])) == len(mrs[s]["prepare_inputs"]["slot_mapping"])
              for s in computed), "within a step, no two tokens write the same KV slot")
    jumps = []
    for s in computed:
        so, pi = snaps[s]["scheduler_output"], mrs[s]["prepare_inputs"]
        for r, ids in zip(so["scheduled_cached_reqs"]["req_ids"], so["scheduled_cached_reqs"]["new_block_ids"]):
            if ids:
                row = pi["req_ids"].index(r)
                slot = pi["slot_mapping"][pi["query_start_loc"][row]]
                jumps.append((s, r, ids[0], slot, slot // BS in ids[0]))
    check(bool(jumps) and all(ok for *_, ok in jumps),
          "a decode crossing a block boundary got a new block id and its slot lies in that block: "
          + ", ".join(f"step {s} {r} new block {b} -> slot {sl}" for s, r, b, sl, _ in jumps))
    prev_rows = index_of(prev) if prev is not None else {}
    nxt = steps[steps.index(cstep) + 1] if cstep is not None and cstep != steps[-1] else None
    left = cstep is not None and ("r1" in snaps[cstep]["scheduler_output"]["finished_req_ids"] or (
        "r1" not in snaps[cstep]["scheduler_output"]["num_scheduled_tokens"] and nxt is not None
        and "r1" in snaps[nxt]["scheduler_output"]["finished_req_ids"]))
    check(left and cstep is not None and prev is not None and moved is not None
          and mrs[cstep]["input_batch"]["condense_moves"] == [[max(prev_rows.values()), prev_rows["r1"]]]
          and index_of(cstep)[moved] == prev_rows["r1"] and rows_of(cstep)[moved][:len(rows_of(prev)[moved])] == rows_of(prev)[moved]
          and mrs[cstep]["input_batch"]["num_reqs"] == len(prev_rows) - 1,
          f"condense() moved row {src} ({moved}) into r1's hole at row {dst}, its block-table row with it"
          if cstep is not None else "condense() moved a row into r1's hole (no step recorded a condense move)")

    say(f"""The step inspector's Worker tab at step {cstep} shows the condense move under the InputBatch,
         and every tensor of prepare_inputs with slot_mapping split into block_id and offset.""")
    dashboard_link(path, "inspector", cstep, tab="worker")
    run.close()


if __name__ == "__main__":
    main()
