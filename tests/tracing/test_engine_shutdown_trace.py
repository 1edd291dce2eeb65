"""An engine process shut down at any moment leaves whole traces (Jaeger's rules, trace_check).

LLM with VLLM_ENABLE_V1_MULTIPROCESSING=1 at trace level "spans", on a tiny random
Llama (CPU), shut down right after a generate() (the engine may still be in the step
that tells the worker what finished) or while requests run (n=1 and n=2; with and
without async scheduling, whose launched steps wait in the batch queue). Before:
SIGTERM raised SystemExit wherever the engine's main thread was, so a step's child
spans were exported without their `EngineCore.step` root, and the frontend never
ended the `llm_request` span of a request still running (its tokenizing, ZMQ hop and
EngineCore.add_request spans lost their parent). Now the engine stops between steps
(it aborts its requests and finishes the steps in flight) and the frontend aborts
its unfinished requests first: no missing parent, no Jaeger warning, no trace that
belongs to no request or step, whatever the timing.
"""
from __future__ import annotations

import pytest

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.tracing.reader import open_run
from vllm_anatomy.tracing.trace_check import check_run

PROMPT = {"prompt_token_ids": [(7 * j) % 480 + 20 for j in range(20)]}


@pytest.mark.parametrize("when, async_scheduling", [("after generate", False), ("mid-generation", False),
                                                    ("mid-generation", True)],
                         ids=["after-generate", "mid-generation", "mid-generation-async"])
def test_engine_process_shutdown_leaves_whole_traces(tiny_llama_dir, tmp_path, monkeypatch, when,
                                                     async_scheduling):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = LLM(tiny_llama_dir, max_model_len=512, num_gpu_blocks_override=128, trace_level="spans",
              trace_dir=str(tmp_path), async_scheduling=async_scheduling)
    engine = llm.llm_engine
    proc = engine.engine_core_client.resources.engine_proc
    path = engine.recorder.run_path
    try:
        (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
        if when == "mid-generation":
            # Requests that would run for hundreds of steps; the frontend has taken outputs
            # of some, so the engine is stepping when the shutdown comes.
            engine.add_request("long", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
            engine.add_request("pair", PROMPT, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=400,
                                                              ignore_eos=True))
            for _ in range(3):
                engine.step()
            assert engine.has_unfinished_requests()
    finally:
        # (a generous grace: a loaded machine must not turn the engine's own exit into a SIGKILL)
        engine.shutdown(timeout=120)
        llm.shutdown()
    assert proc.exitcode == 0, "the engine left on its own (not killed)"
    with open_run(path) as run:
        report = check_run(run)
        steps = run.spans("EngineCore.step")
        requests = {s.attributes.get("vllm_anatomy.request_id"): s for s in run.spans("llm_request")}
    assert (report.missing_parents, report.jaeger_warnings, report.other_traces) == (0, 0, 0), report.examples
    assert report.strict_violations == 0, report.examples
    assert steps and all(s.end_ns >= s.start_ns for s in steps)
    if when == "mid-generation":
        # The running requests' own spans ended at shutdown, as aborted.
        for rid in ("long", "0_pair", "1_pair"):
            assert requests[rid].attributes["gen_ai.response.finish_reasons"] == ["abort"]
