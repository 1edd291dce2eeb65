"""Deferred spans (tracing/deferred_span.py) and the host-cost paths around them.

- A DeferredSpan's run-store row read from its plain values is the row of the
  LocalSpan it builds; its plain values are None exactly where a limit or a
  rare change (status, name, exception) needs the LocalSpan.
- Changes after end change nothing; the values a caller changes later do not
  reach the span; a follower's first link names its cause.
- DeferredSpanProcessor: exports in order, builds for exporters that want
  LocalSpans, passes the SDK's spans through, drops the oldest when full (one
  warning), exports everything at flush and at shutdown.
- otel._kept_attrs is local_span._kept of otel._attrs in one pass; the own-form
  traceparent parse is the propagator's; an invalid context has no headers; a
  handle's headers are made once, each caller getting its own dict.
- StepTracer.end_requests gathers a batch's step headers once and links each
  Request span to what it linked to before.
(tests/tracing/test_fast_paths.py holds the exported spans equal to the SDK's own.)
"""
from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import cast

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from vllm_anatomy.tracing import trace_context
from vllm_anatomy.tracing.deferred_span import DeferredSpan, DeferredSpanProcessor
from vllm_anatomy.tracing.local_span import LocalSpan, _kept
from vllm_anatomy.tracing.otel import OTelRecorder, _attrs, _kept_attrs
from vllm_anatomy.tracing.span_export import plain_span_to_row, span_to_row
from vllm_anatomy.tracing.step_tracer import StepTracer
from tests.tracing.test_fast_paths import Attrs


class _Keep:
    """A processor stand-in that keeps every span of ours as it ends (unbuilt)."""

    def __init__(self) -> None:
        self.spans: list = []

    def emit(self, span) -> None:
        self.spans.append(span)


def _recorder() -> tuple[OTelRecorder, _Keep]:
    rec = OTelRecorder("spans", process_kind="engine_core")
    keep = _Keep()
    # (appended, not rec.sink.add_processor: a processor of another type turns the sink's own spans off)
    rec.sink.processors.append(cast(DeferredSpanProcessor, keep))
    return rec, keep


def _drive(rec: OTelRecorder) -> None:
    """Spans of every shape the engine makes, and a few it might."""
    req = rec.start_span("llm_request", kind="server", root=True, **Attrs({"vllm_anatomy.request_id": "r0", "n": 3}))
    req.add_event("QUEUED")
    with rec.use_span(req):
        with rec.span("InputProcessor.process_inputs", **Attrs({"vllm_anatomy.request_id": "r0"})) as s:
            s.set_attribute("n", 4)                                      # set again: moves last
            s.set_attributes({"ids": [1, 2], "none": None, "t": 0.5})
            s.add_event("e", ids=(3,), flag=True)
            s.add_event("at", time_ns=123)
    headers = req.trace_headers()
    step = rec.start_span("EngineCore.step", root=True)
    with rec.use_span(step):
        step.set_attributes({"vllm_anatomy.step_id": 1, "vllm_anatomy.num_reqs": 2})
        step.add_links((headers, headers))
        with rec.span("Scheduler.schedule"):
            rec.event("admitted", **{"vllm_anatomy.num": 2})
    step.end()
    rec.start_span("Request", follows_from=headers, **Attrs({"vllm_anatomy.request_id": "r0"})).end()
    t0 = rec.now_ns()
    rec.record_span("GPU.sample", t0, t0 + 10, follows_from=step.trace_headers(), **Attrs({"vllm_anatomy.lane": "device"}))
    with rec.span("OutputProcessor.process_outputs", follows_from=step.trace_headers()):
        pass
    with pytest.raises(ValueError):
        with rec.span("GPUModelRunner._model_forward"):                 # an exception: materialised
            raise ValueError("boom")
    with rec.span("renamed"):
        trace.get_current_span().update_name("renamed.twice")
    with rec.span("mapping"):
        trace.get_current_span().set_attribute("m", {"k": [1, 2]})      # a value _kept does not keep
    req.set_attribute("gen_ai.response.finish_reasons", ["stop"])
    req.end()


