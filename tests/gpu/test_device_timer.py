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
