"""The Recorder seam: how every orchestration layer reports what it does.

One object is injected (a constructor argument, never a global). It offers
    span(name, links=None, **attrs)       context manager timing a piece of work
                                          (links: trace-header dicts of other spans)
    record_span(name, start_ns, end_ns)   a span with explicit times on now_ns()'s
                                          clock (device lane, resolved after a sync)
    start_span(name, ...) -> handle       a long-lived span that is not "current"
                                          (one per request); use_span(handle) nests under it
    parent= / follows_from=               (keywords of the three) an explicit parent
                                          handle; or the span that caused this one, when
                                          nothing waits for it: see "Followers" below
    remote_parent(headers, follows)       inside: the caller named by W3C headers (another
                                          process) is the parent (or the cause) of new spans
    step_scope(handle) / current_step()   the engine step being worked on, for the device
                                          lane's GPU.step span (tracing/device_timer.py)
    event(name, **attrs)                  a point in time on the current span
    snapshot(kind, data, step_id)         plain, JSON-able state (level "full" only)
    inject_trace_headers()                W3C traceparent of the current span
    step_tracer(snapshot_at_launch)       EngineCore's one tracing object (tracing/step_tracer.py)
    flush() / shutdown()                  drain exporters
`NullRecorder` is the default and costs one attribute lookup and a no-op call;
`InMemoryRecorder` keeps everything in lists for tests and lessons. The
OpenTelemetry-backed recorder lives in tracing/otel.py and is the only place
that imports OpenTelemetry (with local_span.py).

Followers. A span lies within its parent (Jaeger warns on every span that
does not, and Perfetto cannot nest it). Work that another span caused but that
nothing waits for (the engine's half of a request the frontend already
finished, a step's outputs on their way to the frontend, a tensor-parallel rank
that does not reply) may outlive its cause: such a span *follows from* it. It
joins its cause's trace without a parent, its first link naming the cause: what
Jaeger calls a FOLLOWS_FROM reference (its UI draws the span under the cause and
checks no containment). `follows_from` takes the cause's W3C headers or handle.

NOTE: the pure core (Scheduler, KVCacheManager, BlockPool, Request) never sees
a Recorder. It returns records and exposes snapshot(); the orchestration layers
(EngineCore, Executor, GPUModelRunner, ...) decide what to record.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple, TypeAlias

if TYPE_CHECKING:
    from vllm_anatomy.tracing.step_tracer import NullStepTracer, StepTracer

LEVELS = ("off", "spans", "full")


class StepRef(NamedTuple):
    """The engine step a piece of work belongs to (Recorder.current_step)."""
    headers: dict[str, str]      # W3C headers of its EngineCore.step span
    follows: bool                # nothing waits for this process' part of it: follow, do not nest


class Recorder:
    level: str = "off"
    # The run store file this recorder writes (None without trace_dir): other
    # processes of the same run attach to it.
    run_path: str | None = None

    @property
    def enabled(self) -> bool:
        return self.level != "off"

    @property
    def wants_snapshots(self) -> bool:
        return self.level == "full"

    def span(self, name: str, links: list[dict] | None = None, *, follows_from: "Cause" = None,
             **attrs: Any) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def record_span(self, name: str, start_ns: int, end_ns: int, *, parent: "SpanHandle | None" = None,
                    follows_from: "Cause" = None, **attrs: Any) -> "SpanHandle":
        """A finished span; returns its handle (for its trace_headers())."""
        raise NotImplementedError

    def start_span(self, name: str, trace_headers: dict | None = None, kind: str = "internal",
                   start_ns: int | None = None, *, parent: "SpanHandle | None" = None,
                   follows_from: "Cause" = None, root: bool = False, **attrs: Any) -> "SpanHandle":
        """parent: this handle; else the span named by trace_headers; else the current one
        (root: none, a new trace). follows_from (instead of a parent): see "Followers" in
        the module docstring."""
        raise NotImplementedError

    def remote_parent(self, trace_headers: dict | None, follows: bool = False,
                      step_headers: dict | None = None) -> contextlib.AbstractContextManager:
        """Inside: the span named by `trace_headers` (a caller in another process) is the
        parent of the spans started without one (follows: their cause); `step_headers`
        name the engine step the call works for (current_step())."""
        return contextlib.nullcontext()

    # The engine step being worked on (step_scope; in a worker, remote_parent's step_headers).
    _step: "StepRef | None" = None

    def step_scope(self, handle: "SpanHandle") -> contextlib.AbstractContextManager:
        """Inside: `handle` (an EngineCore.step span) is the step being worked on. The object
        may be entered again once it is left (StepTrace enters one for each phase of its step)."""
        return _StepScope(self, handle)

    def current_step(self) -> "StepRef | None":
        """The engine step being worked on: its headers, and whether the caller waits for
        this process' work on it (False: a rank that does not reply follows from it)."""
        return self._step

    def rpc_trace_headers(self) -> "tuple[dict[str, str] | None, dict[str, str] | None]":
        """(the current span's headers, the current step's) for a call to another process."""
        return self.inject_trace_headers() or None, self._step.headers if self._step else None

    def is_current(self, trace_headers: dict | None) -> bool:
        """Do these W3C headers name the current span?"""
        return False

    def has_current_span(self) -> bool:
        """Is a span (of this process, or a remote parent) current?"""
        return False

    def use_span(self, handle: "SpanHandle") -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def event(self, name: str, **attrs: Any) -> None:
        raise NotImplementedError

    def snapshot(self, kind: str, data: Any, step_id: int | None = None) -> None:
        raise NotImplementedError

    def inject_trace_headers(self) -> dict[str, str]:
        return {}

    def step_tracer(self, snapshot_at_launch: bool) -> "StepTracer | NullStepTracer":
        """The tracer EngineCore reports its steps to; `snapshot_at_launch`:
        take the step snapshot as the step is launched (async scheduling)."""
        from vllm_anatomy.tracing.step_tracer import StepTracer
        return StepTracer(self, snapshot_at_launch)

    def now_ns(self) -> int:
        """The clock of record_span/start_span timestamps."""
        return time.perf_counter_ns()

    def set_run_meta(self, key: str, value: Any) -> None:
        """A fact about the whole run (the run store's meta table), e.g. the resolved config."""

    def flush(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class _StepScope:
    """step_scope(): the step being worked on, inside (a class: entered twice per step; one
    object may be entered again once it is left, naming the same step)."""
    __slots__ = ("recorder", "handle", "saved", "ref")

    def __init__(self, recorder: Recorder, handle: "SpanHandle") -> None:
        self.recorder, self.handle = recorder, handle
        self.ref: StepRef | None = None

    def __enter__(self) -> None:
        self.saved = self.recorder._step
        if self.ref is None:
            self.ref = StepRef(self.handle.trace_headers(), False)
        self.recorder._step = self.ref

    def __exit__(self, *exc: object) -> None:
        self.recorder._step = self.saved


class SpanHandle:
    """What start_span returns (and what span() yields): a span to annotate."""

    def set_attribute(self, key: str, value: Any) -> None:
        raise NotImplementedError

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        """set_attribute(k, v) for each item, in order."""
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, time_ns: int | None = None, **attrs: Any) -> None:
        """time_ns on the recorder's now_ns() clock; default now."""
        raise NotImplementedError

    def add_link(self, trace_headers: dict | None, **attrs: Any) -> None:
        raise NotImplementedError

    def add_links(self, headers: Iterable[dict | None]) -> None:
        """add_link(h) for each h, in order (a step links to every request it serves)."""
        for trace_headers in headers:
            self.add_link(trace_headers)

    def trace_headers(self) -> dict[str, str]:
        raise NotImplementedError

    def end(self, end_ns: int | None = None) -> None:
        raise NotImplementedError