def test_plain_rows_are_the_built_rows():
    rec, keep = _recorder()
    _drive(rec)
    deferred = [s for s in keep.spans if type(s) is DeferredSpan]
    # (an exception, a new name, a value _kept would not keep: built on the spot, they end as LocalSpans)
    materialised = {s.name for s in keep.spans if type(s) is LocalSpan}
    assert materialised == {"GPUModelRunner._model_forward", "renamed.twice", "mapping"}
    assert len(deferred) == 7
    for s in deferred:
        p = s.plain()
        assert p is not None
        assert plain_span_to_row(p, rec.sink.resource) == span_to_row(s.build())
    by = {s.name: s.build() for s in deferred} | {s.name: s for s in keep.spans if type(s) is LocalSpan}
    assert list(by["InputProcessor.process_inputs"].attributes.items()) == [
        ("vllm_anatomy.request_id", "r0"), ("n", 4), ("ids", (1, 2)), ("t", 0.5)]
    assert [e.name for e in by["InputProcessor.process_inputs"].events] == ["e", "at"]
    assert by["InputProcessor.process_inputs"].events[1].timestamp == 123
    assert by["Scheduler.schedule"].events[0].attributes == {"vllm_anatomy.num": 2}
    assert by["renamed.twice"].name == "renamed.twice"
    assert by["GPUModelRunner._model_forward"].status.status_code is StatusCode.ERROR
    follow = by["Request"].links[0]
    assert dict(follow.attributes) == {"opentracing.ref_type": "follows_from"} and by["Request"].parent is None
    assert all(isinstance(s, LocalSpan) for s in by.values())


def test_limits_make_plain_values_none(monkeypatch):
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "1")
    monkeypatch.setenv("OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", "1")
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "1")
    rec, keep = _recorder()
    target = rec.start_span("t", root=True)
    with rec.span("fits", a=1, b=2) as s:
        s.set_attribute("a", 3)                         # the same key again: still two
        s.add_event("e", x=1)
        s.add_link(None)
    for name, change in [("attrs", lambda s: s.set_attributes({"b": 2, "c": 3})),
                         ("events", lambda s: (s.add_event("e"), s.add_event("f"))),
                         ("event_attrs", lambda s: s.add_event("g", x=1, y=2)),
                         ("links", lambda s: s.add_links([target.trace_headers()] * 2))]:
        with rec.span(name, a=1) as s:
            change(s)
    target.end()
    spans = {s._name: s for s in keep.spans}
    assert spans["fits"].plain() is not None
    for name in ("attrs", "events", "event_attrs", "links"):
        assert spans[name].plain() is None, name
        built = spans[name].build()
        assert built.dropped_attributes + built.dropped_events + built.dropped_links + sum(
            e.dropped_attributes for e in built.events) == 1, name


def test_changes_after_end_and_later_caller_changes_do_not_reach_the_span(caplog):
    rec, keep = _recorder()
    ids = [1, 2]
    span = rec.start_span("s", root=True, ids=ids)
    raw = span.span
    raw.set_attributes({"more": ids})
    ids.append(3)                                       # the caller's list changes: the span's does not
    span.end()
    with caplog.at_level(logging.WARNING):
        raw.set_attribute("late", 1)
        raw.add_event("late")
        raw.set_status(Status(StatusCode.ERROR))
        raw.end()
    assert len(caplog.records) == 4
    built = raw.build()
    assert dict(built.attributes) == {"ids": (1, 2), "more": (1, 2)} and not built.events
    assert built.status.status_code is StatusCode.UNSET and not raw.is_recording()
    assert keep.spans == [raw]


