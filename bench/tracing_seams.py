"""Where level spans spends the engine thread's time, CPU only:
OMP_NUM_THREADS=1 .venv/bin/python bench/tracing_seams.py

The workload of bench/tracing_host_cost.py (tiny random Llama, 256 requests
decoding together, async scheduling) at level spans. Every method of the
tracing classes the engine calls (StepTrace, RunnerTracer, OTelRecorder and
its scopes, RequestTracer, DeferredSpan, ...) is wrapped to add the engine
thread's CPU time in it, counted for the outermost call only (so a span
opened inside a seam is not counted twice) and only during steady decode
steps (steps 5..59 of each round; the span processor's thread is not
counted). Prints the engine step's CPU ms, the part inside tracing calls, and
the 25 largest callers, per step. The wrappers add ~1 us per outermost call
(~75 per step): read the figures as an upper bound and their ranking as the
point (bench/tracing_host_cost.py measures the whole cost).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import random
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
import tracing_host_cost as T  # noqa: E402

MODULES = ["vllm_anatomy.tracing.step_tracer", "vllm_anatomy.tracing.runner_tracer", "vllm_anatomy.tracing.otel",
           "vllm_anatomy.tracing.request_tracer", "vllm_anatomy.tracing.recorder", "vllm_anatomy.tracing.device_timer",
           "vllm_anatomy.tracing.deferred_span", "vllm_anatomy.tracing.local_span"]
WRAPPED_DUNDERS = ("__enter__", "__exit__", "__init__", "__call__")


class SeamClock:
    """Adds the engine thread's CPU time in outermost tracing calls, by caller, while `on`."""

    def __init__(self) -> None:
        self.depth, self.total, self.calls, self.on = 0, 0.0, 0, False
        self.by: dict[str, float] = {}
        self.main = threading.main_thread()

    def wrap(self, cls: type, name: str, fn):
        def timed(*args, **kwargs):
            if self.depth or threading.current_thread() is not self.main:
                self.depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.depth -= 1
            self.depth, start = 1, time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent, self.depth = time.thread_time() - start, 0
                if self.on:
                    key = f"{cls.__name__}.{name}"
                    self.total, self.calls = self.total + spent, self.calls + 1
                    self.by[key] = self.by.get(key, 0.0) + spent
        return timed

    def install(self) -> None:
        for module_name in MODULES:
            module = importlib.import_module(module_name)
            for class_name, cls in vars(module).items():
                if not inspect.isclass(cls) or cls.__module__ != module_name or class_name.startswith("Null"):
                    continue
                for name, fn in list(vars(cls).items()):
                    if inspect.isfunction(fn) and (not name.startswith("__") or name in WRAPPED_DUNDERS):
                        setattr(cls, name, self.wrap(cls, name, fn))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    clock = SeamClock()
    clock.install()
    from vllm_anatomy import SamplingParams
    from vllm_anatomy.sampling_params import RequestOutputKind
    workload = argparse.Namespace(requests=256, prompt_len=16, max_tokens=64, async_scheduling=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, T.VOCAB) for _ in range(16)]} for _ in range(256)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    steps, step_s = 0, 0.0
    with tempfile.TemporaryDirectory() as path, tempfile.TemporaryDirectory() as trace_dir:
        T.write_tiny_model(path)
        llm = T.make_llm(path, "spans", trace_dir, workload)
        engine = llm.llm_engine
        T.run_round({"spans": engine}, prompts, params, "warmup", ["spans"])
        for r in range(args.rounds):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{r}-{i}", prompt, params)
            k = 0
            while engine.has_unfinished_requests():
                clock.on = 5 <= k < 60
                start = time.thread_time()
                engine.step()
                if clock.on:
                    steps, step_s = steps + 1, step_s + time.thread_time() - start
                k += 1
            clock.on = False
        engine.shutdown()
    print(f"steady steps {steps}: step {1e3 * step_s / steps:.3f} CPU ms, inside tracing calls "
          f"{1e3 * clock.total / steps:.3f} ms ({clock.calls / steps:.0f} outermost calls per step)")
    for key, spent in sorted(clock.by.items(), key=lambda item: -item[1])[:25]:
        print(f"  {1e6 * spent / steps:7.1f} us  {key}")


if __name__ == "__main__":
    main()
