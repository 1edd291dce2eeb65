"""Lesson 3: schedule() and the single token budget.

There is no prefill phase and no decode phase in the scheduler. Every request has
num_computed_tokens and num_tokens; each step schedule() hands out one budget of
max_num_batched_tokens tokens so that num_computed_tokens catches up: RUNNING requests
first (a decode is a catch-up of 1 token), then WAITING ones. A long prompt is cut into
chunks (chunked prefill) by what is left of the budget and by long_prefill_token_threshold
-- in vLLM v0.27.1 every chunk, even a lone request's (later vLLM versions let a request
that is alone take the whole budget: nobody is there to starve).

The scenario: max_num_batched_tokens=32, long_prefill_token_threshold=12. Request A
(28 prompt tokens) arrives alone; once it decodes, B (70), C (40), D (30) and E (10)
arrive. The recorded SchedulerStepRecords are checked step by step: budget accounting,
the threshold (a lone request's chunks included), chunk continuity, and steps that mix a
decode with prefill chunks in one flat batch.

Run:  python lessons/03_schedule_token_budget.py      (or: vllm-anatomy lesson 3)
CPU, about 15-20 s.
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

BUDGET, THRESHOLD = 32, 12
LATE = {"B": (70, "The library of the old town keeps maps of rivers that no longer exist,"),
        "C": (40, "Engineers who build bridges must think about wind, weight and time."),
        "D": (30, "A lighthouse keeper writes down the weather every single night."),
        "E": (10, "Bees dance to tell each other where flowers are.")}
SHORT = {"decode": "dec", "prefill_chunk": "pre", "final_prefill_chunk": "PRE", "resumed": "res"}




def main() -> None:
    title("Lesson 3: schedule() and the single token budget")
    llm = make_llm(max_model_len=128, max_num_batched_tokens=BUDGET, long_prefill_token_threshold=THRESHOLD)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    core = engine.engine_core
    prompt_len = {"A": 28}
    engine.add_request("A", {"prompt_token_ids": fixed_len(tok, "Once upon a time a curious robot", 28)},
                       greedy(12, ignore_eos=True))
    while core.scheduler.requests["A"].num_computed_tokens < prompt_len["A"]:
        engine.step()                                 # A alone, until its whole prompt is in the KV cache
    for req_id, (n, text) in LATE.items():
        prompt_len[req_id] = n
        engine.add_request(req_id, {"prompt_token_ids": fixed_len(tok, text, n)}, greedy(3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    path = finish(llm)

    run = open_run(path)
    steps = run.steps()
    snaps = {s: snapshot(run, s) for s in steps}
    mrs = {s: snapshot(run, s, "model_runner") for s in steps}
    recs = {s: snaps[s]["scheduler"]["step_record"] for s in steps}

    print(f"  budget {BUDGET} tokens per step, long_prefill_token_threshold {THRESHOLD}; "
          f"dec = decode, pre = prefill chunk, PRE = last prefill chunk\n")
    print(f"    {'step':>4}  {'used':>7}  {'scheduled (request:tokens kind)':<58} admission stopped")
    for s in steps:
        r = recs[s]
        used = r["token_budget_start"] - r["token_budget_end"]
        chunks = "  ".join(f"{x['request_id']}:{x['num_tokens']} {SHORT[x['kind']]}" for x in r["scheduled"])
        print(f"    {s:>4}  {used:>3}/{r['token_budget_start']:<3}  {chunks:<58} {r['admission_stop_reason']}")
    print()

    mixed = [s for s in steps if {"decode"} <= {x["kind"] for x in recs[s]["scheduled"]}
             and {"prefill_chunk", "final_prefill_chunk"} & {x["kind"] for x in recs[s]["scheduled"]}]
    m = mixed[0] if mixed else steps[0]
    pi = mrs[m]["prepare_inputs"]
    b_chunks = [(s, x) for s in steps for x in recs[s]["scheduled"] if x["request_id"] == "B" and x["kind"] != "decode"]
    a_chunks = [(s, x) for s in steps for x in recs[s]["scheduled"] if x["request_id"] == "A" and x["kind"] != "decode"]
    a_decode = next(s for s in steps if any(x["request_id"] == "A" and x["kind"] == "decode"
                                            for x in recs[s]["scheduled"]))
    say(f"""Steps {a_chunks[0][0]}-{a_chunks[-1][0]}: A was alone, and still its {prompt_len['A']}-token prompt went
         in chunks of at most {THRESHOLD} ({', '.join(str(x['num_tokens']) for _, x in a_chunks)}) although the budget
         had {BUDGET}: in vLLM v0.27.1 long_prefill_token_threshold caps every prefill chunk, a lone
         request's too (later vLLM versions let a request that is alone take the whole budget). From
         step {a_decode} on, A was RUNNING and was served first every step (1 decode token), then the
         budget that was left went to the waiting prompts, each capped at {THRESHOLD} tokens by the
         threshold or by what remained of the {BUDGET}. B's {prompt_len['B']} tokens took {len(b_chunks)} chunks:
         {', '.join(str(x['num_tokens']) for _, x in b_chunks)}.""")
    say(f"""Step {m} is one forward pass over one flat batch of {sum(pi['num_scheduled_tokens'])} tokens:
         requests {pi['req_ids']} with query lengths {pi['num_scheduled_tokens']} (query_start_loc
         {pi['query_start_loc']}). A decode and several prefill chunks share the step; the scheduler
         never asked which "phase" it was in.""")

    # -- checks --------------------------------------------------------------------------------
    acct = all(sum(x["num_tokens"] for x in recs[s]["scheduled"])
               == recs[s]["token_budget_start"] - recs[s]["token_budget_end"]
               == snaps[s]["scheduler_output"]["total_num_scheduled_tokens"]
               == sum(snaps[s]["scheduler_output"]["num_scheduled_tokens"].values())
               and recs[s]["token_budget_end"] >= 0 and recs[s]["token_budget_start"] == BUDGET for s in steps)
    check(acct, f"in all {len(steps)} steps: tokens scheduled = budget start - budget end = "
                f"SchedulerOutput.total_num_scheduled_tokens <= {BUDGET}")
    over = [(s, x) for s in steps for x in recs[s]["scheduled"] if x["num_tokens"] > THRESHOLD]
    alone = all(len(recs[s]["scheduled"]) == 1 and recs[s]["num_waiting"] == 0 for s, _ in a_chunks)
    check(alone and [x["num_tokens"] for _, x in a_chunks] == [min(THRESHOLD, prompt_len["A"] - i)
                                                               for i in range(0, prompt_len["A"], THRESHOLD)],
          f"the threshold caps a lone request too (v0.27.1): A, alone, prefilled its {prompt_len['A']} tokens in "
          f"{len(a_chunks)} chunks of at most {THRESHOLD} though the budget was {BUDGET}")
    check(not over and any(x["kind"] != "decode" and x["num_tokens"] == THRESHOLD for s in steps
                           for x in recs[s]["scheduled"]),
          f"no chunk in any step exceeded long_prefill_token_threshold={THRESHOLD}")
    cont = all(
        all(b["num_computed_tokens_before"] == a["num_computed_tokens_before"] + a["num_tokens"]
            for (_, a), (_, b) in zip(ch, ch[1:]))
        and ch[0][1]["num_computed_tokens_before"] == 0
        and sum(x["num_tokens"] for _, x in ch) == prompt_len[r] and ch[-1][1]["kind"] == "final_prefill_chunk"
        and all(x["kind"] == "prefill_chunk" for _, x in ch[:-1])
        for r in LATE
        for ch in [[(s, x) for s in steps for x in recs[s]["scheduled"] if x["request_id"] == r and x["kind"] != "decode"]])
    check(cont, "chunked prefill: each late prompt's chunks start where the last one ended and add up to the prompt")
    discarded = all(
        mrs[s]["prepare_inputs"]["req_ids"].index("B") in mrs[s]["prepare_inputs"]["discard_request_indices"]
        for s, x in b_chunks if x["kind"] == "prefill_chunk")
    check(discarded and len(b_chunks) > 1,
          f"a non-final chunk samples nothing: B's row is in discard_request_indices for its "
          f"{sum(1 for _, x in b_chunks if x['kind'] == 'prefill_chunk')} partial chunks")
    a_steps = [s for s in steps if "A" in snaps[s]["scheduler_output"]["num_scheduled_tokens"]]
    dec_steps = [s for s in a_steps if s >= a_decode]
    check(all(recs[s]["scheduled"][0]["request_id"] == "A" for s in dec_steps)
          and all(x["kind"] == "decode" for s in dec_steps for x in recs[s]["scheduled"] if x["request_id"] == "A")
          and a_steps == steps[:len(a_steps)],
          f"RUNNING first: A got its decode token at the head of every step {dec_steps[0]}..{dec_steps[-1]}, "
          f"never starved")
    check(any(r["admission_stop_reason"] == "budget_exhausted" and r["num_waiting"] > 0 for r in recs.values()),
          "admission stopped with 'budget_exhausted' while a request was still waiting")
    check(bool(mixed) and 1 in pi["num_scheduled_tokens"] and max(pi["num_scheduled_tokens"]) > 1
          and pi["query_start_loc"][-1] == sum(pi["num_scheduled_tokens"]),
          f"no prefill or decode phase: {len(mixed)} steps mixed decodes with prefill chunks in one batch (e.g. step {m})")

    say(f"""The step inspector's token-budget bar shows step {m}: one decode token and the prefill
         chunks that filled the rest of the budget.""")
    dashboard_link(path, "inspector", m, tab="scheduler")
    run.close()


if __name__ == "__main__":
    main()