# What a follower follows from: the cause's W3C headers or its handle (None: no cause).
Cause: TypeAlias = "dict[str, str] | SpanHandle | None"


class _NullSpan(SpanHandle):
    __slots__ = ()

    def __enter__(self) -> "_NullSpan":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def add_event(self, name: str, time_ns: int | None = None, **attrs: Any) -> None:
        pass

    def add_link(self, trace_headers: dict | None, **attrs: Any) -> None:
        pass

    def add_links(self, headers: Iterable[dict | None]) -> None:
        pass

    def trace_headers(self) -> dict[str, str]:
        return {}

    def end(self, end_ns: int | None = None) -> None:
        pass


_NULL_SPAN = _NullSpan()


class NullRecorder(Recorder):
    """Records nothing. The default everywhere."""
    level = "off"

    def span(self, name: str, links: list[dict] | None = None, *, follows_from: "Cause" = None,
             **attrs: Any) -> _NullSpan:
        return _NULL_SPAN

    def record_span(self, name: str, start_ns: int, end_ns: int, *, parent: "SpanHandle | None" = None,
                    follows_from: "Cause" = None, **attrs: Any) -> _NullSpan:
        return _NULL_SPAN

    def start_span(self, name: str, trace_headers: dict | None = None, kind: str = "internal",
                   start_ns: int | None = None, *, parent: "SpanHandle | None" = None,
                   follows_from: "Cause" = None, root: bool = False, **attrs: Any) -> _NullSpan:
        return _NULL_SPAN

    def use_span(self, handle: SpanHandle) -> _NullSpan:
        return _NULL_SPAN

    def event(self, name: str, **attrs: Any) -> None:
        pass

    def snapshot(self, kind: str, data: Any, step_id: int | None = None) -> None:
        pass

    def step_tracer(self, snapshot_at_launch: bool) -> "NullStepTracer":
        from vllm_anatomy.tracing.step_tracer import NullStepTracer
        return NullStepTracer()


