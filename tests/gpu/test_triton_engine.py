"""The whole engine on the GPU: the Triton backend (and the slot_mapping kernel)
gives the same greedy tokens as the torch reference backend, over a batch of
mixed lengths with chunked prefill and decodes in the same steps."""
import pytest
import torch

from tests.gpu.conftest import NUM_BLOCKS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _tokens(model_dir, backend, trace_level="off"):
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model_dir, device="cuda", dtype="float32", attention_backend=backend, max_model_len=256,
              num_gpu_blocks_override=NUM_BLOCKS,
              max_num_batched_tokens=64, max_num_seqs=16, trace_level=trace_level,
              **({"trace_dir": "/tmp/vllm_anatomy_gpu_traces"} if trace_level != "off" else {}))
    cfg = llm.llm_engine.vllm_config.model_config
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for j in range(n)]}
               for i, n in enumerate([3, 17, 40, 90, 1, 33, 64, 120])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    return cfg.attention_backend, [o.outputs[0].token_ids for o in outs]


def test_triton_backend_matches_torch_backend(tiny_llama_dir):
    name_t, triton_tokens = _tokens(tiny_llama_dir, "auto")      # auto = triton on CUDA
    name_r, torch_tokens = _tokens(tiny_llama_dir, "torch")
    assert (name_t, name_r) == ("triton", "torch")
    assert triton_tokens == torch_tokens
    # At trace level full every kernel launch is timed and snapshots taken: same tokens.
    assert _tokens(tiny_llama_dir, "triton", trace_level="full")[1] == triton_tokens


def test_prefill_kernel_switch_matches_torch_backend(tiny_llama_dir, monkeypatch):
    """VLLM_ANATOMY_PREFILL_KERNEL=1: fresh prefills through the prefill kernel (eager and in
    piecewise CUDA-graph replays), same greedy tokens as the torch backend, traced or not."""
    from vllm_anatomy.kernels import prefill_attention as pa
    launches = []
    real = pa.context_attention_fwd
    monkeypatch.setattr(pa, "context_attention_fwd", lambda *a, **k: launches.append(1) or real(*a, **k))
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", "1")
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
    _, on_tokens = _tokens(tiny_llama_dir, "triton")
    assert launches, "the prefill kernel never ran"
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", "0")
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
    _, torch_tokens = _tokens(tiny_llama_dir, "torch")
    assert on_tokens == torch_tokens
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_KERNEL", "1")
    monkeypatch.setenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2")   # split even the short test prompts
    assert _tokens(tiny_llama_dir, "triton", trace_level="full")[1] == on_tokens


def test_decode_lpt_switch_matches_torch_backend(tiny_llama_dir, monkeypatch):
    """VLLM_ANATOMY_DECODE_LPT=1 (decode-only steps run longest context first, through the
    FULL graphs' persistent order buffer; split-KV off so that every decode takes the 2D
    kernel): the same greedy tokens as =0 and as the torch backend, traced or not."""
    from vllm_anatomy.attention.backends import triton_attn
    from vllm_anatomy.kernels import unified_attention as ua
    monkeypatch.setattr(triton_attn, "MIN_LAUNCH_GRID_SIZE_2D", 0)
    ordered = []
    real = ua.unified_attention
    monkeypatch.setattr(ua, "unified_attention", lambda *a, **k: ordered.append(
        ua.use_seq_order(k["max_seqlen_q"], False, k.get("seq_order") is not None)) or real(*a, **k))
    monkeypatch.setenv("VLLM_ANATOMY_DECODE_LPT", "1")
    _, on_tokens = _tokens(tiny_llama_dir, "triton")
    assert any(ordered), "no decode launch took the order (graph capture included)"
    ordered.clear()
    monkeypatch.setenv("VLLM_ANATOMY_DECODE_LPT", "0")
    _, off_tokens = _tokens(tiny_llama_dir, "triton")
    assert not any(ordered)
    _, torch_tokens = _tokens(tiny_llama_dir, "torch")
    assert on_tokens == off_tokens == torch_tokens
    monkeypatch.setenv("VLLM_ANATOMY_DECODE_LPT", "1")
    assert _tokens(tiny_llama_dir, "triton", trace_level="full")[1] == on_tokens
