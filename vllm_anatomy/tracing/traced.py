"""trace_methods: spans around a pure-core object's methods, from the outside.

The pure core (Scheduler, KVCacheManager, BlockPool) never sees a Recorder: its
text stays the algorithm. To still see *inside* `Scheduler.schedule` — every
`KVCacheManager.get_computed_blocks` and `allocate_slots` call, with the
request it was for and what came back — the orchestration layer wraps those
methods on the one instance it owns.

NOTE: one span per request per step is too much for level "spans" on a big
batch (~25–50 µs per SDK span × hundreds of requests a step), so EngineCore
does this only at level "full", where per-step cost is already accepted.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from vllm_anatomy.tracing.recorder import Recorder


def _describe_result(result: Any) -> dict[str, Any]:
    if result is None:                      # allocate_slots: no room -> preemption or stop admitting
        return {"vllm_anatomy.result": "None"}
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], int):
        return {"vllm_anatomy.num_computed_tokens": result[1]}   # get_computed_blocks: (blocks, hit tokens)
    ids = getattr(result, "get_block_ids", None)
    if ids is not None:                     # KVCacheBlocks: the newly allocated block ids
        return {"vllm_anatomy.new_block_ids": list(ids()[0])}
    return {}


def trace_methods(obj: Any, recorder: Recorder, class_name: str, methods: list[str]) -> None:
    """Replace obj.<method> (on this instance only) with a version inside a span."""
    for name in methods:
        original: Callable = getattr(obj, name)

        @functools.wraps(original)
        def wrapper(request, *args, __original=original, __name=name, **kwargs):
            with recorder.span(f"{class_name}.{__name}",
                               **{"vllm_anatomy.request_id": request.request_id}) as span:
                result = __original(request, *args, **kwargs)
                for key, value in _describe_result(result).items():
                    span.set_attribute(key, value)
                return result

        setattr(obj, name, wrapper)
