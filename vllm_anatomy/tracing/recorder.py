"""The Recorder seam: how every orchestration layer reports what it does.

One object is injected (a constructor argument, never a global). It offers
    span(name, **attrs)      context manager timing a piece of work
    event(name, **attrs)     a point in time (e.g. a request state change)
    snapshot(kind, data)     plain, JSON-able state (level "full" only)
`NullRecorder` is the default and costs one attribute lookup and a no-op call;
`InMemoryRecorder` keeps everything in lists for tests and lessons. The
OpenTelemetry-backed recorder lives in tracing/otel.py and is the only place
that imports OpenTelemetry.

NOTE: the pure core (Scheduler, KVCacheManager, BlockPool, Request) never sees
a Recorder. It returns records and exposes snapshot(); the orchestration layers
(EngineCore, Executor, GPUModelRunner, ...) decide what to record.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

LEVELS = ("off", "spans", "full")


class Recorder:
    level: str = "off"

    @property
    def enabled(self) -> bool:
        return self.level != "off"

    @property
    def wants_snapshots(self) -> bool:
        return self.level == "full"

    def span(self, name: str, **attrs: Any) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def event(self, name: str, **attrs: Any) -> None:
        raise NotImplementedError

    def snapshot(self, kind: str, data: Any, step_id: int | None = None) -> None:
        raise NotImplementedError


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> "_NullSpan":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        pass


_NULL_SPAN = _NullSpan()


class NullRecorder(Recorder):
    """Records nothing. The default everywhere."""
    level = "off"

    def span(self, name: str, **attrs: Any) -> _NullSpan:
        return _NULL_SPAN

    def event(self, name: str, **attrs: Any) -> None:
        pass

    def snapshot(self, kind: str, data: Any, step_id: int | None = None) -> None:
        pass


@dataclass
class RecordedSpan:
    name: str
    span_id: int
    parent_id: int | None
    start_ns: int
    end_ns: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    def set_attribute(self, key: str, value: Any) -> None:
        self.attrs[key] = value

    @property
    def duration_ns(self) -> int:
        return (self.end_ns or self.start_ns) - self.start_ns


@dataclass
class RecordedEvent:
    name: str
    time_ns: int
    span_id: int | None
    attrs: dict[str, Any]


class InMemoryRecorder(Recorder):
    """Keeps spans, events and snapshots in lists: for tests and lessons.

    Spans nest by call order (a stack), like OpenTelemetry's current-span context.
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

    @contextlib.contextmanager
    def span(self, name: str, **attrs: Any) -> Iterator[RecordedSpan]:
        parent = self._stack[-1].span_id if self._stack else None
        s = RecordedSpan(name, next(self._ids), parent, time.perf_counter_ns(), attrs=dict(attrs))
        self._stack.append(s)
        try:
            yield s
        finally:
            s.end_ns = time.perf_counter_ns()
            self._stack.pop()
            self.spans.append(s)

    def event(self, name: str, **attrs: Any) -> None:
        sid = self._stack[-1].span_id if self._stack else None
        self.events.append(RecordedEvent(name, time.perf_counter_ns(), sid, dict(attrs)))

    def snapshot(self, kind: str, data: Any, step_id: int | None = None) -> None:
        if self.level == "full":
            self.snapshots.append((kind, step_id, data))

    # -- queries used by tests -------------------------------------------------
    def span_names(self) -> list[str]:
        return [s.name for s in self.spans]

    def find(self, name: str) -> list[RecordedSpan]:
        return [s for s in self.spans if s.name == name]
