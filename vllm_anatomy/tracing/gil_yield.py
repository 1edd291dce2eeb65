"""Background tracing threads give the GIL back often, so the engine's thread never waits long for it.

The span processors' threads (deferred_span.DeferredSpanProcessor) turn a batch of up
to 512 ended spans into exporter input in one pass of pure Python (~15-30 us a span:
10-15 ms a batch). Meanwhile the engine's thread gives the GIL up at every CUDA
synchronize and every ZMQ/queue wait, and then wants it back at once: the GPU's next
step is waiting for its launches.

NOTE: why a thread has to offer it. CPython hands the GIL to a waiting thread only
when the holder drops it: a thread running Python drops it when it blocks, or when
the waiter has waited sys.getswitchinterval() (5 ms) and asks for it. So a batch of
Python work on a background thread delays the engine's thread by up to 5 ms at each
hand-back, longer than a whole decode step on a Hopper GPU (1.5-4 ms), and the GPU
idles. time.sleep(0) drops the GIL and wakes its waiter, who takes it; the
background thread gets it back when the engine's thread next blocks. Offered every
OFFER_EVERY_S of work (0.5 ms), the wait is at most about that.
Measured on the 2-core CPU (`bench/tracing_gil_wait.py --rounds 4`: 6,000 spans of the
engine's shapes, exported in 33-39 ms), a thread that released the GIL for 2 ms got it
back a median 5.3 ms late without offers, 0.38 ms late with them. On an H100,
the offline workload at trace level spans ran 1.0041x and 1.0117x with offers in two
interleaved rounds (`bash bench/peers/device_stages.sh gil`,
bench/results/throughput_ab_gil_offer_spans_h100.json).

vLLM has no such seam: its OpenTelemetry export runs the SDK's BatchSpanProcessor
on a thread of the engine's process, as ours did. `VLLM_ANATOMY_TRACE_GIL_OFFER_US`
sets the interval in microseconds (0: never offer, as before), for A/B runs.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Iterable, Iterator, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _offer_every_s() -> float:
    raw = os.environ.get("VLLM_ANATOMY_TRACE_GIL_OFFER_US", "500")
    try:
        us = float(raw)
    except ValueError:
        logger.warning("VLLM_ANATOMY_TRACE_GIL_OFFER_US=%r is not a number: using 500", raw)
        us = 500.0
    return max(us, 0.0) / 1e6


OFFER_EVERY_S = _offer_every_s()


def offering_gil(items: Iterable[T], every_s: float | None = None) -> Iterator[T]:
    """`items`, one by one; between two of them, time.sleep(0) (the GIL offered to a
    waiting thread) once `every_s` (default OFFER_EVERY_S) have passed since the last
    offer. every_s == 0: never."""
    every = OFFER_EVERY_S if every_s is None else every_s
    if every <= 0:
        yield from items
        return
    clock = time.perf_counter
    deadline = clock() + every
    for item in items:
        yield item
        if clock() >= deadline:
            time.sleep(0)
            deadline = clock() + every
