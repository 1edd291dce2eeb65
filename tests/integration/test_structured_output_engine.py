"""Structured output on the real default model, sync and async scheduling, recorded
at trace level full: the outputs obey their constraints, a plain request in the
same batch keeps its greedy tokens, and the run shows the article's step
timeline (§五) — the grammar bitmask built between execute_model and
sample_tokens — and the WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR state.

NOTE: the grammars are held back (a gate in front of the compile) for the first
two steps, so the waiting state is seen deterministically, not by a race with
a 10 ms compile.
"""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.sampling_params import StructuredOutputsParams
from vllm_anatomy.tracing.reader import list_runs, open_run

pytestmark = pytest.mark.model

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"},
                         "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}
CHOICES = ["red", "green", "blue"]
REGEX = r"(yes|no), because [a-z ]{1,30}\."
STRUCTURED = ("json", "choice", "regex")


def chat(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)


def requests(tok) -> dict[str, tuple[str, SamplingParams]]:
    return {
        "json": (chat(tok, "Describe Paris as JSON."),
                 SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA))),
        "choice": (chat(tok, "Pick a color."),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=8,
                                  structured_outputs=StructuredOutputsParams(choice=CHOICES))),
        "regex": (chat(tok, "Is the sea salty?"),
                  SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=REGEX))),
        "plain": (chat(tok, "Write one sentence about the sea."), SamplingParams(temperature=0, max_tokens=24)),
    }


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def run(default_model_dir, tmp_path_factory, request):
    trace_dir = str(tmp_path_factory.mktemp("traces"))
    llm = LLM(default_model_dir, trace_level="full", trace_dir=trace_dir, max_model_len=512,
              async_scheduling=request.param)
    tok = llm.get_tokenizer()
    reqs = requests(tok)
    alone = llm.generate([reqs["plain"][0]], reqs["plain"][1], use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output_manager
    gate, compile_grammar = threading.Event(), manager._create_grammar
    manager._create_grammar = lambda r: (gate.wait(60), compile_grammar(r))[1]
    for req_id, (prompt, params) in reqs.items():
        engine.add_request(req_id, prompt, params)
    final = {}
    # NOTE: bounded by time, not by steps: once the plain request is done, a step with
    # nothing to run returns at once while a grammar still compiles (in the low-priority
    # pool, slower on a loaded machine), so a step count says nothing about the time given.
    deadline = time.monotonic() + 120
    i = 0
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        if i == 2:
            gate.set()
        final.update({o.request_id: o for o in engine.step() if o.finished})
        i += 1
    engine.shutdown()
    [meta] = list_runs(trace_dir)
    with open_run(meta["path"]) as r:
        yield final, alone, r, request.param


def test_outputs_obey_their_constraints(run):
    final, alone, _, _ = run
    assert {r: final[r].outputs[0].finish_reason for r in STRUCTURED} == {r: "stop" for r in STRUCTURED}
    jsonschema.validate(json.loads(final["json"].outputs[0].text), SCHEMA)
    assert final["choice"].outputs[0].text in CHOICES
    assert re.fullmatch(REGEX, final["regex"].outputs[0].text)
    # The neighbours' bitmasks never touch a plain request's row: its greedy tokens are unchanged.
    assert list(final["plain"].outputs[0].token_ids) == list(alone)


def test_requests_waited_for_their_grammars(run):
    _, _, r, _ = run
    steps = [r.snapshot(i)["scheduler"] for i in r.steps()]
    waiting = [{q["request_id"] for q in s["skipped_waiting"] if q["status"] == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"}
               for s in steps]
    held = [i for i, w in enumerate(waiting) if w == set(STRUCTURED)]
    assert len(held) >= 2                          # held back by the gate, while the plain request ran
    assert all([q["request_id"] for q in steps[i]["running"]] == ["plain"] for i in held)
    promoted = [req for s in steps for req in s["step_record"]["grammar_ready_req_ids"]]
    assert sorted(promoted) == sorted(STRUCTURED)
    events = [(e["name"], e["attributes"]["vllm_anatomy.request_id"])
              for s in r.spans("EngineCore.step") for e in s.events]
    assert sorted(events) == sorted(("WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR -> WAITING", q) for q in STRUCTURED)
    # The compile, in each request's own trace.
    traces = {s.attributes["vllm_anatomy.request_id"]: s.trace_id for s in r.requests()}
    compiles = r.spans("StructuredOutputManager._create_grammar")
    assert sorted(s.attributes["vllm_anatomy.structured_output_type"] for s in compiles) == ["CHOICE", "JSON", "REGEX"]
    assert all(s.trace_id == traces[s.attributes["vllm_anatomy.request_id"]] for s in compiles)


def test_the_grammar_window_sits_between_execute_model_and_sample_tokens(run):
    _, _, r, is_async = run
    by_parent: dict[str, dict[str, list]] = {}
    for s in r.spans():
        by_parent.setdefault(s.parent_id, {}).setdefault(s.name, []).append(s)
    update_end = {s.attributes["vllm_anatomy.step_id"]: s.end_ns for s in r.spans("Scheduler.update_from_output")}
    windows = 0
    for step in r.spans("EngineCore.step"):
        kids = by_parent.get(step.span_id, {})
        grammar = kids.get("Scheduler.get_grammar_bitmask")
        if not grammar or not grammar[0].attributes["vllm_anatomy.num_structured_output_reqs"]:
            continue
        windows += 1
        (g,), (ex,), (sa,) = grammar, kids["Executor.execute_model"], kids["Executor.sample_tokens"]
        assert ex.end_ns <= g.start_ns <= g.end_ns <= sa.start_ns
        so = r.snapshot(step.attributes["vllm_anatomy.step_id"])["scheduler_output"]
        assert so["has_structured_output_requests"]
        if so.get("pending_structured_output_tokens"):
            # Async: the previous step's tokens advanced the grammars first.
            assert is_async and update_end[step.attributes["vllm_anatomy.step_id"] - 1] <= g.start_ns
        masked = [s for s in r.spans("GPUModelRunner.apply_grammar_bitmask") if s.trace_id == step.trace_id]
        assert [s.attributes["vllm_anatomy.num_structured_output_reqs"] for s in masked] == \
            [g.attributes["vllm_anatomy.num_structured_output_reqs"]]
    assert windows >= 10
    deferred = [r.snapshot(i)["scheduler_output"].get("pending_structured_output_tokens", False) for i in r.steps()]
    assert any(deferred) == is_async


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mp_executor(default_model_dir, run, async_scheduling):
    """Worker processes: the GrammarOutput crosses the shared-memory queue (numpy
    rows as bytes), execute_model(non_block=True) returns before the worker
    answers, and async scheduling works there too: the same tokens as in-process."""
    final = run[0]
    llm = LLM(default_model_dir, max_model_len=512, distributed_executor_backend="mp",
              async_scheduling=async_scheduling)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == async_scheduling
        reqs = requests(llm.get_tokenizer())
        greedy = ("json", "regex", "plain")
        outs = llm.generate([reqs[r][0] for r in greedy], [reqs[r][1] for r in greedy], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert {r: list(o.outputs[0].token_ids) for r, o in zip(greedy, outs)} == \
        {r: list(final[r].outputs[0].token_ids) for r in greedy}
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