class _Slow(SpanExporter):
    """Records what it got, in order; optionally wants DeferredSpans as they are."""

    def __init__(self, takes_deferred: bool = False) -> None:
        self.batches: list[list] = []
        self.takes_deferred_spans = takes_deferred
        self.shut = False

    def export(self, spans):
        self.batches.append(list(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.shut = True


@pytest.mark.parametrize("takes_deferred", [False, True])
def test_processor_exports_in_order_and_builds_for_exporters_that_need_it(takes_deferred):
    exporter = _Slow(takes_deferred)
    rec = OTelRecorder("spans", exporters=[exporter])
    names = [f"s{i}" for i in range(5)]
    for name in names:
        with rec.span(name):
            pass
    rec.sink.enabled = False                            # the SDK's own spans pass through too
    with rec.span("sdk"):
        pass
    rec.flush()
    got = [s for batch in exporter.batches for s in batch]
    assert [s.name for s in got] == names + ["sdk"]
    assert all(type(s) is (DeferredSpan if takes_deferred else LocalSpan) for s in got[:5])
    assert not isinstance(got[5], (DeferredSpan, LocalSpan))
    rec.shutdown()
    assert exporter.shut


def test_full_queue_drops_the_oldest_and_warns_once(caplog):
    exporter = _Slow()
    processor = DeferredSpanProcessor(exporter, max_queue_size=4, max_export_batch_size=4,
                                      schedule_delay_millis=60_000)
    rec = OTelRecorder("spans")
    rec.sink.processors.append(processor)
    # (the export lock held: a woken worker waits for it before it takes anything from the queue)
    with caplog.at_level(logging.WARNING, logger="vllm_anatomy.tracing.deferred_span"), processor._export_lock:
        for i in range(7):
            with rec.span(f"s{i}"):
                pass
        assert [s._name for s in processor.queue] == ["s3", "s4", "s5", "s6"]
    assert len([r for r in caplog.records if "queue full" in r.getMessage().lower()]) == 1
    processor.shutdown()
    assert [s.name for batch in exporter.batches for s in batch] == ["s3", "s4", "s5", "s6"] and exporter.shut
    with rec.span("after"):                             # after shutdown: dropped, nothing raised
        pass
    assert not processor.queue


def test_a_span_that_fails_to_build_fails_its_batch_only(monkeypatch, caplog):
    exporter = _Slow()
    processor = DeferredSpanProcessor(exporter, schedule_delay_millis=60_000)
    rec = OTelRecorder("spans")
    rec.sink.processors.append(processor)
    build = DeferredSpan.build

    def broken(span):
        if span._name == "bad":
            raise RuntimeError("a bug in build")
        return build(span)
    monkeypatch.setattr(DeferredSpan, "build", broken)
    for name in ("ok1", "bad"):
        with rec.span(name):
            pass
    with caplog.at_level(logging.ERROR, logger="vllm_anatomy.tracing.deferred_span"):
        processor.force_flush()                         # the batch is lost and logged, nothing raised
    assert exporter.batches == [] and any("exporting 2 spans" in r.getMessage() for r in caplog.records)
    with rec.span("ok2"):
        pass
    processor.shutdown()                                # the worker went on: later spans are exported
    assert [s.name for batch in exporter.batches for s in batch] == ["ok2"]


def test_shutdown_exports_what_is_queued_from_another_thread():
    exporter = InMemorySpanExporter()
    rec = OTelRecorder("spans", exporters=[exporter])

    def work():
        for i in range(50):
            with rec.span(f"t{i}", i=i):
                pass
    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.shutdown()
    spans = exporter.get_finished_spans()
    assert len(spans) == 150 and all(isinstance(s, LocalSpan) for s in spans)
    assert sorted(s.attributes["i"] for s in spans) == sorted(list(range(50)) * 3)


@pytest.mark.parametrize("attrs", [
    {}, {"a": 1}, {"a": 1, "b": "x", "c": 0.5, "d": True}, {"a": None}, {"a": [1, 2]}, {"a": (1.0,)},
    {"a": []}, {"a": [1, "x"]}, {"a": [True, 1]}, {"a": {"k": 1}}, {"a": [[1]]}, {"": 1}, {1: 2},
    {"a": float("nan")}, {"a": 2 ** 70}, {"a": SimpleNamespace(item=lambda: 3)},
])
def test_kept_attrs_is_kept_of_attrs(attrs):
    one_pass = _kept_attrs(attrs)
    if one_pass is not None:
        two_passes = _kept(_attrs(attrs))
        assert one_pass == two_passes and list(one_pass) == list(two_passes)
        assert all(type(a) is type(b) for a, b in zip(one_pass.values(), two_passes.values()))
    else:
        assert any(type(v) not in (str, bool, int, float) for v in attrs.values()) or "" in attrs or 1 in attrs


@pytest.mark.parametrize("traceparent", [
    "00-" + "a" * 32 + "-" + "b" * 16 + "-ff", "00-" + "a" * 32 + "-" + "b" * 16 + "-00",
    "00-" + "a" * 32 + "-" + "b" * 16 + "-0A", "00-" + "0" * 32 + "-" + "0" * 16 + "-01",
    "00-" + "a" * 32 + "-" + "b" * 16 + "-01 ", "00-" + "a" * 32 + "-" + "b" * 16 + "-01\n",
])
def test_own_form_parse_is_the_propagators(traceparent):
    carrier = {"traceparent": traceparent}
    expected = trace.get_current_span(trace_context._PROPAGATOR.extract(carrier)).get_span_context()
    got = trace_context._parse_w3c.__wrapped__(traceparent, None)
    assert (got is None) == (not expected.is_valid)
    if got is not None:
        assert got == expected and got.is_remote and got.trace_state == expected.trace_state


def test_headers_of_no_span_and_handle_headers():
    assert trace_context.headers_of(trace.INVALID_SPAN_CONTEXT) == trace_context.inject_trace_headers() == {}
    rec, _ = _recorder()
    span = rec.start_span("s", root=True)
    first = span.trace_headers()
    first["tracestate"] = "mine=1"                      # the caller's own dict
    assert span.trace_headers() == {"traceparent": first["traceparent"]}
    assert span.trace_headers() == trace_context.inject_trace_headers(trace.set_span_in_context(span.span))


def test_end_requests_links_each_request_to_its_steps_once_per_batch():
    rec, keep = _recorder()
    tracer = StepTracer(rec, snapshot_at_launch=False)
    requests = {r: SimpleNamespace(request_id=r, trace_headers=rec.start_span(r, root=True).trace_headers())
                for r in "abc"}
    tracer.scheduler = SimpleNamespace(requests=requests)
    for r in requests.values():
        with tracer.add_request(r):
            pass
    steps = []

    def step(ids, new=()):
        trace_ = tracer.start_step()
        trace_.scheduled(SimpleNamespace(num_scheduled_tokens=dict.fromkeys(ids, 1), scheduled_new_reqs=list(new),
                                         step_id=len(steps), total_num_scheduled_tokens=len(ids),
                                         finished_req_ids=(), scheduled_spec_decode_tokens={}))
        steps.append(trace_.headers()["traceparent"])
        trace_.end()
    tracer.scheduler.last_grammar_ready_req_ids, tracer.scheduler.grammar_compile_error_reqs = [], []
    step("ab", new="ab")
    step("ab")
    step("abc", new="c")
    step("abc")
    tracer.end_requests(["a", "b", "c"])
    ended = {s._name: s for s in keep.spans}
    assert ended.keys() >= {"Request"}
    requests_spans = [s.build() for s in keep.spans if s._name == "Request"]
    linked = {s.attributes["vllm_anatomy.request_id"]: [f"{lk.context.span_id:016x}" for lk in s.links[1:]]
              for s in requests_spans}
    ids = [tp.split("-")[2] for tp in steps]
    assert linked == {"a": ids, "b": ids, "c": ids[2:]}
    assert {s.attributes["vllm_anatomy.request_id"]: s.attributes["vllm_anatomy.num_steps"]
            for s in requests_spans} == {"a": 4, "b": 4, "c": 2}


class _SeesSuppression(SpanExporter):
    """Records, on every export, whether the SDK's suppression flag is set in the current context."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def export(self, spans) -> SpanExportResult:
        from opentelemetry import context as otel_context
        self.seen.append(bool(otel_context.get_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY)))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def test_exports_run_with_instrumentation_suppressed_as_the_sdks_processor():
    # NOTE: the key is OTel's private object, the one its own BatchSpanProcessor sets; an HTTP
    # exporter's instrumented client checks it and makes no spans of the export itself. If an OTel
    # release renames it, this test (and deferred_span.py's export loop) fails loudly.
    exporter = _SeesSuppression()
    processor = DeferredSpanProcessor(exporter, schedule_delay_millis=60_000)
    rec = OTelRecorder("spans")
    rec.sink.add_processor(processor)
    with rec.span("one"):
        pass
    processor.force_flush()
    assert exporter.seen and all(exporter.seen)
    processor.shutdown()
    rec.shutdown()
