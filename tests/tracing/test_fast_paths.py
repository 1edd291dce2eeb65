"""The host-cost fast paths of OTelRecorder record what the SDK's own path would.

- LocalSpan (tracing/local_span.py) stands in for the SDK's span where its
  default sampler would record: same names, kinds, parents, flags, trace
  state, attributes, events, links, status, limits and drop counts.
- A step's links to its requests are shared Link objects, batched into the
  span at its end; their run-store JSON is built once per request.
- W3C traceparents of our own form are parsed without the propagator.
- span_to_row's plain-dict conversions give the rows the generic ones would.
Each test drives one recorder on the fast path and one forced onto the SDK's
path (sink disabled) and compares what they exported.
"""
import json
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import Status, StatusCode

from vllm_anatomy.tracing import trace_context
from vllm_anatomy.tracing.local_span import LocalSpan
from vllm_anatomy.tracing.otel import OTelRecorder
from vllm_anatomy.tracing.recorder import InMemoryRecorder
from vllm_anatomy.tracing.span_export import span_to_row
from vllm_anatomy.tracing.store import to_json

# NOTE: span attributes are named like "vllm_anatomy.request_id", no Python identifiers, so they
# reach `**attrs` as `**{...}`; mypy checks such a dict's values against every named parameter
# of the call (start_ns: int | None, links: list | None, ...), a dict[str, Any] against none.
# `**Attrs({...})` is that dict, typed so.
Attrs = dict[str, Any]


