"""A speculative-decoding run's trace: every snapshot decodes strictly into the contract and back
to what was stored (the spec-decode fields included), and the step spans carry the verification
totals and one `spec_decode` event per request, matching the step records."""
from __future__ import annotations

import json

import msgspec
import pytest

from vllm_anatomy.tracing import snapshots
from vllm_anatomy.tracing.reader import decode_snapshot, open_run

pytestmark = pytest.mark.model
COPY = "Repeat this sentence exactly: the small red boat sails across the quiet blue lake at dawn."


@pytest.fixture(scope="module")
def spec_run(default_model_dir, tmp_path_factory):
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(default_model_dir, trace_level="full", trace_dir=str(tmp_path_factory.mktemp("spec_trace")),
              max_model_len=512, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": COPY}], tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    llm.generate([{"prompt_token_ids": ids}, "The quick brown fox"], SamplingParams(temperature=0, max_tokens=24),
                 use_tqdm=False)
    path = llm.llm_engine.recorder.run_path
    llm.llm_engine.shutdown()
    return path


def test_snapshots_decode_strictly_and_back(spec_run):
    with open_run(spec_run) as run:
        rows = list(run.snapshots())
        assert not run.bad_rows
        for s in rows:
            record = decode_snapshot(s.kind, json.dumps(s.data))
            assert msgspec.to_builtins(record) == s.data, f"step {s.step_id} {s.kind}"
        steps = [run.step_snapshot(i) for i in run.steps()]
    verified = [v for s in steps for v in s.scheduler.step_record.spec_decode]
    assert verified and any(v.num_accepted > 0 for v in verified)
    # What was scheduled is what was verified, and the proposed drafts show up before their step.
    for prev, s in zip(steps, steps[1:]):
        scheduled = s.scheduler_output.scheduled_spec_decode_tokens
        assert {v.request_id: v.draft_token_ids for v in s.scheduler.step_record.spec_decode} == \
            {r: d for r, d in scheduled.items()}
        proposed = {r.request_id: r.spec_token_ids for r in prev.scheduler.running if r.spec_token_ids}
        for req_id, drafts in scheduled.items():
            assert proposed[req_id][:len(drafts)] == drafts
    assert isinstance(steps[0], snapshots.StepSnapshot)


def test_step_spans_carry_the_verifications(spec_run):
    assert check_step_spans(spec_run, "ngram") > 0


def test_sync_run_has_no_late_spec_decode_snapshots(spec_run):
    """Without async scheduling the step snapshot is taken after the update: it holds the
    verifications itself, and no "spec_decode" row is written."""
    with open_run(spec_run) as run:
        assert not list(run.snapshots("spec_decode"))
        assert all(run.spec_decode_snapshot(i) is None for i in run.steps())


@pytest.fixture(scope="module")
def async_draft_run(default_model_dir, tmp_path_factory):
    """Async scheduling with a draft model (the model itself): the drafts stay on the device and the
    scheduler schedules -1 placeholders for them (worker/async_spec_decode.py)."""
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(default_model_dir, trace_level="full", trace_dir=str(tmp_path_factory.mktemp("async_spec_trace")),
              max_model_len=512, async_scheduling=True,
              speculative_config={"method": "draft_model", "model": default_model_dir, "num_speculative_tokens": 3})
    llm.generate(["The quick brown fox", "Count from one to ten:"], SamplingParams(temperature=0, max_tokens=16),
                 use_tqdm=False)
    path = llm.llm_engine.recorder.run_path
    llm.llm_engine.shutdown()
    return path


