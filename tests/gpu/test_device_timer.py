"""Device-lane spans from CUDA events, resolved after the step's one sync point."""
import pytest
import torch

from vllm_anatomy.tracing.recorder import InMemoryRecorder

from tests.gpu.conftest import NUM_BLOCKS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PHASES = ["GPU.prepare_inputs", "GPU.model_forward", "GPU.compute_logits", "GPU.sample", "GPU.d2h"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_device_phases_per_step(tiny_llama_dir, async_scheduling):
    from vllm_anatomy import LLM, SamplingParams
    rec = InMemoryRecorder("spans")
    llm = LLM(tiny_llama_dir, device="cuda", recorder=rec, max_model_len=256, enforce_eager=True,
              num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=8, async_scheduling=async_scheduling)
    llm.generate([{"prompt_token_ids": list(range(1, 40))}] * 3,
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    # (async scheduling may add a step that schedules nothing: no device work)
    steps = [s.attrs["vllm_anatomy.step_id"] for s in rec.find("EngineCore.step")
             if s.attrs["vllm_anatomy.num_scheduled_tokens"]]
    assert len(steps) == 4                      # the prefill, then 3 decodes
    for step_id in steps:
        device = sorted((s for s in rec.spans if s.name in PHASES
                         and s.attrs["vllm_anatomy.step_id"] == step_id), key=lambda s: s.start_ns)
        assert [s.name for s in device] == PHASES
        assert all(s.attrs["vllm_anatomy.lane"] == "device" for s in device)
        assert all(a.end_ns == b.start_ns for a, b in zip(device, device[1:]))   # back to back
        assert device[1].duration_ns > 0                                         # the forward took time
        # The device finished the step before the host's sync returned (async
        # scheduling: the sync is the output handle's get_output, a step later).
        sync_name = "AsyncGPUModelRunnerOutput.get_output" if async_scheduling else "GPUModelRunner._bookkeeping_sync"
        (sync,) = [s for s in rec.find(sync_name) if s.parent_id is not None and _step_of(rec, s) == step_id]
        assert device[-1].end_ns <= sync.end_ns
        # ... and started after the host began to enqueue it.
        (execute,) = [s for s in rec.find("GPUModelRunner.execute_model") if _step_of(rec, s) == step_id]
        assert device[0].start_ns >= execute.start_ns


def _step_of(rec, span):
    if "vllm_anatomy.step_id" in span.attrs:
        return span.attrs["vllm_anatomy.step_id"]
    by_id = {s.span_id: s for s in rec.spans}
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        if "vllm_anatomy.step_id" in span.attrs:
            return span.attrs["vllm_anatomy.step_id"]
    return None


def test_layer_and_kernel_spans_eager_steps_only(tiny_llama_dir):
    """Eager steps: one GPU.layer span per decoder layer inside GPU.model_forward; at
    level full each kernel launch too. Graph replays: one forward span, no finer ones."""
    from vllm_anatomy import LLM, SamplingParams
    rec = InMemoryRecorder("full")
    # FULL_DECODE_ONLY: the prefill steps run eager (piecewise replays: the next test).
    llm = LLM(tiny_llama_dir, device="cuda", recorder=rec, max_model_len=256, max_num_seqs=8,
              num_gpu_blocks_override=NUM_BLOCKS, cudagraph_mode="FULL_DECODE_ONLY")
    num_layers = llm.llm_engine.vllm_config.model_config.num_hidden_layers
    llm.generate([{"prompt_token_ids": list(range(1, 40 + i))} for i in range(3)],
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    by_step: dict[int, list] = {}
    for s in rec.spans:
        if s.name.startswith("GPU."):
            by_step.setdefault(s.attrs["vllm_anatomy.step_id"], []).append(s)
    modes = set()
    for step_id, spans in by_step.items():
        (fwd,) = [s for s in spans if s.name == "GPU.model_forward"]
        layers = sorted((s for s in spans if s.name == "GPU.layer"), key=lambda s: s.start_ns)
        kernels = [s for s in spans if s.name.startswith("GPU.kernel.")]
        mode = fwd.attrs["vllm_anatomy.cudagraph_mode"]
        modes.add(mode)
        # The slot mapping is computed before the forward, outside any graph: always timed.
        assert [s.name for s in kernels].count("GPU.kernel.compute_slot_mapping") == 1
        if mode == "FULL":          # the replay is one span: nothing inside it is timed
            assert not layers and len(kernels) == 1
            continue
        assert [s.attrs["vllm_anatomy.layer"] for s in layers] == list(range(num_layers))
        assert all(fwd.start_ns <= s.start_ns <= s.end_ns <= fwd.end_ns for s in layers)
        names = [s.name for s in kernels]
        assert names.count("GPU.kernel.unified_attention") == num_layers
        assert names.count("GPU.kernel.reshape_and_cache") == num_layers
        attn = next(s for s in kernels if s.name == "GPU.kernel.unified_attention")
        assert attn.attrs["vllm_anatomy.bytes"] > 0 and len(attn.attrs["vllm_anatomy.grid"]) == 2
    assert modes == {"FULL", "NONE"}


def test_piecewise_steps_time_their_eager_attention(tiny_llama_dir):
    """A piecewise replay (FULL_AND_PIECEWISE, the default): no layer spans (the hooks ran only at
    capture), the K/V write inside the pieces, and at level full each layer's eager attention timed."""
    from vllm_anatomy import LLM, SamplingParams
    rec = InMemoryRecorder("full")
    llm = LLM(tiny_llama_dir, device="cuda", recorder=rec, max_model_len=256, max_num_seqs=8,
              num_gpu_blocks_override=NUM_BLOCKS)
    num_layers = llm.llm_engine.vllm_config.model_config.num_hidden_layers
    llm.generate([{"prompt_token_ids": list(range(1, 40 + i))} for i in range(3)],
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    pieces = [s for s in rec.spans if s.name == "GPU.model_forward"
              and s.attrs["vllm_anatomy.cudagraph_mode"] == "PIECEWISE"]
    assert pieces
    for fwd in pieces:
        inside = [s for s in rec.spans if s.name.startswith("GPU.") and s is not fwd
                  and s.attrs.get("vllm_anatomy.step_id") == fwd.attrs["vllm_anatomy.step_id"]]
        names = [s.name for s in inside]
        assert "GPU.layer" not in names and names.count("GPU.kernel.reshape_and_cache") == 0
        assert names.count("GPU.kernel.unified_attention") == num_layers


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("cudagraph_mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_draft_model_forwards_on_the_device_lane(tiny_llama_dir, async_scheduling, cudagraph_mode):
    """Speculative decoding with a draft model (the model itself): each proposal is a device phase
    GPU.propose_draft_token_ids after GPU.step (a child of the step, or with async scheduling a
    follower), holding one GPU.draft_model_forward per forward; an eager forward holds its K/V writes
    and attention per layer, a piecewise replay only its eager attention (never a kernel inside a
    graph); num_keys from host values; every span within its parent; the same tokens as level off."""
    from vllm_anatomy import LLM, SamplingParams
    from vllm_anatomy.tracing.trace_check import strict_violations
    k = 3
    prompts = [{"prompt_token_ids": list(range(1, 40 + i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    tokens = {}
    for level in ("off", "full"):
        rec = InMemoryRecorder(level)
        llm = LLM(tiny_llama_dir, device="cuda", recorder=rec, max_model_len=256, max_num_seqs=8,
                  num_gpu_blocks_override=NUM_BLOCKS, async_scheduling=async_scheduling,
                  cudagraph_mode=cudagraph_mode,
                  speculative_config={"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": k})
        num_layers = llm.llm_engine.vllm_config.model_config.num_hidden_layers
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.shutdown()                  # (a last proposal still running is made at shutdown)
        tokens[level] = [list(o.outputs[0].token_ids) for o in outs]
    assert tokens["off"] == tokens["full"]
    spans = rec.spans
    steps = {s.attrs["vllm_anatomy.step_id"]: s for s in spans if s.name == "EngineCore.step"}
    host = [s for s in spans if s.name == "GPUModelRunner.propose_draft_token_ids"]
    phases = [s for s in spans if s.name == "GPU.propose_draft_token_ids"]
    assert host and len(phases) == len(host)
    modes = set()
    for phase in phases:
        step = steps[phase.attrs["vllm_anatomy.step_id"]]
        gpu_step, d2h = ([s for s in spans if s.name == name
                          and s.attrs["vllm_anatomy.step_id"] == phase.attrs["vllm_anatomy.step_id"]][0]
                         for name in ("GPU.step", "GPU.d2h"))
        # After the target's sampling; with async scheduling the output copy (GPU.d2h, on its own
        # stream) may still run beside the drafter.
        assert phase.start_ns >= (d2h.start_ns if async_scheduling else gpu_step.end_ns)
        assert phase.attrs["vllm_anatomy.drafter"] is True
        if async_scheduling:
            assert phase.parent_id is None and phase.links == [(step.trace_id, step.span_id)]
        else:
            assert phase.parent_id == step.span_id
        forwards = sorted((s for s in spans if s.parent_id == phase.span_id), key=lambda s: s.start_ns)
        assert [f.attrs["vllm_anatomy.draft_forward"] for f in forwards] == list(range(k))
        for j, fwd in enumerate(forwards):
            mode = fwd.attrs["vllm_anatomy.cudagraph_mode"]
            modes.add(mode)
            names = sorted(s.name for s in spans if s.parent_id == fwd.span_id)
            if mode == "PIECEWISE":     # the K/V write is inside the pieces: only attention is launched eager
                assert names == ["GPU.kernel.unified_attention"] * num_layers
            else:
                assert names == sorted(["GPU.kernel.reshape_and_cache", "GPU.kernel.unified_attention"] * num_layers)
            for kern in (s for s in spans if s.parent_id == fwd.span_id and s.name.endswith("unified_attention")):
                assert kern.attrs["vllm_anatomy.num_keys"] > 0
                assert kern.attrs.get("vllm_anatomy.num_keys_upper_bound", False) == (async_scheduling and j > 0)
    # (a forward larger than the largest capture size runs eager even with graphs on)
    if cudagraph_mode == "NONE":
        assert modes == {"NONE"}
    else:
        assert "PIECEWISE" in modes and modes <= {"PIECEWISE", "NONE"}
    assert not strict_violations(spans)