def _recorder(fast: bool) -> tuple[OTelRecorder, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    rec = OTelRecorder("spans", service_name="svc", process_kind="engine_core", exporters=[exporter])
    if not fast:
        rec.sink.enabled = False            # every span through the SDK's Tracer
    return rec, exporter


def _drive(rec: OTelRecorder) -> None:
    """What the engine does, and a few things it might: every span API the recorder offers."""
    req = rec.start_span("llm_request", kind="server", **Attrs({"gen_ai.request.model": "m", "n": 3, "t": 0.5,
                                                                "flag": True, "none": None}))
    req.add_event("QUEUED")
    with rec.use_span(req):
        with rec.span("EngineCore.add_request", **Attrs({"vllm_anatomy.request_id": "r0"})):
            pass
    headers = req.trace_headers()
    other = rec.start_span("llm_request", kind="server")
    step = rec.start_span("EngineCore.step")
    with rec.use_span(step):
        with rec.span("Scheduler.schedule") as sched:
            rec.event("admitted", **{"vllm_anatomy.num": 2, "ids": [1, 2]})
            sched.set_attribute("vllm_anatomy.step_id", 1)
            sched.set_attribute("vllm_anatomy.step_id", 2)          # set again: moves last
            sched.set_attribute("vllm_anatomy.new_block_ids", [4, 5])
        step.set_attribute("vllm_anatomy.step_id", 1)
        step.add_link(headers)
        step.add_link(other.trace_headers(), **Attrs({"why": "attrs"}))
        step.add_link(other.trace_headers())
        with rec.span("Executor.execute_model") as ex:
            worker = rec.start_span("Worker.execute_model", trace_headers=ex.trace_headers())
            with rec.use_span(worker):
                with pytest.raises(ValueError):
                    with rec.span("GPUModelRunner._model_forward", **Attrs({"vllm_anatomy.cudagraph_mode": "NONE"})):
                        raise ValueError("boom")
            worker.end()
        with pytest.raises(KeyError):
            with rec.span("ok_then_error"):                          # OK is final: the error is an event only
                trace.get_current_span().set_status(Status(StatusCode.OK))
                raise KeyError("k")
        with rec.span("renamed"):
            current = trace.get_current_span()
            current.update_name("renamed.twice")
            current.set_status(StatusCode.ERROR, "described")
            current.set_status(StatusCode.UNSET)                     # never overrides
            current.set_status(Status(StatusCode.UNSET))
    step.end()
    step.add_link(headers)                                          # after end: ignored
    t0 = rec.now_ns()
    rec.record_span("GPU.sample", t0, t0 + 10, **Attrs({"vllm_anatomy.lane": "device"}))
    other.end()
    # a remote parent with a tracestate (an HTTP client's): the child carries it on
    remote = {"traceparent": f"00-{'c' * 32}-{'d' * 16}-01", "tracestate": "vendor=v1"}
    rec.start_span("EngineCore.add_request", trace_headers=remote, **Attrs({"vllm_anatomy.request_id": "r1"})).end()
    req.set_attribute("gen_ai.response.finish_reasons", ["stop"])
    req.add_event("FINISHED", **Attrs({"vllm_anatomy.finish_reason": "stop"}))
    req.end()
    req.add_event("late")                                            # after end: ignored
    req.set_attribute("late", 1)


def _view(spans) -> list[dict]:
    """What a span says, with ids replaced by the names of the spans they name."""
    name = {s.context.span_id: s.name for s in spans}
    out = []
    for s in spans:
        out.append({
            "name": s.name, "kind": s.kind.name, "parent": name.get(s.parent.span_id) if s.parent else None,
            "parent_remote": s.parent.is_remote if s.parent else None,
            "same_trace_as_parent": s.parent is None or s.parent.trace_id == s.context.trace_id,
            "flags": int(s.context.trace_flags), "trace_state": s.context.trace_state.to_header(),
            "remote": s.context.is_remote, "attributes": list(dict(s.attributes).items()),
            "dropped": (s.dropped_attributes, s.dropped_events, s.dropped_links),
            "events": [(e.name, dict(e.attributes or {}), e.dropped_attributes) for e in s.events],
            "links": [(name.get(lk.context.span_id), dict(lk.attributes or {})) for lk in s.links],
            "status": (s.status.status_code.name, s.status.description), "has_times": s.end_time >= s.start_time,
            # (each recorder is a service instance of its own: the rest of the resource is the same)
            "resource": {k: v for k, v in s.resource.attributes.items() if k != "service.instance.id"},
            "scope": s.instrumentation_scope,
        })
    return out


def _both(drive=_drive) -> tuple[tuple[ReadableSpan, ...], tuple[ReadableSpan, ...]]:
    """What the fast path exported, and what the SDK's own path did."""
    results: list[tuple[ReadableSpan, ...]] = []
    for fast in (True, False):
        rec, exporter = _recorder(fast)
        drive(rec)
        rec.shutdown()
        spans = exporter.get_finished_spans()
        assert all(isinstance(s, LocalSpan) == fast for s in spans)    # the path under test was taken
        results.append(spans)
    return results[0], results[1]


def _strip_stack(view: list[dict]) -> list[dict]:
    # NOTE: a stacktrace names the frames that recorded it: the two paths differ there only.
    for span in view:
        for _, attrs, _ in span["events"]:
            if "exception.stacktrace" in attrs:
                assert attrs["exception.message"] in attrs.pop("exception.stacktrace")
    return view


def test_local_spans_export_what_the_sdk_would():
    fast, sdk = _both()
    assert _strip_stack(_view(fast)) == _strip_stack(_view(sdk))
    by = {s.name: s for s in fast}
    assert by["GPUModelRunner._model_forward"].status.status_code.name == "ERROR"
    assert [e.name for e in by["GPUModelRunner._model_forward"].events] == ["exception"]
    assert [k for k, _ in by["Scheduler.schedule"].attributes.items()] == [
        "vllm_anatomy.step_id", "vllm_anatomy.new_block_ids"]
    assert by["Scheduler.schedule"].attributes["vllm_anatomy.new_block_ids"] == (4, 5)
    assert by["ok_then_error"].status.status_code.name == "OK" and by["ok_then_error"].events
    assert (by["renamed.twice"].status.status_code.name, by["renamed.twice"].status.description) == (
        "ERROR", "described")


def test_local_span_limits_match_the_sdk(monkeypatch):
    """Attribute, event and link limits (and value truncation) drop and count alike."""
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", "1")
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "3")

    def drive(rec):
        targets = [rec.start_span("target") for _ in range(3)]
        with rec.span("limited", a="long value", b=1) as s:
            s.set_attribute("c", 2)
            for i in range(3):
                s.add_event(f"e{i}", x=1, y="abcdef")
            for t in targets:
                s.add_link(t.trace_headers())
        for t in targets:
            t.end()

    fast, sdk = _both(drive)
    assert _view(fast) == _view(sdk)
    (limited,) = [s for s in fast if s.name == "limited"]
    assert limited.dropped_attributes == 1 and limited.dropped_events == 1 and limited.dropped_links == 1
    assert dict(limited.attributes) == {"b": 1, "c": 2}


