"""The draft model's device work in the trace: a phase after the target's sampling, its forwards
and their kernel launches, as the target's are timed (speculative decoding, method draft_model).

Each step where the draft model proposes has, on the device lane, one `GPU.propose_draft_token_ids`
(`vllm_anatomy.drafter` true): a child of the step's `EngineCore.step` without async scheduling
(the step reads the drafts on the host: it waits for them), a follower of it with async scheduling
(the drafts stay on the device: nothing in the step waits). It holds one `GPU.draft_model_forward`
per forward (the first pass, then K - 1 decode forwards), each holding its `GPU.kernel.*` launches
at trace level full, with the attributes the target's have (num_keys from host values; the padded
decode forwards of async scheduling flagged `num_keys_upper_bound`). The target's own device spans
keep their shape (a plain run's, step for step), and the trace level changes no token.

Runs on a CPU: the Triton backend in Triton's interpreter (this folder's conftest), and the device
lane's CUDA events stood in for by the host's clock (tests/host_device_lane.py).

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/kernel_tests/test_drafter_device_lane.py
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.host_device_lane import attach, emulate_device_lane
from vllm_anatomy.tracing.reader import open_run
from vllm_anatomy.tracing.trace_check import strict_violations

pytestmark = pytest.mark.slow

K = 3
NUM_REQS = 2
TARGET_PHASES = ["GPU.prepare_inputs", "GPU.model_forward", "GPU.compute_logits", "GPU.sample", "GPU.d2h"]


def record(model_dir: str, trace_dir, speculative: bool, async_scheduling: bool,
           level: str = "full") -> tuple[str | None, list[list[int]]]:
    """Greedy generation on the Triton backend with an emulated device lane: (run store, tokens)."""
    from vllm_anatomy import LLM, SamplingParams
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K} if speculative else None
    with pytest.MonkeyPatch.context() as mp:
        emulate_device_lane(mp)
        llm = LLM(model_dir, max_model_len=128, attention_backend="triton", async_scheduling=async_scheduling,
                  speculative_config=spec, trace_level=level, trace_dir=str(trace_dir))
        attach(llm)
        try:
            rng = random.Random(0)
            prompts = [{"prompt_token_ids": [rng.randint(3, 500) for _ in range(10 + 3 * i)]} for i in range(NUM_REQS)]
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=13, ignore_eos=True), use_tqdm=False)
            path = llm.llm_engine.recorder.run_path if level != "off" else None
        finally:
            llm.llm_engine.shutdown()
    return path, [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, tmp_path_factory):
    """A plain run, and draft-model runs (the model drafting for itself) with and without async scheduling."""
    out = {}
    for name, spec, async_ in (("plain", False, False), ("sync", True, False), ("async", True, True)):
        out[name] = record(tiny_llama_dir, tmp_path_factory.mktemp(name), spec, async_)
    out["off"] = record(tiny_llama_dir, tmp_path_factory.mktemp("off"), True, True, level="off")
    return out


def spans_of(path: str) -> list:
    with open_run(path) as run:
        return run.spans()


def target_shape(spans: list, step_id: int) -> Counter:
    """The step's device spans that are not the drafter's, as (name, parent's name) pairs."""
    by_id = {s.span_id: s for s in spans}
    return Counter((s.name, by_id[s.parent_id].name if s.parent_id in by_id else None) for s in spans
                   if s.attributes.get("vllm_anatomy.lane") == "device"
                   and s.attributes.get("vllm_anatomy.step_id") == step_id
                   and not s.attributes.get("vllm_anatomy.drafter"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_proposal_has_its_device_phase_forwards_and_kernels(runs, mode, tiny_llama_dir):
    path, tokens = runs[mode]
    assert tokens == runs["plain"][1] == runs["off"][1]          # (the trace level changes no token)
    spans = spans_of(path)
    by_id = {s.span_id: s for s in spans}
    steps = {s.attributes["vllm_anatomy.step_id"]: s for s in spans if s.name == "EngineCore.step"}
    host = [s for s in spans if s.name == "GPUModelRunner.propose_draft_token_ids"]
    verify = [i for i, s in steps.items() if "vllm_anatomy.spec_decode.num_drafts" in s.attributes]
    assert len(verify) >= 3 and len(host) >= len(verify)
    phases = [s for s in spans if s.name == "GPU.propose_draft_token_ids"]
    num_layers = _num_layers(tiny_llama_dir)
    # One device phase per proposal, in the step that proposed.
    step_of = {s.trace_id: i for i, s in steps.items()}
    assert Counter(step_of[h.trace_id] for h in host) == Counter(p.attributes["vllm_anatomy.step_id"] for p in phases)
    assert set(verify) <= {p.attributes["vllm_anatomy.step_id"] for p in phases}
    for phase in phases:
        step_id = phase.attributes["vllm_anatomy.step_id"]
        step = steps[step_id]
        a = phase.attributes
        assert a["vllm_anatomy.lane"] == "device" and a["vllm_anatomy.drafter"] is True
        assert a["vllm_anatomy.spec_decode_method"] == "draft_model" and phase.trace_id == step.trace_id
        if mode == "sync":      # the step waits for the drafts: within it, after its target's device work
            assert phase.parent_id == step.span_id and not phase.links
            assert step.start_ns <= phase.start_ns <= phase.end_ns <= step.end_ns
        else:                   # nothing in the step waits for them: a follower of the step
            assert phase.parent_id is None and phase.links[0]["span_id"] == step.span_id
        (gpu_step,) = [s for s in spans if s.name == "GPU.step" and s.attributes["vllm_anatomy.step_id"] == step_id]
        assert phase.start_ns >= gpu_step.end_ns                 # after the target's sampling and output copy
        forwards = sorted((s for s in spans if s.parent_id == phase.span_id), key=lambda s: s.start_ns)
        assert [s.name for s in forwards] == ["GPU.draft_model_forward"] * K
        assert [s.attributes["vllm_anatomy.draft_forward"] for s in forwards] == list(range(K))
        for j, fwd in enumerate(forwards):
            assert fwd.attributes["vllm_anatomy.cudagraph_mode"] == "NONE" and fwd.attributes["vllm_anatomy.drafter"]
            assert phase.start_ns <= fwd.start_ns <= fwd.end_ns <= phase.end_ns
            kernels = [s for s in spans if s.parent_id == fwd.span_id]
            names = Counter(s.name for s in kernels)
            assert names == {"GPU.kernel.reshape_and_cache": num_layers, "GPU.kernel.unified_attention": num_layers}
            for k in kernels:
                ka = k.attributes
                assert ka["vllm_anatomy.drafter"] is True and ka["vllm_anatomy.step_id"] == step_id
                assert ka["vllm_anatomy.num_tokens"] == fwd.attributes["vllm_anatomy.num_tokens"]
                assert ka["vllm_anatomy.bytes"] > 0 and fwd.start_ns <= k.start_ns <= k.end_ns <= fwd.end_ns
                if k.name == "GPU.kernel.unified_attention":
                    assert ka["vllm_anatomy.num_keys"] > 0 and ka["vllm_anatomy.num_reqs"] >= 1
                    # Only the padded decode forwards of async scheduling count keys from an upper bound.
                    assert ka.get("vllm_anatomy.num_keys_upper_bound", False) == (mode == "async" and j > 0)
    # The target's device spans keep a plain run's shape (names and parents, counted) in every
    # step; nothing of the drafter's lies in GPU.step.
    plain = spans_of(runs["plain"][0])
    plain_shapes = [target_shape(plain, s.attributes["vllm_anatomy.step_id"]) for s in plain if s.name == "GPU.step"]
    checked = 0
    for step_id, step in sorted(steps.items()):
        shape = target_shape(spans, step_id)
        if not step.attributes["vllm_anatomy.num_scheduled_tokens"]:
            assert not shape          # (async scheduling: a last step that scheduled nothing)
            continue
        assert shape in plain_shapes, (step_id, shape)      # (one GPU.step, its phases, layers, kernels)
        assert [n for n, parent in shape.elements() if parent == "GPU.step"] == TARGET_PHASES
        checked += 1
    assert checked >= len(verify)
    assert not [s for s in spans if s.parent_id in by_id and by_id[s.parent_id].name == "GPU.step"
                and s.attributes.get("vllm_anatomy.drafter")]
    assert not strict_violations(spans)


def test_a_plain_run_has_no_drafter_spans_and_one_gpu_step_per_step(runs):
    """No speculation: the device lane as before (a GPU.step of five phases per step, the forward's
    layers and kernels inside), nothing of the drafter's."""
    spans = spans_of(runs["plain"][0])
    device = [s for s in spans if s.attributes.get("vllm_anatomy.lane") == "device"]
    assert device and not [s for s in device if "propose" in s.name or "draft" in s.name
                           or "vllm_anatomy.drafter" in s.attributes]
    steps = Counter(s.attributes["vllm_anatomy.step_id"] for s in device if s.name == "GPU.step")
    assert len(steps) >= 5 and set(steps.values()) == {1}
    shapes = {step_id: target_shape(spans, step_id) for step_id in steps}
    decode = shapes[sorted(steps)[1]]
    assert all(shapes[i] == decode for i in sorted(steps)[1:])
    assert [n for n, parent in decode.elements() if parent == "GPU.step"] == TARGET_PHASES
    assert decode[("GPU.kernel.unified_attention", "GPU.layer")] == decode[("GPU.layer", "GPU.model_forward")] > 0
    assert decode[("GPU.kernel.compute_slot_mapping", "GPU.prepare_inputs")] == 1


def _num_layers(model_dir: str) -> int:
    import json
    import pathlib
    return json.loads((pathlib.Path(model_dir) / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_step_inspector_shows_the_drafter_on_the_device_lane(runs, mode, monkeypatch, tmp_path, tiny_llama_dir):
    """The Worker tab of a verify step: the device lane's header counts the drafter's forwards, the
    kernel tables name each launch's model (the target's, or draft forward j), and the slot-mapping
    note counts only the target's K/V writes (one per layer)."""
    import os
    import shutil

    from streamlit.testing.v1 import AppTest
    path = runs[mode][0]
    shutil.copy(path, tmp_path / os.path.basename(path))
    with open_run(path) as run:
        verify = min(s.attributes["vllm_anatomy.step_id"] for s in run.spans("EngineCore.step")
                     if "vllm_anatomy.spec_decode.num_drafts" in s.attributes)
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", str(tmp_path))
    monkeypatch.delenv("VLLM_ANATOMY_SAMPLES_DIR", raising=False)
    app = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "dashboard", "app.py")
    at = AppTest.from_file(app, default_timeout=120)
    at.query_params.update({"run": os.path.basename(path), "page": "inspector", "step": str(verify),
                            "tab": "Worker (model runner)"})
    at.run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    text = "\n".join(m.value for m in [*at.markdown, *at.caption])
    num_layers = _num_layers(tiny_llama_dir)
    assert f"**Device lane** · step {verify} ·" in text and f"({K} forwards) · {num_layers} layer spans" in text
    assert "the draft model proposes the next step's drafts" in text
    assert ("nothing in the step waits for it" in text) == (mode == "async")
    frames = {tuple(df.value.columns): df.value for df in at.dataframe}
    summary = next(v for k, v in frames.items() if k[:3] == ("model", "kernel", "launches"))
    per = {(m, k): n for m, k, n in zip(summary["model"], summary["kernel"], summary["launches"])}
    assert per == {("target", "compute_slot_mapping"): 1, ("target", "reshape_and_cache"): num_layers,
                   ("target", "unified_attention"): num_layers, ("draft", "reshape_and_cache"): K * num_layers,
                   ("draft", "unified_attention"): K * num_layers}
    launches = next(v for k, v in frames.items() if k[:3] == ("model", "layer", "kernel"))
    assert set(launches["model"]) == {"target", *(f"draft {j}" for j in range(K))}
    assert f"**{num_layers} launches**" in text            # the slot mapping's writes: the target's
