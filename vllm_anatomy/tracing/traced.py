"""trace_methods: spans around a pure-core object's methods, from the outside.

The pure core (Scheduler, KVCacheManager, BlockPool) never sees a Recorder: its
text stays the algorithm. To still see *inside* `Scheduler.schedule` — the
`KVCacheManager.get_computed_blocks` and `allocate_slots` calls, with the
request each was for and what came back — the engine's StepTracer
(step_tracer.py) wraps those methods on the one instance the engine owns.

NOTE: a call that changed nothing gets no span of its own. At batch 256 every
decode step calls allocate_slots once per running request, and ~15 of 16 of
those calls find room in the request's last block and allocate nothing: a span
each (with its export) was most of level "full"'s host cost
(bench/results/tracing_breakdown_*.json), and said nothing. Such calls are counted instead
(`TracedCalls.take_quiet()`; the StepTracer puts the count on the step's
`Scheduler.schedule` span). Every call that allocated a block, was refused
(preemption, admission stops) or looked up the prefix cache still gets its
span, with its real start and end. Even so, the StepTracer does this only at
level "full", where per-step cost is already accepted.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from vllm_anatomy.core.kv_cache_manager import KVCacheBlocks
from vllm_anatomy.tracing.recorder import Recorder

# The Scheduler.schedule attribute that counts allocate_slots calls without a span.
QUIET_CALLS_ATTR = "vllm_anatomy.allocate_slots_without_new_blocks"


def _describe_result(result: Any) -> dict[str, Any] | None:
    """Span attributes for what a call returned; None if it changed nothing."""
    # NOTE: the common case first, in as few operations as possible: it runs
    # for every running request of every step.
    if type(result) is KVCacheBlocks:       # allocate_slots: the newly allocated blocks, per group
        if not any(result.blocks):
            return None                     # room in the last block: nothing allocated
        return {"vllm_anatomy.new_block_ids": [block.block_id for block in result.blocks[0]]}
    if result is None:                      # allocate_slots: no room -> preemption or stop admitting
        return {"vllm_anatomy.result": "None"}
    if isinstance(result, tuple) and len(result) == 3 and isinstance(result[1], int):
        # get_computed_blocks: (blocks, hit tokens, shared_prefix_boundary)
        return {"vllm_anatomy.num_computed_tokens": result[1]}
    return {}


class TracedCalls:
    """What trace_methods installed: counts the calls that got no span."""

    def __init__(self) -> None:
        self.quiet = 0

    def take_quiet(self) -> int:
        """Calls that changed nothing since the last take (and reset the count)."""
        n, self.quiet = self.quiet, 0
        return n


def trace_methods(obj: Any, recorder: Recorder, class_name: str, methods: list[str]) -> TracedCalls:
    """Replace obj.<method> (on this instance only) with a version that records a
    span (explicit start and end, under the current span) when the call changed
    something, and counts it otherwise."""
    calls = TracedCalls()
    now_ns = recorder.now_ns
    for name in methods:
        original: Callable = getattr(obj, name)

        @functools.wraps(original)
        def wrapper(request, *args, __original=original, __name=f"{class_name}.{name}", **kwargs):
            start = now_ns()
            try:
                result = __original(request, *args, **kwargs)
            except BaseException as exc:
                recorder.record_span(__name, start, now_ns(),
                                     **{"vllm_anatomy.request_id": request.request_id,
                                        "vllm_anatomy.exception": f"{type(exc).__name__}: {exc}"})
                raise
            attrs = _describe_result(result)
            if attrs is None:
                calls.quiet += 1
            else:
                recorder.record_span(__name, start, now_ns(),
                                     **{"vllm_anatomy.request_id": request.request_id}, **attrs)
            return result

        setattr(obj, name, wrapper)
    return calls