def test_plain_attributes_become_bounded_on_the_first_value_to_clean():
    """A span's plain attribute dict turns into BoundedAttributes (same order) once a value needs more
    than a copy; until then it keeps BoundedAttributes' order and tuples too (a key set again moves last)."""
    def drive(rec):
        with rec.span("plain", a=1, b=2, ids=[1, 2], names=("x", "y"), none=[]) as s:
            s.set_attribute("a", 3)
            s.add_event("e", ids=[3], flag=True)
        with rec.span("mixed", a=1) as s:
            s.set_attribute("b", "x")
            s.set_attribute("mixed", [1, "a"])          # a sequence of two types: BoundedAttributes' to clean
            s.set_attribute("a", 3)
            s.add_event("e", mixed=[1.0, 2])
        with rec.span("mapping"):
            trace.get_current_span().set_attribute("m", {"k": [1, 2]})   # the API takes mappings too
    fast, sdk = _both(drive)
    assert _view(fast) == _view(sdk)
    by = {s.name: s for s in fast}
    assert type(by["plain"]._attributes) is dict and type(by["mixed"]._attributes) is not dict
    assert list(dict(by["plain"].attributes).items()) == [("b", 2), ("ids", (1, 2)), ("names", ("x", "y")),
                                                          ("none", ()), ("a", 3)]
    assert list(dict(by["mixed"].attributes).items()) == [("b", "x"), ("mixed", (1, "a")), ("a", 3)]


def test_attribute_count_limits_on_plain_attributes(monkeypatch):
    """Without a value-length limit scalars stay in a plain dict: the count limits still drop the oldest."""
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", "1")

    def drive(rec):
        with rec.span("s", a=1, b=2) as s:
            s.set_attribute("c", 3)
            s.add_event("e", x=1, y=2)
        with rec.span("t", a=1, b=2, c=3):
            pass
    fast, sdk = _both(drive)
    assert _view(fast) == _view(sdk)
    by = {s.name: s for s in fast}
    assert dict(by["s"].attributes) == {"b": 2, "c": 3} and by["s"].dropped_attributes == 1
    assert dict(by["t"].attributes) == {"b": 2, "c": 3} and by["t"].dropped_attributes == 1
    assert by["s"].events[0].dropped_attributes == 1


def test_other_samplers_and_unsampled_parents_go_to_the_sdk(monkeypatch):
    rec, exporter = _recorder(fast=True)
    unsampled = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-00"}
    rec.start_span("child_of_unsampled", trace_headers=unsampled).end()
    rec.shutdown()
    assert exporter.get_finished_spans() == ()                      # ParentBased drops it, as the SDK does
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    rec, exporter = _recorder(fast=True)
    assert not rec.sink.enabled
    with rec.span("dropped"):
        pass
    rec.shutdown()
    assert exporter.get_finished_spans() == ()


def test_step_links_are_shared_and_batched():
    """The same request is linked by the same Link object every step; links reach the span at its end."""
    rec, exporter = _recorder(fast=True)
    requests = [rec.start_span("llm_request") for _ in range(3)]
    headers = [r.trace_headers() for r in requests]
    for _ in range(2):
        step = rec.start_span("EngineCore.step")
        for h in headers:
            step.add_link(dict(h))                                   # equal headers, another dict
        assert not step.span.links                                   # pending until the end
        step.end()
    for r in requests:
        r.end()
    rec.shutdown()
    steps = [s for s in exporter.get_finished_spans() if s.name == "EngineCore.step"]
    assert [lk.context.span_id for lk in steps[0].links] == [r.span.get_span_context().span_id for r in requests]
    assert all(a is b for a, b in zip(steps[0].links, steps[1].links))


