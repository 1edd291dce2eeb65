"""One recorded run (level "full", into a run store) with preemption and prefix
hits: snapshot invariants at every step, and the file exports built from it."""
import json
from collections import Counter

import pytest

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.tracing.exporters import jaeger_json, otlp_json, perfetto
from vllm_anatomy.tracing.reader import list_runs, open_run
from vllm_anatomy.tracing.traced import QUIET_CALLS_ATTR

pytestmark = pytest.mark.model
PREFIX = "You are a careful assistant for a museum of computing history. Answer briefly and precisely."
QUESTIONS = ["What is a CPU?", "Who built ENIAC?", "What is RAM?", "Name an old computer."]


# NOTE: both ways: with async scheduling a step's snapshots are taken as it is
# launched (the scheduler has not seen the previous step's tokens yet), and
# the invariants must hold there too.
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def recorded(default_model_dir, tmp_path_factory, request):
    trace_dir = str(tmp_path_factory.mktemp("traces"))
    # 6 usable blocks of 16 tokens; four ~25-token prompts growing by 12 tokens
    # cannot all stay resident: preemption. A first request caches the prefix.
    llm = LLM(default_model_dir, trace_level="full", trace_dir=trace_dir, num_gpu_blocks_override=7,
              max_model_len=64, async_scheduling=request.param)
    tok = llm.get_tokenizer()
    prefix = tok.encode(PREFIX)
    prompts = [{"prompt_token_ids": prefix + tok.encode(" " + q)} for q in QUESTIONS]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    metrics = llm.get_metrics()
    llm.llm_engine.shutdown()
    [meta] = list_runs(trace_dir)
    run = open_run(meta["path"])
    yield run, metrics
    run.close()


def test_regime_and_counts(recorded):
    run, metrics = recorded
    assert metrics["vllm:num_preemptions"] > 0 and metrics["vllm:prefix_cache_hits"] > 0
    steps = run.steps()
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == metrics["vllm_anatomy:engine_steps"]
    kinds = Counter((s.kind, s.step_id) for s in run.snapshots())
    assert all(kinds[("step", i)] == 1 and kinds[("model_runner", i)] == 1 for i in steps)
    assert sorted(s.step_id for s in run.spans("EngineCore.step")) == steps
    assert run.meta["trace_level"] == "full" and run.meta["config"]["cache_config"]["num_gpu_blocks"] == 7
    records = [run.snapshot(i)["scheduler"]["step_record"] for i in steps]
    assert any(r["preempted_req_ids"] for r in records) and any(r["prefix_hits"] for r in records)
    # Every preemption counted once, sync or async: by its PREEMPTED event (all
    # requests finished, so every event reached the frontend), not per step.
    assert metrics["vllm:num_preemptions"] == sum(len(r["preempted_req_ids"]) for r in records)
    assert len(run.requests()) == 5


def _check_blocks(kv):
    owners = Counter(b for ids in kv["req_to_block_ids"].values() for b in ids)
    real = [b for b in kv["blocks"] if not b["is_null"]]
    for b in real:
        assert b["ref_cnt"] == owners[b["block_id"]], f"block {b['block_id']}: ref_cnt vs owners"
    free = kv["free_queue"]
    assert len(free) == len(set(free)) == kv["num_free_blocks"]
    assert set(free) == {b["block_id"] for b in real if b["ref_cnt"] == 0}


def _check_queues(sched):
    running, waiting = sched["running"], sched["waiting"]
    assert all(r["status"] == "RUNNING" for r in running)
    assert all(r["status"] in ("WAITING", "PREEMPTED") for r in waiting)
    assert not {r["request_id"] for r in running} & {r["request_id"] for r in waiting}
    assert len(running) <= sched["max_num_seqs"]
    for r in waiting:
        if r["status"] == "PREEMPTED":
            assert r["block_ids"] == [] and r["num_computed_tokens"] == 0