def test_async_draft_model_trace_records_the_real_drafts(async_draft_run):
    """Under async scheduling the step spans carry the drafts that were verified (never the -1
    placeholders the scheduler planned with), every greedy draft of the model itself accepted.
    NOTE: the step's snapshot is taken at launch under async scheduling (step_tracer.watch), before
    the step is verified: its scheduler_output shows the placeholders and its step record no
    verifications; each step that scheduled drafts gets a late "spec_decode" snapshot with them."""
    with open_run(async_draft_run) as run:
        assert not run.bad_rows
        for s in run.snapshots():
            assert msgspec.to_builtins(decode_snapshot(s.kind, json.dumps(s.data))) == s.data
        spans = run.spans("EngineCore.step")
        proposes = run.spans("GPUModelRunner.propose_draft_token_ids")
        steps = {i: run.step_snapshot(i) for i in run.steps()}
        late = {i: run.spec_decode_snapshot(i) for i in steps}
    # Each step that scheduled drafts (placeholders at launch) has its late record, with the real
    # drafts in their place; the others have none; no step snapshot holds a verification.
    with_drafts = {i for i, s in steps.items() if s.scheduler_output.scheduled_spec_decode_tokens}
    assert with_drafts and {i for i, r in late.items() if r is not None} == with_drafts
    for i in with_drafts:
        placeholders, real = steps[i].scheduler_output.scheduled_spec_decode_tokens, \
            late[i].scheduled_spec_decode_tokens
        assert all(set(d) == {-1} for d in placeholders.values())
        assert {r: len(d) for r, d in real.items()} == {r: len(d) for r, d in placeholders.items()}
        assert all(-1 not in d for d in real.values()) and late[i].step_id == i
        # what was verified is what was scheduled (a request finished meanwhile verifies nothing)
        assert all(real[v.request_id] == v.draft_token_ids for v in late[i].spec_decode)
    assert not any(s.scheduler.step_record.spec_decode for s in steps.values())
    # The late records say what the step spans say, step for step.
    span_events = {s.attributes["vllm_anatomy.step_id"]: {e["attributes"]["vllm_anatomy.request_id"]: e["attributes"]
                                                          for e in s.events if e["name"] == "spec_decode"}
                   for s in spans}
    for i in with_drafts:
        events = span_events[i]
        assert set(events) == {v.request_id for v in late[i].spec_decode}
        for v in late[i].spec_decode:
            a = events[v.request_id]
            assert (a["vllm_anatomy.draft_token_ids"], a["vllm_anatomy.num_accepted_tokens"],
                    a["vllm_anatomy.output_token_ids"]) == (v.draft_token_ids, v.num_accepted, v.output_token_ids)
            assert a.get("vllm_anatomy.rejected_slots", []) == v.rejected_slots
    assert sum(len(r.spec_decode) for r in late.values() if r) == \
        sum(len(e) for e in span_events.values()) > 0
    assert proposes and all(p.attributes.get("vllm_anatomy.spec_decode_method") == "draft_model" for p in proposes)
    events = [e["attributes"] for s in spans for e in s.events if e["name"] == "spec_decode"]
    assert events and all(-1 not in e["vllm_anatomy.draft_token_ids"] for e in events)
    assert all(e["vllm_anatomy.num_rejected_tokens"] == 0 for e in events)
    verifying = [s for s in spans if "vllm_anatomy.spec_decode.num_drafts" in s.attributes]
    assert sum(s.attributes["vllm_anatomy.spec_decode.num_drafts"] for s in verifying) == len(events)
    assert sum(s.attributes["vllm_anatomy.spec_decode.num_accepted_tokens"] for s in verifying) == \
        sum(len(e["vllm_anatomy.draft_token_ids"]) for e in events)


def check_step_spans(run_path: str, method: str) -> int:
    """Each step span carries its verifications (totals and one event per request), as the step
    records say; returns how many steps verified drafts."""
    with open_run(run_path) as run:
        records = {}
        for i in run.steps():
            snap = run.step_snapshot(i)
            assert snap is not None and snap.scheduler.step_record is not None, f"step {i} has no step record"
            records[i] = snap.scheduler.step_record.spec_decode
        spans = {s.attributes.get("vllm_anatomy.step_id"): s for s in run.spans("EngineCore.step")}
        proposes = run.spans("GPUModelRunner.propose_draft_token_ids")
    assert proposes and all(p.attributes.get("vllm_anatomy.spec_decode_method") == method for p in proposes)
    checked = 0
    for step, verified in records.items():
        span = spans[step]
        events = [e for e in span.events if e["name"] == "spec_decode"]
        if not verified:
            assert not events and "vllm_anatomy.spec_decode.num_drafts" not in span.attributes
            continue
        assert span.attributes["vllm_anatomy.spec_decode.num_drafts"] == len(verified)
        assert span.attributes["vllm_anatomy.spec_decode.num_accepted_tokens"] == sum(v.num_accepted for v in verified)
        by_req = {e["attributes"]["vllm_anatomy.request_id"]: e["attributes"] for e in events}
        for v in verified:
            a = by_req[v.request_id]
            assert a["vllm_anatomy.draft_token_ids"] == v.draft_token_ids
            assert a["vllm_anatomy.num_rejected_tokens"] == len(v.draft_token_ids) - v.num_accepted
            assert a.get("vllm_anatomy.rejected_slots", []) == v.rejected_slots
        checked += 1
    return checked