def _ids_of(cause: Any) -> tuple[int, int] | None:
    """(trace id, span id) of a RecordedSpan or of W3C headers (None for None)."""
    if cause is None:
        return None
    if isinstance(cause, RecordedSpan):
        return cause.trace_id, cause.span_id
    return parse_traceparent(cause)


class paused_gc:
    """`with paused_gc():` no cyclic garbage collection inside (snapshot building).

    NOTE: a step's snapshot is a fresh tree of ~1,500 dicts and lists at batch
    256: every 700 of them the collector would run and walk them all (and
    promote the survivors, which then make the older generations' collections
    come sooner), though the tree has no cycles and is freed by reference
    counting as soon as it is encoded. Measured on an H200 host, that walking
    was a large part of level full's host cost. Nested uses and other threads
    are fine: only the outermost one re-enables, and a collection another
    thread would have triggered meanwhile just comes later.
    """
    __slots__ = ("was_enabled",)

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was_enabled:
            gc.enable()


@dataclass
class RecordedEvent:
    name: str
    time_ns: int
    span_id: int | None
    attrs: dict[str, Any]


def format_traceparent(trace_id: int, span_id: int, flags: int = 1) -> dict[str, str]:
    """W3C trace context header for (trace_id, span_id)."""
    return {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"}


def parse_traceparent(headers: dict | None) -> tuple[int, int] | None:
    """(trace_id, span_id) from a W3C traceparent header, None if absent or malformed."""
    value = (headers or {}).get("traceparent", "")
    parts = value.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        return int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None


@dataclass
class RecordedSpan(SpanHandle):
    name: str
    span_id: int
    parent_id: int | None
    start_ns: int
    end_ns: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    trace_id: int = 0
    kind: str = "internal"
    links: list[tuple[int, int]] = field(default_factory=list)
    events: list[RecordedEvent] = field(default_factory=list)
    _on_end: Any = field(default=None, repr=False, compare=False)

    def set_attribute(self, key: str, value: Any) -> None:
        self.attrs[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attrs.update(attributes)

    def add_event(self, name: str, time_ns: int | None = None, **attrs: Any) -> None:
        t = time.perf_counter_ns() if time_ns is None else time_ns
        self.events.append(RecordedEvent(name, t, self.span_id, attrs))

    def add_link(self, trace_headers: dict | None, **attrs: Any) -> None:
        ids = parse_traceparent(trace_headers)
        if ids is not None:
            self.links.append(ids)

    def trace_headers(self) -> dict[str, str]:
        return format_traceparent(self.trace_id, self.span_id)

    def end(self, end_ns: int | None = None) -> None:
        if self.end_ns is None:
            self.end_ns = time.perf_counter_ns() if end_ns is None else end_ns
            if self._on_end is not None:
                self._on_end(self)

    @property
    def duration_ns(self) -> int:
        return (self.end_ns or self.start_ns) - self.start_ns


class InMemoryRecorder(Recorder):
    """Keeps spans, events and snapshots in lists: for tests and lessons.

    Spans nest by call order (a stack), like OpenTelemetry's current-span context.
    A span is appended to `spans` when it ends. A follower has no parent, its cause's
    trace id and the cause as its first link.
    """

    def __init__(self, level: str = "full") -> None:
        if level not in LEVELS:
            raise ValueError(f"trace level must be one of {LEVELS}, got {level!r}")
        self.level = level
        self.spans: list[RecordedSpan] = []
        self.events: list[RecordedEvent] = []
        self.snapshots: list[tuple[str, int | None, Any]] = []
        self._stack: list[RecordedSpan] = []
        self._ids = itertools.count(1)
        # (remote parent ids, follows) inside remote_parent(); the step of step_scope / remote_parent.
        self._remote: tuple[tuple[int, int] | None, bool] = (None, False)
        self._step: StepRef | None = None

    def _new_span(self, name: str, parent_ids: tuple[int, int] | None, attrs: dict,
                  start_ns: int | None = None, kind: str = "internal", follows: Any = None,
                  root: bool = False) -> RecordedSpan:
        span_id = next(self._ids)
        cause = _ids_of(follows)
        if cause is None and follows is None and parent_ids is None and not root:
            if self._stack:
                parent_ids = (self._stack[-1].trace_id, self._stack[-1].span_id)
            elif self._remote[1]:
                cause = self._remote[0]
            else:
                parent_ids = self._remote[0]
        start = time.perf_counter_ns() if start_ns is None else start_ns
        if cause is not None:
            return RecordedSpan(name, span_id, None, start, attrs=dict(attrs), trace_id=cause[0], kind=kind,
                                links=[cause], _on_end=self.spans.append)
        trace_id, parent = parent_ids if parent_ids else (span_id, None)
        return RecordedSpan(name, span_id, parent, start, attrs=dict(attrs), trace_id=trace_id,
                            kind=kind, _on_end=self.spans.append)

    @contextlib.contextmanager
    def span(self, name: str, links: list[dict] | None = None, *, follows_from: Any = None,
             **attrs: Any) -> Iterator[RecordedSpan]:
        s = self._new_span(name, None, attrs, follows=follows_from)
        for headers in links or ():
            s.add_link(headers)
        self._stack.append(s)
        try:
            yield s
        finally:
            self._stack.pop()
            s.end()

    def record_span(self, name: str, start_ns: int, end_ns: int, *, parent: SpanHandle | None = None,
                    follows_from: Any = None, **attrs: Any) -> RecordedSpan:
        s = self._new_span(name, _ids_of(parent), attrs, start_ns=start_ns, follows=follows_from)
        s.end(end_ns)
        return s

    def start_span(self, name: str, trace_headers: dict | None = None, kind: str = "internal",
                   start_ns: int | None = None, *, parent: SpanHandle | None = None,
                   follows_from: Any = None, root: bool = False, **attrs: Any) -> RecordedSpan:
        # NOTE: as in OpenTelemetry, the parent is the remote span named by
        # trace_headers, else the current span, else none (a new trace).
        parent_ids = _ids_of(parent) or parse_traceparent(trace_headers)
        return self._new_span(name, parent_ids, attrs, start_ns, kind, follows=follows_from, root=root)

    @contextlib.contextmanager
    def use_span(self, handle: SpanHandle) -> Iterator[RecordedSpan]:
        assert isinstance(handle, RecordedSpan), "a span this recorder started"
        self._stack.append(handle)
        try:
            yield handle
        finally:
            self._stack.pop()

    @contextlib.contextmanager
    def remote_parent(self, trace_headers: dict | None, follows: bool = False,
                      step_headers: dict | None = None) -> Iterator[None]:
        saved = self._remote, self._step
        self._remote = (parse_traceparent(trace_headers), follows)
        self._step = StepRef(step_headers, follows) if step_headers else None
        try:
            yield
        finally:
            self._remote, self._step = saved

    def is_current(self, trace_headers: dict | None) -> bool:
        ids = parse_traceparent(trace_headers)
        return bool(self._stack) and ids == (self._stack[-1].trace_id, self._stack[-1].span_id)

    def has_current_span(self) -> bool:
        return bool(self._stack) or self._remote[0] is not None

    def event(self, name: str, **attrs: Any) -> None:
        sid = self._stack[-1].span_id if self._stack else None
        self.events.append(RecordedEvent(name, time.perf_counter_ns(), sid, dict(attrs)))

    def snapshot(self, kind: str, data: Any, step_id: int | None = None) -> None:
        if self.level == "full":
            self.snapshots.append((kind, step_id, data))

    def inject_trace_headers(self) -> dict[str, str]:
        return self._stack[-1].trace_headers() if self._stack else {}

    # -- queries used by tests -------------------------------------------------
    def span_names(self) -> list[str]:
        return [s.name for s in self.spans]

    def find(self, name: str) -> list[RecordedSpan]:
        return [s for s in self.spans if s.name == name]
