"""Lesson 10: speculative decoding -- fewer rounds, longer rounds.

The article's self-test (question 5) names the trade-off: "投机解码省轮次但涨每步时间" --
speculative decoding saves rounds (engine steps) but makes each one cost more. This lesson
runs the same three prompts, greedy, three ways on the same model:

  plain          one new token per request per step;
  ngram          K = 3 drafts per request from prompt lookup (the request's own tokens: free
                 to propose, no model), verified by the target in the same forward as the
                 request's last token: 1 + K tokens per request per step;
  draft_model    K = 3 drafts from a draft model: here the target itself, so every greedy
                 draft is accepted (the upper bound); a real draft is smaller and agrees less.

From the recorded runs it reads, per run: steps per request, tokens per step, how often the
draft at each position was accepted, and the host time of a step. It checks that the tokens
are identical in all three runs (the rejection sampler only ever emits what the target would
have), that a request needs fewer steps with speculation, that the acceptance rate can only
fall from one draft position to the next, and where a rejected draft's KV slot went: the
next step writes the real token's KV into the same slot.

Run:  python lessons/10_speculative_decoding.py      (or: vllm-anatomy lesson 10)
CPU, about a minute (three engines, the draft model's own KV cache included).
"""
from __future__ import annotations

import os
import statistics
import sys

# NOTE: one intra-op thread: on a small CPU shared with other work, torch's spinning worker
# threads make every step several times slower. OMP_NUM_THREADS=2 (or more) overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (chat_prompts, check, dashboard_link, finish, greedy, make_llm, say, snapshot,  # noqa: E402
                     title)
from vllm_anatomy.tracing.reader import open_run  # noqa: E402
from vllm_anatomy.tracing.snapshots import SpecDecodeRecord  # noqa: E402

K = 3
MAX_TOKENS = 40
QUESTIONS = ["Repeat this sentence exactly: the small red boat sails across the quiet blue lake at dawn.",
             "Write the numbers from one to twenty as words, separated by commas.",
             "What is the capital of France?"]
NAMES = ["copy", "count", "capital"]


def speculative_configs(model_dir: str) -> dict[str, dict | None]:
    return {"plain": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 4},
            "draft_model": {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K}}


def record(name: str, speculative_config: dict | None) -> tuple[str, list[list[int]]]:
    # NOTE: max_model_len 1024: a draft model keeps its own K and V in every block, so a
    # block costs twice the bytes and the CPU's fixed KV budget holds half as many.
    llm = make_llm(max_model_len=1024, speculative_config=speculative_config)
    prompts = [{**p, "prompt": n} for p, n in zip(chat_prompts(llm, QUESTIONS), NAMES)]
    engine = llm.llm_engine
    for req_id, prompt in zip(NAMES, prompts):
        engine.add_request(req_id, {"prompt_token_ids": prompt["prompt_token_ids"]}, greedy(MAX_TOKENS))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    return finish(llm), [outputs[n] for n in NAMES]


def read(path: str) -> dict:
    """Per-run facts from the run store: steps per request, verifications, step times.

    NOTE: a step's verifications (SpecDecodeRecords) are read with Run.verified_drafts, as the
    step inspector reads them: a synchronous run keeps them in the step's step_record.spec_decode;
    with async scheduling the step snapshot is taken at launch, before the step is verified, and
    they come in a late "spec_decode" snapshot."""
    run = open_run(path)
    steps_of: dict[str, int] = {n: 0 for n in NAMES}
    verifications: list[SpecDecodeRecord] = []
    spec_steps: dict[int, list[SpecDecodeRecord]] = {}
    for step in run.steps():
        snap = snapshot(run, step)
        for req_id in snap["scheduler_output"]["num_scheduled_tokens"]:
            steps_of[req_id] = steps_of.get(req_id, 0) + 1
        records = run.verified_drafts(step)
        verifications += records
        if records:
            spec_steps[step] = records
    step_ms = [s.duration_ns / 1e6 for s in run.spans("EngineCore.step")]
    return {"run": run, "steps_of": steps_of, "verifications": verifications, "spec_steps": spec_steps,
            "num_steps": len(run.steps()), "step_ms": step_ms}


def acceptance_per_position(verifications: list[SpecDecodeRecord]) -> list[float]:
    rates = []
    for pos in range(K):
        drafted = [v for v in verifications if len(v.draft_token_ids) > pos]
        rates.append(sum(v.num_accepted > pos for v in drafted) / len(drafted) if drafted else 0.0)
    return rates


