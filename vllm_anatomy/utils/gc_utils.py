"""The cyclic garbage collector around the engine: freeze the start-up heap, and
(VLLM_GC_DEBUG) log every collection.

Mirrors vllm/utils/gc_utils.py (GCDebugConfig, GCDebugger, freeze_gc_heap,
maybe_attach_gc_debug_callback), used by EngineCore.__init__ as in v0.27.1:

    freeze_gc_heap()                   after start-up: model, tokenizer, block pool
                                       move to the GC's permanent generation
    maybe_attach_gc_debug_callback()   VLLM_GC_DEBUG=1: one log line per collection
                                       (how long, which generation, how many collected);
                                       VLLM_GC_DEBUG='{"top_objects": 5}': and the five
                                       most common object types it looked at

NOTE: why a serving engine cares. CPython collects generation 0 every 700 new
container objects, generation 1 every 10 of those, and the oldest generation
(everything not frozen) once enough objects have survived into it. A full
collection walks every tracked object it holds, and the engine thread stops
while it does: with async scheduling that is host time the device waits for.
"""
from __future__ import annotations

import gc
import json
import logging
import time
from collections import Counter
from typing import Any, Callable

from vllm_anatomy import envs

logger = logging.getLogger(__name__)

GCCallback = Callable[[str, dict[str, int]], None]


class GCDebugConfig:
    """What VLLM_GC_DEBUG asks for: "" or "0" nothing; "1" the collections' times;
    a JSON object such as '{"top_objects": 5}' the times and the N most common
    object types of each collected generation."""

    def __init__(self, gc_debug_conf: str | None = None) -> None:
        self.enabled = False
        self.top_objects = -1
        if not gc_debug_conf or gc_debug_conf == "0":
            return
        if gc_debug_conf == "1":
            self.enabled = True
            return
        try:
            conf = json.loads(gc_debug_conf)
            if not isinstance(conf, dict):
                raise ValueError("not a JSON object")
            self.top_objects = int(conf.get("top_objects", -1))
            self.enabled = True
        except (ValueError, TypeError) as e:
            # NOTE: as vLLM: a debugging switch that cannot be read is reported
            # and left off; it must not stop the engine from starting.
            logger.error("VLLM_GC_DEBUG=%r: expected 0, 1 or a JSON object such as "
                         "'{\"top_objects\": 5}' (%s); GC debugging stays off", gc_debug_conf, e)

    def __repr__(self) -> str:
        return f"enabled:{self.enabled},top_objects:{self.top_objects}"


class GCDebugger:
    """Logs each collection: its generation, duration, and how many objects it freed."""

    def __init__(self, config: GCDebugConfig) -> None:
        self.config = config
        self.start_time_ns = time.monotonic_ns()
        self.num_objects = 0
        self.gc_top_collected_objects = ""

    def handle(self, phase: str, info: dict[str, int]) -> None:
        """One gc.callbacks event: phase "start" or "stop"."""
        generation = info.get("generation")
        if generation is None:
            return
        if phase == "start":
            self.start_time_ns = time.monotonic_ns()
            objects = gc.get_objects(generation)
            self.num_objects = len(objects)
            self.gc_top_collected_objects = _compute_top_gc_collected_objects(objects, self.config.top_objects)
        elif phase == "stop":
            elapsed_ms = (time.monotonic_ns() - self.start_time_ns) / 1e6
            top = (f" Top collected objects:\n{self.gc_top_collected_objects}"
                   if self.gc_top_collected_objects else "")
            logger.info("GC took %.3fms to complete. Collected %s objects (out of %d) in GC generation %d.%s",
                        elapsed_ms, info.get("collected", "?"), self.num_objects, generation, top)


def freeze_gc_heap() -> None:
    """Collect every generation, then move all surviving objects to the permanent
    generation, which no collection walks again. Call once start-up is done."""
    # NOTE: vLLM's three calls, kept for its letter: gc.collect(2) alone would do, since a
    # full collection takes the younger generations with it and leaves every survivor in
    # the oldest; the two before it only walk what is young (little, after start-up).
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()


def maybe_attach_gc_debug_callback() -> GCCallback | None:
    """With VLLM_GC_DEBUG on, add a GCDebugger to gc.callbacks; returns the callback
    (None when off). NOTE: ours returns it so that EngineCore.shutdown can take it off
    again: a process that builds several engines (tests) would otherwise log each
    collection once per engine it ever built."""
    config = GCDebugConfig(envs.VLLM_GC_DEBUG)
    if not config.enabled:
        return None
    debugger = GCDebugger(config)

    def gc_callback(phase: str, info: dict[str, int]) -> None:
        debugger.handle(phase, info)

    gc.callbacks.append(gc_callback)
    return gc_callback


def _compute_detailed_type(o: Any) -> str:
    """An object's type, with its length where it has one."""
    try:
        return f"{type(o)}(size:{len(o)})"
    except Exception:          # no len(), or one that raises
        return str(type(o))


def _compute_top_gc_collected_objects(objects: list[Any], top: int) -> str:
    """The `top` most common detailed types among `objects`, one "count:type" a line."""
    if top <= 0:
        return ""
    counts = Counter(_compute_detailed_type(o) for o in objects)
    return "\n".join(f"{count:>5}:{object_type}" for object_type, count in counts.most_common(top))
