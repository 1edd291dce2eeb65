"""The typed snapshot contract (vllm_anatomy/tracing/snapshots.py) pins the engine's producers:
a freshly recorded run's every snapshot decodes strictly into its record and back into exactly the
stored JSON; the partial views are subsets of the records; docs/trace-format.md lists the records as
they are; runs of schema_version 1 are read through the upgrade."""
import functools
import json
import operator
import os
import time
import types
import typing

import msgspec
import pytest

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.sampling_params import StructuredOutputsParams
from vllm_anatomy.structured_output import StructuredOutputManager
from vllm_anatomy.tracing import snapshots
from vllm_anatomy.tracing.reader import MalformedRowError, decode_snapshot, list_runs, open_run
from vllm_anatomy.tracing.store import SCHEMA_VERSION, RunStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFIX = "You are a careful assistant for a museum of computing history. Answer briefly and precisely."
QUESTIONS = ["What is a CPU?", "Who built ENIAC?", "What is RAM?", "Name an old computer."]


# NOTE: both ways (async scheduling snapshots a step as it is launched), with what makes every
# optional part of a snapshot appear: preemption, prefix hits, chunked prefill, a structured-output
# request waiting for its grammar, finished requests.
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def recorded(default_model_dir, tmp_path_factory, request):
    trace_dir = str(tmp_path_factory.mktemp("traces"))
    # NOTE: the grammar compiles in a thread; a fast compile could finish before the first schedule
    # and the request would never wait in skipped_waiting. Slowed here so the snapshots must show it.
    compile_grammar = StructuredOutputManager._create_grammar

    def slow_compile(self, req):
        time.sleep(0.5)
        return compile_grammar(self, req)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StructuredOutputManager, "_create_grammar", slow_compile)
        return _record(default_model_dir, trace_dir, request.param)


