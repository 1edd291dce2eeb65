"""n > 1 in the trace, through the whole engine on a tiny random Llama (CPU): one
ParentRequest span over its children's llm_request spans, and every span ended exactly
once however the request ends — aborted by the parent's id, one child aborted, refused
halfway through adding its children, or a later prompt of the same generate() refused
(LLMEngine, in one process and with an engine process; AsyncLLM).

A span is written to the run store when it ends, so "ended" is "in the store"; the
tracer's own tables must be empty afterwards (nothing it still waits to end).
"""
from __future__ import annotations

import asyncio

import pytest

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.engine.arg_utils import EngineArgs
from vllm_anatomy.engine.async_llm import AsyncLLM
from vllm_anatomy.sampling_params import RequestOutputKind
from vllm_anatomy.tracing.reader import open_run
from vllm_anatomy.tracing.trace_check import check_run, jaeger_warnings, strict_violations

PROMPT = {"prompt_token_ids": [(7 * j) % 480 + 20 for j in range(20)]}


def sampled(n: int, max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True, **kw)


def _tracer_empty(tracer) -> None:
    assert (tracer.requests, tracer.parents, tracer.child_parents, tracer.admitted) == ({}, {}, {}, {})


def _families(path: str) -> dict[str, tuple]:
    """Each ParentRequest by its request id: (its span, its llm_request children by index)."""
    with open_run(path) as run:
        spans = run.spans()
        report = check_run(run)
    assert report.split_requests == 0 and report.request_traces == report.requests, report.examples
    out = {}
    for p in (s for s in spans if s.name == "ParentRequest"):
        kids = sorted((s for s in spans if s.parent_id == p.span_id and s.name == "llm_request"),
                      key=lambda s: s.attributes["vllm_anatomy.child_index"])
        assert all(k.trace_id == p.trace_id for k in kids)
        # The request's trace as Jaeger shows it: nothing missing, every span within its parent
        # (refused under AsyncLLM.add_request too: the parent ends after it).
        # NOTE: only the request traces: an engine process stopped by LLM.shutdown() may leave
        # a step trace without its root (n = 1 as well; reported, not this test's subject).
        family = [s for s in spans if s.trace_id == p.trace_id]
        assert not jaeger_warnings(family, lambda s: None) and not strict_violations(family)
        out[p.attributes["vllm_anatomy.request_id"]] = (p, kids)
    # (an ended span says FINISHED once: none ended twice)
    assert all([e["name"] for e in s.events].count("FINISHED") <= 1 for s in spans)
    return out


def _reasons(span) -> list[str]:
    return span.attributes["gen_ai.response.finish_reasons"]


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "engine-process"])
def test_llm_engine_ends_every_span(tiny_llama_dir, tmp_path, monkeypatch, multiprocess):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", str(int(multiprocess)))
    llm = LLM(tiny_llama_dir, max_model_len=64, num_gpu_blocks_override=64, trace_level="spans",
              trace_dir=str(tmp_path))
    engine = llm.llm_engine
    try:
        # n=3, finished normally (LLM.generate).
        (out,) = llm.generate([PROMPT], sampled(3, max_tokens=4), use_tqdm=False)
        assert len(out.outputs) == 3
        # n=2, aborted by the parent's id mid-run; n=2 with one child aborted.
        engine.add_request("p", PROMPT, sampled(2))
        engine.add_request("c", PROMPT, sampled(2, max_tokens=6))
        engine.step()
        engine.step()
        engine.abort_request(["p", "0_c"])
        while engine.has_unfinished_requests():
            engine.step()
        # n=3, refused at its second child: the first is aborted, nothing is left.
        real = engine.engine_core_client.add_request

        def refuse_second(request):
            if request.request_id == "1_q":
                raise ValueError("refused")
            real(request)
        monkeypatch.setattr(engine.engine_core_client, "add_request", refuse_second)
        with pytest.raises(ValueError, match="refused"):
            engine.add_request("q", PROMPT, sampled(3))
        monkeypatch.setattr(engine.engine_core_client, "add_request", real)
        # generate() with a bad second prompt: the first, tokenized, was never added.
        with pytest.raises(ValueError):
            llm.generate([PROMPT, {"prompt_token_ids": [5] * 100}], sampled(2), use_tqdm=False)
        while engine.has_unfinished_requests():
            engine.step()
        _tracer_empty(engine.request_tracer)
        path = engine.recorder.run_path
    finally:
        llm.shutdown()
    fam = _families(path)
    assert set(fam) == {"0", "p", "c", "q", "1", "2"}
    assert [len(fam[r][1]) for r in ("0", "p", "c", "q", "1", "2")] == [3, 2, 2, 2, 0, 0]
    assert _reasons(fam["0"][0]) == ["length"] * 3
    assert _reasons(fam["p"][0]) == ["abort", "abort"] == [_reasons(k)[0] for k in fam["p"][1]]
    assert _reasons(fam["c"][0]) == ["abort", "length"]
    assert _reasons(fam["q"][0]) == ["error", "error"]      # children 0 and 1 were added; 2 never was
    assert fam["q"][0].events[-1]["attributes"] == {"vllm_anatomy.finish_reason": "error"}
    # "1" (tokenized, never added) and "2" (refused while tokenizing) end with no child.
    assert [e["name"] for e in fam["1"][0].events] == ["QUEUED", "FINISHED"]


def test_async_llm_ends_every_span(tiny_llama_dir, tmp_path, monkeypatch):
    async def main() -> str:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_dir, max_model_len=64,
                                                      num_gpu_blocks_override=64, trace_level="spans",
                                                      trace_dir=str(tmp_path)), multiprocess=False)
        try:
            delta = sampled(2, max_tokens=200, output_kind=RequestOutputKind.DELTA)
            # A stream closed after its first chunk: both children aborted.
            gen = engine.generate(PROMPT, delta, "a")
            await gen.__anext__()
            await gen.aclose()
            # Finished normally.
            outs = [o async for o in engine.generate(PROMPT, sampled(3, max_tokens=4), "f")]
            assert outs[-1].finished
            # n=3, refused at its second child.
            real = engine.engine_core.add_request_async

            async def refuse_second(request):
                if request.request_id.startswith("1_r-"):
                    raise ValueError("refused")
                await real(request)
            monkeypatch.setattr(engine.engine_core, "add_request_async", refuse_second)
            with pytest.raises(ValueError, match="refused"):
                await engine.add_request("r", PROMPT, sampled(3))
            for _ in range(200):
                if not engine.output_processor.request_states:
                    break
                await asyncio.sleep(0.02)
            _tracer_empty(engine.request_tracer)
            assert engine.recorder.run_path is not None, "the recorder wrote no run"
            return engine.recorder.run_path
        finally:
            engine.shutdown()
    path = asyncio.run(main())
    fam = {rid.split("-")[0]: f for rid, f in _families(path).items()}
    assert set(fam) == {"a", "f", "r"}
    assert _reasons(fam["a"][0]) == ["abort", "abort"]
    assert _reasons(fam["f"][0]) == ["length"] * 3 and len(fam["f"][1]) == 3
    assert _reasons(fam["r"][0]) == ["error", "error"]     # children 0 and 1 were added; 2 never was
