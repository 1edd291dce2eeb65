"""How long the engine's thread waits for the GIL while a span batch is exported, CPU only:
.venv/bin/python bench/tracing_gil_wait.py [--rounds 5] [--steps 600] [--offer-us 0,500]

The run store's span processor (deferred_span.DeferredSpanProcessor, exporter
span_export.StoreSpanExporter) turns a batch of ended spans into rows on a thread
of its own, in pure Python. The engine's thread gives the GIL up at every CUDA
synchronize and wants it back as soon as the GPU is done; how long it then waits
is what a busy exporter costs a GPU step (tracing/gil_yield.py says why up to
sys.getswitchinterval(), 5 ms).

Here: an OTelRecorder at level spans with a real run store records `--steps`
steps of the engine's span shapes (a root EngineCore.step with the schedule and
execute_model children, device-lane spans, a request's follower; ~12 spans a step)
with no export (a long schedule delay); then the processor is woken to export them
all while this (the "engine") thread sleeps 2 ms at a time, as a synchronize
would, and measures how much later than 2 ms each sleep returns. Once per
`--offer-us` value (gil_yield.OFFER_EVERY_S), alternating, `--rounds` times.

Prints a table and writes bench/results/tracing_gil_wait_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_anatomy.tracing import gil_yield  # noqa: E402
from vllm_anatomy.tracing.otel import OTelRecorder  # noqa: E402
from vllm_anatomy.tracing.store import RunStore  # noqa: E402

RELEASE_S = 0.002
# (`**Attrs({...})`: the span attributes as dict[str, Any], as tests/tracing/test_fast_paths.py
# types them, so mypy does not check their values against the recorder's named parameters)
Attrs = dict[str, Any]


def record_steps(rec: OTelRecorder, steps: int, batch: int = 64) -> None:
    """`steps` engine steps' worth of spans, of the shapes tracing/step_tracer.py makes."""
    for step_id in range(steps):
        step = rec.start_span("EngineCore.step", root=True)
        with rec.use_span(step):
            step.set_attributes({"vllm_anatomy.step_id": step_id, "vllm_anatomy.num_reqs": batch,
                                 "vllm_anatomy.num_scheduled_tokens": batch})
            with rec.span("Scheduler.schedule", **Attrs({"vllm_anatomy.step_id": step_id})):
                rec.event("scheduled", **Attrs({"vllm_anatomy.num_running": batch, "vllm_anatomy.num_waiting": 0}))
            with rec.span("GPUModelRunner.execute_model", **Attrs({"vllm_anatomy.step_id": step_id})):
                with rec.span("GPUModelRunner._prepare_inputs", **Attrs({"vllm_anatomy.num_tokens": batch})):
                    pass
                t0 = rec.now_ns()
                for i, name in enumerate(("GPU.forward", "GPU.compute_logits", "GPU.sample")):
                    rec.record_span(name, t0 + i * 1000, t0 + (i + 1) * 1000,
                                    **Attrs({"vllm_anatomy.lane": "device", "vllm_anatomy.step_id": step_id}))
            with rec.span("Scheduler.update_from_output", **Attrs({"vllm_anatomy.step_id": step_id})):
                pass
            with rec.span("OutputProcessor.process_outputs", **Attrs({"vllm_anatomy.num_outputs": batch})):
                pass
        step.end()
        req = rec.start_span("Request", root=True, **Attrs({"vllm_anatomy.request_id": f"r{step_id}"}))
        req.add_event("FINISHED")
        req.end()


SPANS_PER_STEP = 10        # what record_steps makes of one step (checked below)


def one_round(offer_us: float, steps: int) -> dict:
    """One export of `steps` steps' spans with the GIL offered every `offer_us` (0: never), while
    this thread releases the GIL 2 ms at a time (at least three times): the overruns, in ms."""
    saved, gil_yield.OFFER_EVERY_S = gil_yield.OFFER_EVERY_S, offer_us / 1e6
    try:
        with tempfile.TemporaryDirectory() as tmp:
            store = RunStore.create(tmp, {"workload": "tracing_gil_wait"})
            rec = OTelRecorder("spans", process_kind="engine_core", store=store)
            processor = rec.sink.processors[0]
            # Nothing exported until woken below. NOTE: the worker is already waiting out the store's
            # 200 ms delay: woken once with an empty queue, it waits again with the new one (else it
            # exports whatever is queued when those 200 ms end, before the timed loop).
            processor.schedule_delay_s = 3600.0
            processor._wake.set()
            while processor._wake.is_set():
                time.sleep(0.001)
            time.sleep(0.01)
            # (one batch holding every span, one more than they are: the queue, 2,048 by default, would
            # drop the oldest, and a queue reaching the batch size wakes the worker at once)
            capacity = max(processor.max_queue_size, SPANS_PER_STEP * steps + 1)
            processor.max_queue_size = processor.max_export_batch_size = capacity
            processor.queue = type(processor.queue)(maxlen=capacity)
            record_steps(rec, steps)
            queued = len(processor.queue)
            assert queued == SPANS_PER_STEP * steps, f"record_steps made {queued} spans, not {SPANS_PER_STEP} a step"
            time.sleep(0.05)
            waits: list[float] = []
            t_start = time.perf_counter()
            processor._wake.set()
            while processor.queue or processor._export_lock.locked() or len(waits) < 3:
                t0 = time.perf_counter()
                time.sleep(RELEASE_S)
                waits.append((time.perf_counter() - t0 - RELEASE_S) * 1e3)
            export_ms = (time.perf_counter() - t_start) * 1e3
            rec.shutdown()
            store.close()
    finally:
        gil_yield.OFFER_EVERY_S = saved
    waits.sort()
    return {"offer_us": offer_us, "spans": queued, "export_ms": export_ms, "sleeps": len(waits),
            "wait_ms_median": statistics.median(waits), "wait_ms_max": waits[-1],
            "wait_ms_mean": statistics.mean(waits)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=600, help="engine steps of spans in the batch")
    ap.add_argument("--offer-us", default="0,500", help="gil_yield intervals to compare, microseconds")
    ap.add_argument("--out", default="bench/results/tracing_gil_wait_cpu.json")
    args = ap.parse_args()
    offers = [float(x) for x in args.offer_us.split(",")]
    rows = []
    print(f"{'round':>5} {'offer us':>9} {'spans':>6} {'export ms':>10} {'sleeps':>7} "
          f"{'wait ms median':>15} {'mean':>7} {'max':>7}")
    for rnd in range(args.rounds):
        for offer in (offers if rnd % 2 == 0 else offers[::-1]):
            r = one_round(offer, args.steps) | {"round": rnd}
            rows.append(r)
            print(f"{rnd:>5} {offer:>9.0f} {r['spans']:>6} {r['export_ms']:>10.1f} {r['sleeps']:>7} "
                  f"{r['wait_ms_median']:>15.3f} {r['wait_ms_mean']:>7.3f} {r['wait_ms_max']:>7.3f}", flush=True)
    summary = {str(int(o)): {"wait_ms_median": statistics.median(r["wait_ms_median"] for r in rows if r["offer_us"] == o),
                             "export_ms_median": statistics.median(r["export_ms"] for r in rows if r["offer_us"] == o)}
               for o in offers}
    for o, s in summary.items():
        print(f"offer {o} us: median of round medians {s['wait_ms_median']:.3f} ms waited per 2 ms release; "
              f"export {s['export_ms_median']:.1f} ms")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rounds": rows, "summary": summary, "release_ms": RELEASE_S * 1e3,
                   "switch_interval_ms": sys.getswitchinterval() * 1e3,
                   "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                               "python": platform.python_version()}}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