def main() -> None:
    title("Lesson 10: speculative decoding -- fewer rounds, longer rounds")
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    configs = speculative_configs(str(ensure_default_model()))
    paths, tokens, facts = {}, {}, {}
    for name, config in configs.items():
        paths[name], tokens[name] = record(name, config)
        facts[name] = read(paths[name])

    say(f"""Three requests ({', '.join(NAMES)}), up to {MAX_TOKENS} greedy tokens each, three engines.
         Without speculation every step gives each request one token; with K = {K} each request
         that has drafts is scheduled 1 + {K} tokens (its last token and the drafts) inside the
         same token budget, the forward computes logits at all of them, and the rejection sampler
         keeps the drafts up to the first one the target disagrees with, plus one token of the
         target's own: 1 to {K + 1} tokens per step.""")
    check(tokens["ngram"] == tokens["plain"] and tokens["draft_model"] == tokens["plain"],
          "the three runs produced exactly the same tokens (greedy verification keeps only the target's choices)")

    print()
    print(f"  {'run':<12} {'steps':>6} {'tokens':>7} {'tokens/step':>12}  steps per request ({', '.join(NAMES)})"
          f"   accepted at position 1..{K}   host ms per step (median)")
    for name in configs:
        f = facts[name]
        n_tokens = sum(len(t) for t in tokens[name])
        per_request = [f["steps_of"][n] for n in NAMES]
        rates = acceptance_per_position(f["verifications"]) if f["verifications"] else []
        f["rates"] = rates
        f["tokens_per_step"] = n_tokens / f["num_steps"]
        print(f"  {name:<12} {f['num_steps']:>6} {n_tokens:>7} {f['tokens_per_step']:>12.2f}  {per_request!s:<36}"
              f"   {' '.join(f'{r:.2f}' for r in rates) or '-':<24}   {statistics.median(f['step_ms']):.0f}")
    print()
    plain, ngram, draft = facts["plain"], facts["ngram"], facts["draft_model"]
    say(f"""Rounds: the draft model (always right here) needs {draft['num_steps']} steps where the plain
         engine needs {plain['num_steps']}: up to {K + 1} tokens per request per step. Prompt lookup pays
         off where the output repeats the prompt (the copy request: {ngram['steps_of']['copy']} steps instead
         of {plain['steps_of']['copy']}) and barely elsewhere: it only proposes when the last tokens
         occurred before, and a wrong guess costs a rejected position, not a wrong token.""")
    check(all(ngram["steps_of"][n] <= plain["steps_of"][n] and draft["steps_of"][n] <= plain["steps_of"][n]
              for n in NAMES) and draft["num_steps"] < plain["num_steps"],
          f"no request needs more steps with speculation; with always-accepted drafts the run takes "
          f"{draft['num_steps']} steps instead of {plain['num_steps']}")
    check(all(a >= b for f in (ngram, draft) for a, b in zip(f["rates"], f["rates"][1:])),
          "acceptance can only fall with the draft position (a draft counts only if every one before it was kept)")
    check(draft["rates"] == [1.0] * K and 0 < ngram["rates"][0] < 1,
          f"the target accepts its own greedy drafts at every position; prompt lookup's first draft is "
          f"accepted {ngram['rates'][0]:.0%} of the time")
    say(f"""Time, the other way: the median step took {statistics.median(plain['step_ms']):.0f} ms plain,
         {statistics.median(ngram['step_ms']):.0f} ms with ngram (a forward over 1 + {K} tokens per request, and a
         search of each request's tokens on the host) and {statistics.median(draft['step_ms']):.0f} ms with the
         draft model (the same verification, plus {K} forward passes of the draft: its first pass over the
         tokens just verified, then {K - 1} one-token steps). Fewer rounds, each one longer: speculation
         wins when a step's fixed cost dominates (a GPU at small batch, memory-bound: verifying 4 tokens
         costs about as much as 1) and the drafts are usually right; on a busy batch or a CPU, where a
         forward's cost grows with its tokens, it can lose. bench/spec_decode.py measures both on a GPU.""")

    print()
    # Where a rejected draft's slot went: the next step computes that position again.
    run = ngram["run"]
    step, rec = next(((s, r) for s, recs in sorted(ngram["spec_steps"].items()) for r in recs
                      if r.num_accepted < len(r.draft_token_ids)), (None, None))
    check(step is not None, "prompt lookup proposed at least one draft the target rejected")
    assert step is not None and rec is not None
    req = rec.request_id
    first_rejected = rec.first_draft_position + rec.num_accepted
    nxt = next(s for s in run.steps() if s > step and req in snapshot(run, s)["scheduler_output"]["num_scheduled_tokens"])
    pi = snapshot(run, nxt, "model_runner")["prepare_inputs"]
    row = pi["req_ids"].index(req)
    start = pi["query_start_loc"][row]
    say(f"""Step {step}, request "{req}": drafts {rec.draft_token_ids} at positions
         {rec.first_draft_position}..{rec.first_draft_position + len(rec.draft_token_ids) - 1}; the target
         kept {rec.num_accepted} and emitted {rec.output_token_ids} (the last one is its own token). The
         rejected drafts' keys and values had already been written, to slots {rec.rejected_slots}: they stay
         the request's, num_computed_tokens is rolled back to {first_rejected}, and step {nxt} computes position
         {pi['positions'][start]} again -- with the real token -- into slot {pi['slot_mapping'][start]}.""")
    check(pi["positions"][start] == first_rejected and pi["slot_mapping"][start] == rec.rejected_slots[0],
          f"the first rejected draft's slot {rec.rejected_slots[0]} is rewritten by step {nxt} at position "
          f"{first_rejected}")
    print()
    say(f"""The step inspector at step {step} of the ngram run shows the request's drafts, which were
         accepted, and the slots of the rejected ones (Worker tab).""")
    dashboard_link(paths["ngram"], "inspector", step, tab="worker", request=req)
    for f in facts.values():
        f["run"].close()


if __name__ == "__main__":
    main()