def _record(default_model_dir, trace_dir, async_scheduling):
    llm = LLM(default_model_dir, trace_level="full", trace_dir=trace_dir, num_gpu_blocks_override=7,
              max_model_len=64, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(PREFIX) + tok.encode(" " + q)} for q in QUESTIONS]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    choice = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    # 6 usable blocks of 16 tokens, the prefix's shared: four requests growing to ~38 tokens cannot all
    # stay resident (preemption); a 40-token prompt over a 32-token budget is prefilled in chunks.
    llm.generate(prompts + [{"prompt_token_ids": tok.encode("Is ENIAC old? " * 8)}],
                 [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 4 + [choice], use_tqdm=False)
    llm.llm_engine.shutdown()
    [meta] = list_runs(trace_dir)
    return meta["path"]


def test_every_snapshot_decodes_strictly_and_back_to_what_was_stored(recorded):
    with open_run(recorded) as run:
        assert run.schema_version == SCHEMA_VERSION
        rows = list(run.snapshots())
        # (kind "spec_decode" needs drafts: tests/tracing/test_spec_decode_trace.py records it)
        assert not run.bad_rows and {s.kind for s in rows} == set(snapshots.SNAPSHOT_TYPES) - {"spec_decode"}
        for s in rows:
            record = decode_snapshot(s.kind, json.dumps(s.data))
            assert isinstance(record, snapshots.SNAPSHOT_TYPES[s.kind])
            assert msgspec.to_builtins(record) == s.data, f"step {s.step_id} {s.kind}: not what was stored"
        steps = run.steps()
        first, mr = run.step_snapshot(steps[0]), run.model_runner_snapshot(steps[0])
        assert isinstance(first, snapshots.StepSnapshot) and isinstance(mr, snapshots.ModelRunnerSnapshot)
        # the run holds what makes the optional parts appear
        records = [run.step_snapshot(i).scheduler.step_record for i in steps]
        assert any(r.preempted_req_ids for r in records) and any(r.prefix_hits for r in records)
        assert any(s.kind == "prefill_chunk" for r in records for s in r.scheduled)
        assert any(run.step_snapshot(i).scheduler.skipped_waiting for i in steps)


def test_a_producer_off_the_contract_is_refused_by_name(recorded, tmp_path):
    with open_run(recorded) as run:
        step = run.snapshot(run.steps()[0])
    step["scheduler"]["step_record"]["new_field"] = 1
    with pytest.raises(msgspec.ValidationError, match="new_field"):
        decode_snapshot("step", json.dumps(step))
    del step["scheduler"]["step_record"]["new_field"], step["scheduler"]["kv_cache"]["usage"]
    with pytest.raises(msgspec.ValidationError, match="usage"):
        decode_snapshot("step", json.dumps(step))
    store = RunStore.create(str(tmp_path), {"trace_level": "full"})
    store.write_snapshot(1, "step", "EngineCore_0", step)
    store.close()
    with open_run(store.path) as run, pytest.raises(MalformedRowError, match="step 1.*does not match the snapshot contract"):
        run.step_snapshot(1)


def test_index_views_are_subsets_of_the_records():
    for view, record in snapshots.VIEWS.items():
        hints, rec_hints = typing.get_type_hints(view), typing.get_type_hints(record)
        for name in view.__struct_fields__:
            assert name in rec_hints, f"{view.__name__}.{name} is not a field of {record.__name__}"
            mine, theirs = _mapped(hints[name], _as_record), rec_hints[name]
            assert mine in (theirs, _mapped(theirs, _as_plain)), \
                f"{view.__name__}.{name}: {hints[name]} vs {record.__name__}'s {theirs}"


def _mapped(tp, leaf):
    """tp with `leaf` applied to every type it is made of (list[X | None] -> list[leaf(X) | None])."""
    args = typing.get_args(tp)
    if not args:
        return leaf(tp)
    mapped = tuple(_mapped(a, leaf) for a in args)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return functools.reduce(operator.or_, mapped)
    return typing.get_origin(tp)[mapped]


def _as_record(tp):
    """A view as the record it views."""
    return snapshots.VIEWS.get(tp, tp)


def _as_plain(tp):
    """A record as snapshots.Plain (a view may keep a record as the plain data it was stored as)."""
    return snapshots.Plain if isinstance(tp, type) and issubclass(tp, msgspec.Struct) else tp


def test_trace_format_doc_lists_the_records_as_they_are():
    with open(os.path.join(ROOT, "docs", "trace-format.md")) as f:
        doc = f.read()
    listed = doc.split("<!-- snapshot-records:begin -->\n", 1)[1].split("<!-- snapshot-records:end -->", 1)[0]
    assert listed == snapshots.contract_markdown(), \
        "docs/trace-format.md's snapshot records differ: paste `python -m vllm_anatomy.tracing.snapshots`"


# Steps 48-56 of the H200 sample as recorded at schema_version 1 (before the typed contract; its
# spans dropped to keep it small): step 53 resumes a preempted request.
V1_RUN = os.path.join(ROOT, "tests", "tracing", "data", "run-v1-h200-steps48-56.sqlite")


def test_a_version_1_run_is_read_through_the_upgrade():
    with open_run(V1_RUN) as run:
        assert run.schema_version == 1
        steps = run.steps()
        assert steps == list(range(48, 57))
        for i in steps:
            assert isinstance(run.step_snapshot(i), snapshots.StepSnapshot)
            assert isinstance(run.model_runner_snapshot(i), snapshots.ModelRunnerSnapshot)
        assert len(run.index("step", snapshots.StepIndex)) == len(steps) and not run.bad_rows
        # v1's resumed_req_token_ids (a parallel list) becomes all_token_ids by request id
        stored = run.snapshot(53)["scheduler_output"]["scheduled_cached_reqs"]
        cached = run.step_snapshot(53).scheduler_output.scheduled_cached_reqs
        [resumed] = cached.resumed_req_ids
        assert cached.all_token_ids == {resumed: stored["resumed_req_token_ids"][stored["req_ids"].index(resumed)]}
        assert cached.new_token_ids == []


def test_version_1_scheduler_output_trace_headers_are_dropped(recorded):
    with open_run(recorded) as run:
        step = run.snapshot(run.steps()[0])
    step["scheduler_output"]["trace_headers"] = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    with pytest.raises(msgspec.ValidationError, match="trace_headers"):
        decode_snapshot("step", json.dumps(step))
    upgraded = decode_snapshot("step", json.dumps(step), schema_version=1)
    assert isinstance(upgraded, snapshots.StepSnapshot)