def test_a_repeated_headers_tuple_links_the_same_requests():
    """Steady decoding: StepTracer hands the same tuple of headers step after step; the links
    made from it are reused, and a new tuple (the batch changed) gets its own."""
    rec, exporter = _recorder(fast=True)
    requests = [rec.start_span("llm_request") for _ in range(3)]
    same = tuple(r.trace_headers() for r in requests)
    batches = [same, same, same[1:], tuple(dict(h) for h in same)]
    for headers in batches:
        step = rec.start_span("EngineCore.step")
        step.add_links(headers)
        step.end()
    rec.shutdown()
    ids = {r.span.get_span_context().span_id: i for i, r in enumerate(requests)}
    steps = [s for s in exporter.get_finished_spans() if s.name == "EngineCore.step"]
    assert [[ids[lk.context.span_id] for lk in s.links] for s in steps] == [[0, 1, 2], [0, 1, 2], [1, 2], [0, 1, 2]]


def test_step_tracer_looks_requests_up_only_when_the_batch_changes():
    """request_headers: last step's tuple while the same requests run in the same order and none is
    new (a new request may reuse a finished one's id); otherwise each request's headers afresh."""
    from types import SimpleNamespace

    from vllm_anatomy.tracing.step_tracer import StepTracer
    tracer = StepTracer(InMemoryRecorder("spans"), snapshot_at_launch=False)
    requests = {r: SimpleNamespace(trace_headers={"traceparent": r}) for r in "abc"}
    tracer.scheduler = SimpleNamespace(requests=requests)

    def step(ids, new=()):
        return tracer.request_headers(SimpleNamespace(num_scheduled_tokens=dict.fromkeys(ids, 1),
                                                      scheduled_new_reqs=list(new)))
    first = step("ab", new="ab")
    assert first == ({"traceparent": "a"}, {"traceparent": "b"})
    assert step("ab") is first
    requests["b"] = SimpleNamespace(trace_headers={"traceparent": "b2"})     # finished, id reused
    assert step("ab", new="b")[1] == {"traceparent": "b2"}
    assert step("abc", new="c") == ({"traceparent": "a"}, {"traceparent": "b2"}, {"traceparent": "c"})
    assert step("ba")[0] == {"traceparent": "b2"}


def test_links_take_the_batch_path_on_sdk_spans():
    """On an SDK span (fast path off) the pending links join its BoundedList at once;
    this pins the SDK internals that path relies on (else it falls back to add_link)."""
    rec, exporter = _recorder(fast=False)
    targets = [rec.start_span("t") for _ in range(2)]
    step = rec.start_span("EngineCore.step")
    assert type(step.span._links) is BoundedList
    for t in targets:
        step.add_link(t.trace_headers())
    step.end()
    rec.shutdown()
    (s,) = [s for s in exporter.get_finished_spans() if s.name == "EngineCore.step"]
    assert [lk.context.span_id for lk in s.links] == [t.span.get_span_context().span_id for t in targets]


def _reference_row(s) -> tuple:
    """span_to_row written the plain way (dict() of every mapping, to_json of every list)."""
    ctx, res, attrs = s.context, s.resource.attributes, dict(s.attributes or {})
    events = [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in s.events]
    links = [{"trace_id": f"{lk.context.trace_id:032x}", "span_id": f"{lk.context.span_id:016x}",
              "attributes": dict(lk.attributes or {})} for lk in s.links]
    request_id = attrs.get("vllm_anatomy.request_id")
    return (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", f"{s.parent.span_id:016x}" if s.parent else None,
            s.name, s.kind.name.lower(), s.start_time, s.end_time, to_json(attrs), to_json(events), to_json(links),
            s.status.status_code.name, res.get("service.name", ""), res.get("vllm_anatomy.process.kind", ""),
            res.get("process.pid", 0), attrs.get("vllm_anatomy.step_id"),
            str(request_id) if request_id is not None else None)


