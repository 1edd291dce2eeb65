"""Device-lane spans from CUDA events, resolved after the step's one sync point."""
import pytest
import torch

from vllm_anatomy.tracing.recorder import InMemoryRecorder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PHASES = ["GPU.prepare_inputs", "GPU.model_forward", "GPU.compute_logits", "GPU.sample", "GPU.d2h"]


def test_device_phases_per_step(tiny_llama_dir):
    from vllm_anatomy import LLM, SamplingParams
    rec = InMemoryRecorder("spans")
    llm = LLM(tiny_llama_dir, device="cuda", recorder=rec, max_model_len=256)
    llm.generate([{"prompt_token_ids": list(range(1, 40))}] * 3,
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    steps = [s.attrs["vllm_anatomy.step_id"] for s in rec.find("EngineCore.step")]
    for step_id in steps:
        device = sorted((s for s in rec.spans if s.name.startswith("GPU.")
                         and s.attrs["vllm_anatomy.step_id"] == step_id), key=lambda s: s.start_ns)
        assert [s.name for s in device] == PHASES
        assert all(s.attrs["vllm_anatomy.lane"] == "device" for s in device)
        assert all(a.end_ns == b.start_ns for a, b in zip(device, device[1:]))   # back to back
        assert device[1].duration_ns > 0                                         # the forward took time
        # The device finished the step before the host's sync returned.
        (sync,) = [s for s in rec.find("GPUModelRunner._bookkeeping_sync")
                   if s.parent_id is not None and _step_of(rec, s) == step_id]
        assert device[-1].end_ns <= sync.end_ns


def _step_of(rec, span):
    by_id = {s.span_id: s for s in rec.spans}
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        if "vllm_anatomy.step_id" in span.attrs:
            return span.attrs["vllm_anatomy.step_id"]
    return None
