"""Lesson 2: the request state machine, every transition provoked for real.

    WAITING -> RUNNING -> PREEMPTED -> (back in the waiting queue) -> RUNNING -> ... -> FINISHED_*

One engine with a deliberately tiny KV cache (6 usable blocks of 16 tokens) runs:

* four requests that cannot all stay resident: one is admitted late (WAITING), one is
  preempted (RUNNING -> PREEMPTED, its blocks freed, requeued at the front) and resumed;
* one of them aborted while RUNNING (llm.llm_engine.abort_request) -> FINISHED_ABORTED;
* the others run to max_tokens -> FINISHED_LENGTH_CAPPED;
* a request ended by a stop token -> FINISHED_STOPPED;
* a prompt longer than max_model_len: the offline API refuses it outright; sent straight
  to EngineCore.add_request (as vLLM's scheduler would receive it) it ends FINISHED_IGNORED
  without ever being scheduled.

Each transition is then checked from the recorded step snapshots and request spans.

Run:  python lessons/02_state_machine.py      (or: vllm-anatomy lesson 2)
CPU, about 15-20 s.
"""
from __future__ import annotations

import os
import sys
import time

# NOTE: one intra-op thread: on a small CPU shared with other work, torch's spinning worker
# threads make every step several times slower. OMP_NUM_THREADS=2 (or more) overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (check, dashboard_link, finish, fixed_len, greedy, make_llm, say, snapshot,  # noqa: E402
                     title)
from vllm_anatomy.core.request import RequestStatus  # noqa: E402
from vllm_anatomy.engine.protocol import EngineCoreRequest  # noqa: E402
from vllm_anatomy.tracing.reader import open_run  # noqa: E402

MAX_MODEL_LEN = 64
QUESTIONS = ["The history of the printing press began when",
             "A short explanation of how rainbows form: light",
             "In the middle of the ocean there is a small island where",
             "The recipe for a simple tomato soup starts with"]
ABORT_ID, ABORT_AFTER_TOKENS = "len-1", 3
REASON = {s: str(RequestStatus.get_finished_reason(s)) for s in
          (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
           RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_IGNORED)}