@pytest.mark.parametrize("fast", [True, False])
def test_span_rows_match_the_plain_conversion(fast):
    rec, exporter = _recorder(fast)
    _drive(rec)
    rec.shutdown()
    spans = exporter.get_finished_spans()
    for s in spans:
        assert span_to_row(s) == _reference_row(s)
    (step,) = [s for s in spans if s.name == "EngineCore.step"]
    assert [lk["attributes"] for lk in json.loads(span_to_row(step)[9])] == [{}, {"why": "attrs"}, {}]


@pytest.mark.parametrize("traceparent", [
    "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "00-" + "a" * 32 + "-" + "b" * 16 + "-03",
    "00-" + "0" * 32 + "-" + "b" * 16 + "-01", "00-" + "a" * 32 + "-" + "0" * 16 + "-01",
    "00-" + "A" * 32 + "-" + "b" * 16 + "-01", "01-" + "a" * 32 + "-" + "b" * 16 + "-01-future",
    "ff-" + "a" * 32 + "-" + "b" * 16 + "-01", " 00-" + "a" * 32 + "-" + "b" * 16 + "-01",
    "00-" + "a" * 32 + "-" + "b" * 16 + "-01-x", "00-" + "a" * 31 + "-" + "b" * 16 + "-01", "junk",
    "00-" + "1_" * 16 + "-" + "b" * 16 + "-01",
])
@pytest.mark.parametrize("tracestate", [None, "k=v"])
def test_traceparent_parse_matches_the_propagator(traceparent, tracestate):
    carrier = {"traceparent": traceparent, **({"tracestate": tracestate} if tracestate else {})}
    expected = trace.get_current_span(trace_context._PROPAGATOR.extract(carrier)).get_span_context()
    got = trace_context._parse_w3c.__wrapped__(traceparent, tracestate)
    if not expected.is_valid:
        assert got is None
    else:
        assert got == expected and got.trace_state == expected.trace_state and got.is_remote


def test_header_spellings_name_the_same_link():
    headers = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    link = trace_context.shared_link(headers)
    assert trace_context.shared_link({"TraceParent": headers["traceparent"]}) is link
    assert trace_context.shared_link({**headers, "x-other": "1"}) is link
    with_state = trace_context.shared_link({**headers, "tracestate": "k=v"})
    assert with_state is not link and with_state.context.trace_state.to_header() == "k=v"
    assert trace_context.shared_link({}) is None and trace_context.shared_link({"traceparent": "junk"}) is None


def test_add_links_is_add_link_for_each():
    """add_links (a step's batch) links what add_link would, in order, whatever the headers' shape."""
    other = {"traceparent": "00-" + "e" * 32 + "-" + "f" * 16 + "-01"}
    variants = [
        lambda hs: hs,                                               # our own: a traceparent alone
        lambda hs: hs + [None, {}, {"TraceParent": other["traceparent"]}],
        lambda hs: hs + [{**other, "tracestate": "k=v"}],
    ]
    for make in variants:
        exported = []
        for batched in (True, False):
            rec, exporter = _recorder(fast=True)
            targets = [rec.start_span("t") for _ in range(3)]
            headers = make([t.trace_headers() for t in targets])
            step = rec.start_span("EngineCore.step")
            if batched:
                step.add_links(iter(headers))
            else:
                for h in headers:
                    step.add_link(h)
            step.end()
            rec.shutdown()
            (s,) = [s for s in exporter.get_finished_spans() if s.name == "EngineCore.step"]
            index = {t.span.get_span_context().span_id: i for i, t in enumerate(targets)}
            exported.append([(index.get(lk.context.span_id, lk.context.span_id), lk.context.trace_state.to_header())
                             for lk in s.links])
        assert exported[0] == exported[1] and len(exported[0]) >= 3
    mem = InMemoryRecorder("spans")
    with mem.span("target") as t:
        headers = t.trace_headers()
    with mem.span("EngineCore.step") as step:
        step.add_links([headers, None])
    assert mem.find("EngineCore.step")[0].links == [(t.trace_id, t.span_id)]
