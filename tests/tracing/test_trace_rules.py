"""Traces as Jaeger v1.75.0 and Perfetto show them (issue 30): the rules of
tracing/trace_check.py on hand-made spans, then on every shipped sample and on
fresh runs (in one process, sync and async; three processes over HTTP; three
tensor-parallel ranks over gloo): no clock-skew warning, every span within its
parent, one trace per request, every trace a request's, a step's or the
start-up's, no partial overlap on a Perfetto track, every flow bound.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

import pytest

from vllm_anatomy.tracing.reader import open_run
from vllm_anatomy.tracing.trace_check import (WARN_DISABLED, WARN_DUPLICATE, check_run, go_duration, host_key,
                                              jaeger_warnings, perfetto_problems, strict_violations, trace_kind)

SAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "samples", "*.sqlite")))
# The command that records each shipped sample again (GPU ones on the device).
RECORD = {"h200-smollm2-full.sqlite": "python scripts/record_sample_run.py --processes 1",
          "h200-smollm2-full-3proc.sqlite": "python scripts/record_sample_run.py --processes 3",
          "cpu-smollm2-tp3-full.sqlite": "python scripts/record_sample_run.py --tp 3"}


@dataclass
class S:
    """A span as the checker reads it (SpanRow's fields it uses)."""
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    name: str = "s"
    pid: int = 1
    kind: str = "internal"
    trace_id: str = "t"
    links: list = field(default_factory=list)


# -- Jaeger's clock-skew rules ---------------------------------------------------------------
def test_go_durations():
    assert [go_duration(d) for d in (0, 850, 1_500, 35_123_000, -2_000_000, 2_500_000_000, 90_000_000_000)] == \
        ["0s", "850ns", "1.5µs", "35.123ms", "-2ms", "2.5s", "1m30s"]


def test_host_key_order():
    assert host_key({"host.id": "i", "host.ip": "1.2.3.4", "host.name": "h"}) == "i"
    assert host_key({"host.ip": ["10.0.0.1", "10.0.0.2"], "host.name": "h"}) == "10.0.0.1"
    assert host_key({"host.name": "h"}) == "h" and host_key({}) == host_key(None) == ""


def test_child_outside_its_parent_is_warned_unless_same_host():
    parent, child = S("p", None, 1000, 2000), S("c", "p", 900, 1500)       # starts 100 ns early
    unknown = jaeger_warnings([parent, child], lambda s: None)
    assert unknown == {"c": [WARN_DISABLED.format("300ns")]}              # centred: 1000 + (1000-600)/2 - 900
    # Same named host: the child inherits its parent's correction (none): no warning...
    same = jaeger_warnings([parent, child], lambda s: {"host.name": "h"})
    assert same == {}
    # ...though it does not fit: the strict rule says so whatever the hosts.
    assert [(c.span_id, p.span_id) for c, p in strict_violations([parent, child])] == [("c", "p")]
    # Another host: compared.
    other = jaeger_warnings([parent, child], lambda s: {"host.name": "a" if s.span_id == "p" else "b"})
    assert "c" in other


def test_longer_child_only_its_start_counts():
    parent = S("p", None, 1000, 2000)
    late_long = S("c", "p", 1500, 3000)          # starts inside, lasts longer: Jaeger says nothing
    early_long = S("d", "p", 500, 2500)          # starts before: corrected by the gap
    warns = jaeger_warnings([parent, late_long, early_long], lambda s: None)
    assert "c" not in warns and warns["d"] == [WARN_DISABLED.format("500ns")]
    assert {c.span_id for c, _ in strict_violations([parent, late_long, early_long])} == {"c", "d"}


def test_missing_parent_and_duplicates():
    a, b, dup = S("a", None, 0, 10), S("b", "zz", 1, 2), S("a", None, 0, 10)
    warns = jaeger_warnings([a, b, dup], lambda s: None)
    assert warns["b"] == ["parent span ID=zz is not in the trace; skipping clock skew adjustment"]
    assert warns["a"] == [WARN_DUPLICATE]


def test_warning_passes_to_same_host_descendants():
    """A corrected span hands its correction down to its children on the same host: they
    are warned too (when the correction is not applied), even if they fit."""
    root, mid, leaf = S("r", None, 0, 100), S("m", "r", 90, 150), S("l", "m", 100, 110)
    warns = jaeger_warnings([root, mid, leaf], lambda s: {"host.name": "a" if s.span_id == "r" else "b"})
    assert set(warns) == {"m", "l"} and warns["m"] == warns["l"]


def test_trace_kinds():
    assert trace_kind([S("a", None, 0, 1, name="EngineCore.step")]) == "step"
    assert trace_kind([S("a", None, 0, 1, name="EngineCore.__init__")]) == "startup"
    assert trace_kind([S("a", None, 0, 1, name="POST /v1/x", kind="server")]) == "request"
    assert trace_kind([S("a", None, 0, 1, name="llm_request", kind="server")]) == "request"
    assert trace_kind([S("a", None, 0, 1, name="MPClient._decode_output")]) == "other"


# -- Perfetto -------------------------------------------------------------------------------
def test_perfetto_overlap_and_flows():
    x = lambda name, ts, dur, tid=1: {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}  # noqa: E731
    doc = {"traceEvents": [x("a", 0, 10), x("b", 2, 3), x("c", 5, 10), x("d", 0, 10, tid=2),
                           {"ph": "s", "id": 1, "pid": 1, "tid": 2, "ts": 1.0},
                           {"ph": "f", "id": 1, "pid": 1, "tid": 3, "ts": 1.0}]}
    problems = perfetto_problems(doc)
    assert problems["overlaps"] == [((1, 1), "a", "c")]
    assert problems["unbound_flows"] == [(1, "f")]


# -- shipped samples ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", SAMPLES, ids=os.path.basename)
def test_shipped_sample(path):
    name = os.path.basename(path)
    with open_run(path) as run:
        report = check_run(run)
        recorded_before = not any(k.startswith("resource.") for k in run.meta)
    # The exporter's side holds for every run, old or new: no Perfetto track overlaps, flows bound.
    assert report.perfetto_overlaps == 0 and report.perfetto_unbound_flows == 0, report
    if recorded_before:
        pytest.xfail(f"{name} was recorded before the trace shape of issue 30 ({report.spans} spans: "
                     f"{report.jaeger_warnings} Jaeger warnings, {report.strict_violations} spans outside their "
                     f"parent, {report.single_span_traces} single-span traces, {report.other_traces} traces "
                     f"of no request, step or start-up); re-record it: {RECORD.get(name, 'scripts/record_sample_run.py')}")
    _assert_clean(report)


def _assert_clean(report, services: int | None = None) -> None:
    assert (report.jaeger_warnings, report.strict_violations, report.missing_parents) == (0, 0, 0), report.examples
    assert (report.single_span_traces, report.other_traces, report.split_requests) == (0, 0, 0), report.examples
    assert (report.perfetto_overlaps, report.perfetto_unbound_flows) == (0, 0)
    assert report.requests > 0
    if services is not None:
        assert report.services == services


# -- fresh runs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["sync", "async"])
def offline_run(default_model_dir, tmp_path_factory, request):
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(default_model_dir, trace_level="full", trace_dir=str(tmp_path_factory.mktemp("offline")),
              max_model_len=128, num_gpu_blocks_override=32, async_scheduling=request.param == "async")
    llm.generate(["The capital of France is", "One, two, three,"], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)
    # a stop string: the frontend finishes these first, then aborts them in the engine
    llm.generate(["Hello there, my", "The sky"], SamplingParams(temperature=0, max_tokens=6, stop=[" "]),
                 use_tqdm=False)
    path = llm.llm_engine.recorder.run_path
    llm.llm_engine.shutdown()
    return path


@pytest.fixture(scope="module")
def three_process_run(tmp_path_factory):
    from tests.tracing.live_runs import three_process_run as record
    return record(str(tmp_path_factory.mktemp("three")))


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    from tests.tracing.live_runs import tensor_parallel_run
    return tensor_parallel_run(str(tmp_path_factory.mktemp("tp")))


def _checked(path: str, services: int) -> tuple[dict, list]:
    """(meta, spans) of a fresh run that passed every rule, with one trace per request."""
    with open_run(path) as run:
        _assert_clean(check_run(run), services=services)
        _assert_request_traces(run)
        return run.meta, run.spans()


@pytest.mark.model
def test_offline_run(offline_run):
    _checked(offline_run, services=1)


@pytest.mark.model
@pytest.mark.slow
def test_three_process_run(three_process_run):
    meta, spans = _checked(three_process_run, services=3)
    by_id = {s.span_id: s for s in spans}
    services = {s.service for s in spans}
    assert services == {"vllm_anatomy.frontend", "vllm_anatomy.engine_core", "vllm_anatomy.worker"}
    # The output path of a step is in the step's trace: engine send -> frontend decode -> processing.
    steps = {s.trace_id for s in spans if s.name == "EngineCore.step"}
    for name in ("EngineCoreProc.process_output_sockets", "MPClient._decode_output",
                 "OutputProcessor.process_outputs"):
        outs = [s for s in spans if s.name == name]
        assert outs and all(s.trace_id in steps and not s.parent_id for s in outs), name
        assert all(s.links[0]["attributes"] == {"opentracing.ref_type": "follows_from"} for s in outs)
    # The worker's spans are within the executor's, which last until the reply is read.
    for w in (s for s in spans if s.name in ("Worker.execute_model", "Worker.sample_tokens")):
        parent = by_id[w.parent_id]
        assert parent.name == w.name.replace("Worker.", "Executor.")
    # Start-up: one trace, the workers' spans in it.
    (startup,) = [s for s in spans if s.name == "EngineCore.__init__"]
    assert {s.process_kind for s in spans if s.trace_id == startup.trace_id} == {"engine_core", "worker"}
    # Every process' resource is kept, per the semantic conventions.
    resources = [v for k, v in meta.items() if k.startswith("resource.")]
    assert len(resources) == 3 and all({"service.name", "service.instance.id", "process.pid", "host.name",
                                        "telemetry.sdk.name"} <= r.keys() for r in resources)


@pytest.mark.model
@pytest.mark.slow
def test_tensor_parallel_run(tp_run):
    meta, spans = _checked(tp_run, services=2)
    ranks = {p["pid"]: p["rank"] for p in meta["ranks"]}
    by_id = {s.span_id: s for s in spans}
    # Rank 0 replies: its Worker spans are the executor's children; the others follow from them.
    for w in (s for s in spans if s.name in ("Worker.execute_model", "Worker.sample_tokens")):
        if ranks[w.pid] == 0:
            assert by_id[w.parent_id].name == w.name.replace("Worker.", "Executor.")
        else:
            assert w.parent_id is None and by_id[w.links[0]["span_id"]].name == w.name.replace("Worker.", "Executor.")
    (startup,) = [s for s in spans if s.name == "EngineCore.__init__"]
    assert {s.pid for s in spans if s.trace_id == startup.trace_id} >= set(ranks)


def _assert_request_traces(run) -> None:
    """One trace per request: its spans in every process, and a Request span linking every
    step that scheduled it (the step spans link back)."""
    spans = run.spans()
    requests = [s for s in spans if s.name == "llm_request"]
    steps = {s.span_id: s for s in spans if s.name == "EngineCore.step"}
    for r in requests:
        rid = r.request_id
        (life,) = [s for s in spans if s.name == "Request" and s.request_id == rid]
        assert life.trace_id == r.trace_id and life.links[0]["span_id"] == r.span_id
        linked = {lk["span_id"] for lk in life.links[1:]}
        served = {sid for sid, st in steps.items() if any(lk["span_id"] == r.span_id for lk in st.links)}
        assert linked == served and served, rid
        assert [s.trace_id for s in spans if s.name == "EngineCore.add_request" and s.request_id == rid] == \
            [r.trace_id]
    # Tokenizing is part of each request's trace.
    assert sorted(s.trace_id for s in spans if s.name == "InputProcessor.process_inputs") == \
        sorted(r.trace_id for r in requests)