def main() -> None:
    title("Lesson 2: the request state machine")
    llm = make_llm(max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=7)
    engine, core, tok = llm.llm_engine, llm.llm_engine.engine_core, llm.get_tokenizer()

    # -- FINISHED_IGNORED: a prompt that can never fit -------------------------------------
    too_long = fixed_len(tok, "This prompt is far too long for the tiny context of this engine.", MAX_MODEL_LEN + 16)
    try:
        llm.generate([{"prompt_token_ids": too_long}], greedy(4), use_tqdm=False)
        refused = None
    except ValueError as e:
        refused = str(e)
    ecr = EngineCoreRequest(request_id="too-long", prompt_token_ids=too_long,
                            sampling_params=greedy(4), arrival_time=time.time())
    ignored = core.preprocess_add_request(ecr)
    core.add_request(ignored)                       # what the scheduler sees, bypassing the frontend
    status_on_arrival = ignored.status
    ignored_outputs, _ = core.step()                # one step: the scheduler reports it finished
    ignored_eco = [o for outs in ignored_outputs.values() for o in outs.outputs if o.request_id == "too-long"]

    # -- WAITING / RUNNING / PREEMPTED / ABORTED / LENGTH_CAPPED -------------------------------
    prompts = {f"len-{i}": fixed_len(tok, q, 20) for i, q in enumerate(QUESTIONS)}
    for req_id, ids in prompts.items():
        engine.add_request(req_id, {"prompt_token_ids": ids}, greedy(16, ignore_eos=True))
    finished, abort_step = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        live = core.scheduler.requests.get(ABORT_ID)
        if abort_step is None and live is not None and live.status == RequestStatus.RUNNING \
                and live.num_output_tokens >= ABORT_AFTER_TOKENS:
            engine.abort_request([ABORT_ID])        # the user cancels it mid-generation
            abort_step = core.scheduler.current_step

    # -- FINISHED_STOPPED: stop on a token we know greedy decoding will produce -------------
    # (The third token, or the first later one that is not EOS: EOS would stop it anyway.)
    stop_token = next(t for t in finished["len-0"].outputs[0].token_ids[2:] if t != tok.eos_token_id)
    engine.add_request("stop-0", {"prompt_token_ids": prompts["len-0"]},
                       greedy(16, stop_token_ids=[stop_token]))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    path = finish(llm)

    # -- read it back ----------------------------------------------------------------------------
    run = open_run(path)
    steps = run.steps()
    snaps = {s: snapshot(run, s) for s in steps}
    spans = {s.request_id: s for s in run.requests()}
    all_ids = list(prompts) + ["stop-0"]

    def status(req_id: str, step: int) -> str | None:
        sched = snaps[step]["scheduler"]
        for r in sched["running"] + sched["waiting"]:
            if r["request_id"] == req_id:
                return r["status"]
        return None

    def finish_reason(req_id: str) -> str | None:
        ev = [e for e in spans[req_id].events if e["name"] == "FINISHED"]
        return ev[-1]["attributes"].get("vllm_anatomy.finish_reason") if ev else None

    letter = {"WAITING": "W", "RUNNING": "R", "PREEMPTED": "P", None: "."}
    print(f"  status after each step (W waiting, R running, P preempted, . not there); "
          f"KV cache: {snaps[steps[0]]['scheduler']['kv_cache']['num_gpu_blocks'] - 1} usable blocks\n")
    print("    step      " + "".join(f"{s % 100:>3}" for s in steps))
    for req_id in ["too-long"] + all_ids:
        print(f"    {req_id:9} " + "".join(f"{letter[status(req_id, s)]:>3}" for s in steps)
              + f"   -> {finish_reason(req_id) if req_id in spans else 'ignored'}")
    print()

    preempt_steps = [s for s in steps if snaps[s]["scheduler"]["step_record"]["preempted_req_ids"]]
    p_step = preempt_steps[0] if preempt_steps else None
    victim = snaps[p_step]["scheduler"]["step_record"]["preempted_req_ids"][0] if p_step else None
    resume_step = next((s for s in steps if p_step and s > p_step and any(
        x["request_id"] == victim and x["kind"] == "resumed"
        for x in snaps[s]["scheduler"]["step_record"]["scheduled"])), None)
    wait_steps = [s for s in steps if snaps[s]["scheduler"]["step_record"]["admission_stop_reason"] == "no_free_blocks"]
    late = next((r["request_id"] for s in wait_steps for r in snaps[s]["scheduler"]["waiting"]
                 if r["status"] == "WAITING"), None)
    late_admit = next((s for s in steps if late and status(late, s) == "RUNNING"), None)

    resume_hit = next((h["num_hit_tokens"] for h in snaps[resume_step]["scheduler"]["step_record"]["prefix_hits"]
                       if h["request_id"] == victim), 0) if resume_step else 0
    resume_tokens = next((h["num_query_tokens"] for h in snaps[resume_step]["scheduler"]["step_record"]["prefix_hits"]
                          if h["request_id"] == victim), "?") if resume_step else "?"
    victim_blocks = set(snaps[p_step - 1]["scheduler"]["kv_cache"]["req_to_block_ids"].get(victim, [])) \
        if p_step and p_step - 1 in snaps else set()
    reused = sorted(victim_blocks & {b for s in steps if p_step and resume_step and p_step <= s < resume_step
                                     for e in snaps[s]["block_pool_events"] if e["kind"] == "allocate"
                                     for b in e["block_ids"]})
    made_room = (f", when aborting {ABORT_ID} after step {abort_step} had freed its blocks"
                 if abort_step is not None and late_admit == abort_step + 1 else "")
    resume_note = (f"{resume_hit} of them came back as prefix-cache hits on its own freed blocks" if resume_hit else
                   f"none came back from the prefix cache: while it waited, its freed blocks {reused} were "
                   f"handed to the requests that kept running")
    say(f"""The offline API refused the {len(too_long)}-token prompt before it reached the engine
         ({(refused or 'NOT refused')[:70]}...). Handed straight to EngineCore.add_request, the
         scheduler marked it {status_on_arrival.name} on arrival and reported it finished
         ("{ignored_eco[0].finish_reason if ignored_eco else '?'}") after one step, without
         scheduling a single token.""")
    say(f"""The four 20-token requests each need 3 blocks to reach 36 tokens; there are 6 blocks.
         Admission requires the whole prompt to fit, so {late} waited (WAITING, admission stopped
         with "no_free_blocks") until step {late_admit}{made_room}. At step {p_step} a running request could not
         grow: the scheduler preempted the most recently admitted one, {victim}, freed its blocks and
         put it back at the front of the waiting queue with num_computed_tokens reset to 0. It was
         resumed at step {resume_step}. While it waited, the snapshot shows it in the waiting queue
         still labelled PREEMPTED: that is the PREEMPTED -> WAITING edge, and the label tells the
         scheduler to resend its whole token list to the worker. Resuming means recomputing the
         {resume_tokens} tokens it had (prompt plus outputs); {resume_note}. We aborted {ABORT_ID} after
         step {abort_step}; the others ran to max_tokens=16. Finally stop-0, the prompt of len-0 with
         stop_token_ids=[{stop_token}] (a token len-0 produced early under greedy decoding), stopped after
         {len(finished['stop-0'].outputs[0].token_ids) if 'stop-0' in finished else '?'} tokens.""")

    # -- checks ---------------------------------------------------------------------------------
    check(refused is not None and "maximum model length" in refused,
          f"the offline API refuses a {len(too_long)}-token prompt (max_model_len={MAX_MODEL_LEN}) up front")
    never_queued = all(status("too-long", s) is None for s in steps) and not any(
        "too-long" in snaps[s]["scheduler_output"]["num_scheduled_tokens"] for s in steps)
    told_worker = any("too-long" in snaps[s]["scheduler_output"]["finished_req_ids"] for s in steps)
    check(status_on_arrival == RequestStatus.FINISHED_IGNORED and never_queued and told_worker
          and bool(ignored_eco) and str(ignored_eco[0].finish_reason) == REASON[RequestStatus.FINISHED_IGNORED],
          "WAITING -> FINISHED_IGNORED: the over-long prompt is finished on arrival, never queued or scheduled")
    check(late is not None and late_admit is not None and status(late, wait_steps[0]) == "WAITING",
          f"WAITING -> RUNNING: {late} waited (admission stopped: no_free_blocks) and ran from step {late_admit}")
    before = status(victim, p_step - 1) if p_step and victim and p_step - 1 in snaps else None
    at = next((r for r in snaps[p_step]["scheduler"]["waiting"] if r["request_id"] == victim), None) if p_step else None
    check(p_step is not None and at is not None and before == "RUNNING" and at["status"] == "PREEMPTED" and at["block_ids"] == []
          and at["num_computed_tokens"] == 0 and snaps[p_step]["scheduler"]["waiting"][0]["request_id"] == victim
          and victim not in snaps[p_step]["scheduler"]["kv_cache"]["req_to_block_ids"],
          f"RUNNING -> PREEMPTED at step {p_step}: {victim} lost its blocks and progress, first in the waiting queue")
    ev = [e["name"] for e in spans[victim].events] if victim in spans else []
    check(resume_step is not None and "PREEMPTED" in ev and "SCHEDULED" in ev[ev.index("PREEMPTED"):],
          f"PREEMPTED -> RUNNING: {victim} resumed at step {resume_step} (span events {ev})")
    ab_next = abort_step + 1 if abort_step is not None else None
    check(abort_step is not None and status(ABORT_ID, abort_step) == "RUNNING" and ab_next is not None and ab_next in snaps
          and ABORT_ID in snaps[ab_next]["scheduler_output"]["finished_req_ids"]
          and status(ABORT_ID, ab_next) is None
          and ABORT_ID not in snaps[ab_next]["scheduler"]["kv_cache"]["req_to_block_ids"]
          and finish_reason(ABORT_ID) == REASON[RequestStatus.FINISHED_ABORTED],
          f"RUNNING -> FINISHED_ABORTED: {ABORT_ID} was running at step {abort_step}, freed and reported finished next step")
    capped = [r for r in prompts if r != ABORT_ID]
    check(all(finish_reason(r) == REASON[RequestStatus.FINISHED_LENGTH_CAPPED]
              and len(finished[r].outputs[0].token_ids) == 16 for r in capped),
          f"RUNNING -> FINISHED_LENGTH_CAPPED: {', '.join(capped)} stopped at max_tokens=16")
    stop_out = finished.get("stop-0")
    check(stop_out is not None and finish_reason("stop-0") == REASON[RequestStatus.FINISHED_STOPPED]
          and stop_out.outputs[0].token_ids[-1] == stop_token and stop_out.outputs[0].stop_reason == stop_token
          and len(stop_out.outputs[0].token_ids) < 16,
          f"RUNNING -> FINISHED_STOPPED: stop-0 ended on stop token {stop_token} "
          f"after {len(stop_out.outputs[0].token_ids) if stop_out else '?'} tokens")
    final = snaps[steps[-1]]["scheduler"]
    check(not final["running"] and not final["waiting"] and not final["kv_cache"]["req_to_block_ids"],
          "every request reached a FINISHED_* state and every block was returned")

    say(f"""The request-journey page shows a request's QUEUED / SCHEDULED / PREEMPTED / FINISHED
         events and every step of its life, waiting ones included; the link opens it on {victim}
         at step {p_step}, the step it was preempted.""")
    dashboard_link(path, "journey", p_step, request=victim)
    run.close()


if __name__ == "__main__":
    main()