def _check_slots(mr, step, bs):
    pi, rows = mr["prepare_inputs"], {r["index"]: r for r in mr["input_batch"]["rows"]}
    scheduled = step["scheduler_output"]["num_scheduled_tokens"]
    if not scheduled:
        # Nothing to compute (async: every running request's last token in flight).
        assert pi is None and mr["sampled_token_ids"] == []
        return
    assert dict(zip(pi["req_ids"], pi["num_scheduled_tokens"])) == scheduled
    assert len(pi["slot_mapping"]) == sum(scheduled.values()) == step["scheduler_output"]["total_num_scheduled_tokens"]
    for row, pos, slot in zip(pi["req_indices"], pi["positions"], pi["slot_mapping"]):
        blocks = rows[row]["block_ids"]
        assert rows[row]["req_id"] == pi["req_ids"][row]
        assert slot == blocks[pos // bs] * bs + pos % bs
    kv_tables = step["scheduler"]["kv_cache"]["req_to_block_ids"]
    for r in step["scheduler"]["running"]:
        runner_rows = [x for x in rows.values() if x["req_id"] == r["request_id"]]
        if runner_rows:
            assert runner_rows[0]["block_ids"] == kv_tables[r["request_id"]]


def test_invariants_every_step(recorded):
    run, _ = recorded
    for i in run.steps():
        step, mr = run.snapshot(i), run.snapshot(i, "model_runner")
        kv = step["scheduler"]["kv_cache"]
        _check_blocks(kv)
        _check_queues(step["scheduler"])
        _check_slots(mr, step, kv["block_size"])


def test_jaeger_export(recorded):
    run, _ = recorded
    doc = json.loads(json.dumps(jaeger_json.export(run)))
    ids = [s["spanID"] for t in doc["data"] for s in t["spans"]]
    assert sorted(ids) == sorted(s.span_id for s in run.spans()) and len(ids) == len(set(ids))
    for t in doc["data"]:
        assert all(s["traceID"] == t["traceID"] and s["processID"] in t["processes"] for s in t["spans"])
        assert all(int(s["spanID"], 16) and len(s["traceID"]) == 32 for s in t["spans"])
        for s in t["spans"]:
            assert {"operationName", "references", "startTime", "duration", "tags", "logs"} <= s.keys()
            assert s["startTime"] > 1.6e15                       # microseconds since the epoch
    requests = [s for t in doc["data"] for s in t["spans"] if s["operationName"] == "llm_request"]
    assert len(requests) == 5 and all(lg["fields"][0]["key"] == "event" for r in requests for lg in r["logs"])


def test_otlp_json_export(recorded):
    run, _ = recorded
    doc = otlp_json.export(run)
    spans = [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert len(spans) == len(run.spans()) == len({s["spanId"] for s in spans})
    assert all(len(s["traceId"]) == 32 and int(s["startTimeUnixNano"]) > 0 for s in spans)


def test_perfetto_export(recorded):
    run, _ = recorded
    doc = json.loads(json.dumps(perfetto.export(run)))
    ev = doc["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X" and "mirror_of" not in e["args"]]
    assert sorted(e["args"]["span_id"] for e in xs) == sorted(s.span_id for s in run.spans())
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in ev if e["ph"] == "X")
    assert any(e["ph"] == "X" and e["args"].get("timing") == "host" for e in ev)   # device lane, CPU run
    counters = Counter(e["name"] for e in ev if e["ph"] == "C")
    assert set(counters.values()) == {len(run.steps())} and "KV cache usage" in counters
    starts = {e["id"] for e in ev if e["ph"] == "s"}
    assert starts and starts == {e["id"] for e in ev if e["ph"] == "f"}
    names = {e["args"]["name"] for e in ev if e["ph"] == "M"}
    assert "device" in names and any(n.startswith("request ") for n in names)


def test_kv_cache_manager_calls_inside_schedule(recorded):
    """At level full, every get_computed_blocks call, and every allocate_slots call
    that allocated a block or was refused, is a span under that step's
    Scheduler.schedule, naming its request and its result; the block ids they
    report are the ones the step's SchedulerOutput carries. The allocate_slots
    calls that allocated nothing are counted on the schedule span: with the
    spans, one successful call per scheduled request."""
    run, _ = recorded
    spans = run.spans()
    by_id = {s.span_id: s for s in spans}
    schedules = {s.span_id: s for s in spans if s.name == "Scheduler.schedule"}
    schedule_step = {sid: by_id[s.parent_id].attributes["vllm_anatomy.step_id"] for sid, s in schedules.items()}
    calls = [s for s in spans if s.name.startswith("KVCacheManager.")]
    assert {s.name for s in calls} == {"KVCacheManager.get_computed_blocks", "KVCacheManager.allocate_slots"}
    assert all(s.parent_id in schedule_step for s in calls)
    assert all(s.start_ns <= s.end_ns and by_id[s.parent_id].start_ns <= s.start_ns
               and s.end_ns <= by_id[s.parent_id].end_ns for s in calls)
    assert any(s.attributes.get("vllm_anatomy.result") == "None" for s in calls)        # the preemption
    allocs = [s for s in calls if s.name.endswith("allocate_slots")]
    assert all(s.attributes.get("vllm_anatomy.new_block_ids") or s.attributes.get("vllm_anatomy.result") == "None"
               for s in allocs), "a call that allocated nothing has no span"
    quiet_total = 0
    for sid, schedule in schedules.items():
        step = schedule_step[sid]
        so = run.snapshot(step)["scheduler_output"]
        granted = sum(1 for s in allocs if s.parent_id == sid and "vllm_anatomy.new_block_ids" in s.attributes)
        quiet = schedule.attributes[QUIET_CALLS_ATTR]
        quiet_total += quiet
        assert granted + quiet == len(so["num_scheduled_tokens"]), step
        sent = {r["req_id"]: r["block_ids"][0] for r in so["scheduled_new_reqs"]}
        for s in allocs:
            rid = s.attributes["vllm_anatomy.request_id"]
            if s.parent_id == sid and rid in sent and "vllm_anatomy.new_block_ids" in s.attributes:
                # a new request's block table = prefix hits + the blocks allocate_slots just gave it
                new = s.attributes["vllm_anatomy.new_block_ids"]
                assert sent[rid][len(sent[rid]) - len(new):] == new
    assert quiet_total > 0, "decodes inside their last block allocate nothing"


def test_async_scheduling_in_the_trace(recorded):
    """Async: consecutive step spans overlap, each step's tokens reach the host in
    a get_output span under its own step, and a decode's input token is a -1
    placeholder on the host exactly where the previous step sampled it on the
    device. Sync: none of that."""
    run, _ = recorded
    is_async = run.meta["config"]["scheduler_config"]["async_scheduling"]
    steps = {s.step_id: s for s in run.spans("EngineCore.step")}
    gets = run.spans("AsyncGPUModelRunnerOutput.get_output")
    placeholders = 0
    for i in run.steps()[1:]:
        pi, prev = run.snapshot(i, "model_runner")["prepare_inputs"], run.snapshot(i - 1, "model_runner")
        if pi is None:
            continue
        sampled_prev = dict(zip([r["req_id"] for r in prev["input_batch"]["rows"]], prev["sampled_token_ids"]))
        for req_id, end in zip(pi["req_ids"], pi["cu_num_tokens"]):
            if pi["input_ids"][end - 1] == -1:
                placeholders += 1
                assert sampled_prev.get(req_id), f"step {i}: {req_id} waits on a token step {i - 1} did not sample"
    if not is_async:
        assert not gets and placeholders == 0
        assert all(steps[i].start_ns >= steps[i - 1].end_ns for i in steps if i - 1 in steps)
        return
    assert placeholders > 0
    assert any(steps[i].start_ns < steps[i - 1].end_ns for i in steps if i - 1 in steps)
    nonempty = [i for i in run.steps() if run.snapshot(i)["scheduler_output"]["total_num_scheduled_tokens"]]
    assert sorted(g.attributes["vllm_anatomy.step_id"] for g in gets) == nonempty
    for g in gets:
        assert g.parent_id == steps[g.attributes["vllm_anatomy.step_id"]].span_id
        assert g.attributes["vllm_anatomy.sync_wait_ms"] >= 0
