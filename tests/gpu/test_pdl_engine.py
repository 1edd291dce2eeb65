"""VLLM_ANATOMY_PDL=1 on a Hopper GPU (kernels/pdl.py): the decode kernels launched with
programmatic dependent launch compute what they compute without it, bit for bit: a captured
CUDA graph of a layer's kernel chain replays equal to the eager chain without PDL, and whole
greedy runs (CUDA graphs, the split-K GEMM on every shape: VLLM_ANATOMY_SKINNY_GEMM=1, 3D and
2D attention) give the tokens of the switch off.

    python -m pytest -q -m gpu tests/gpu/test_pdl_engine.py
"""
import pytest
import torch

from tests.gpu.conftest import NUM_BLOCKS, generate_greedy_and_close
from tests.gpu.test_fused_qk_norm_rope_engine import tiny_qwen3_dir  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason="needs a CUDA device of compute capability >= 9 (PDL)")]


def _tokens(model_dir, num_prompts, monkeypatch, pdl, enforce_eager=False, max_tokens=24):
    from vllm_anatomy import LLM
    from vllm_anatomy.model_executor.layers.layernorm import RMSNorm
    monkeypatch.setenv("VLLM_ANATOMY_PDL", "1" if pdl else "0")
    monkeypatch.setenv("VLLM_ANATOMY_SKINNY_GEMM", "1")           # the GEMMs through the PDL kernel too
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", max_model_len=512, num_gpu_blocks_override=NUM_BLOCKS,
              max_num_batched_tokens=256, max_num_seqs=128, enforce_eager=enforce_eager)
    vocab = llm.llm_engine.vllm_config.model_config.hf_config["vocab_size"]
    prompts = [[(7 * i + 3 * j) % (min(vocab, 512) - 10) + 5 for j in range(3 + (11 * i) % 40)]
               for i in range(num_prompts)]

    def switch_was_read(llm):
        model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model
        assert {m.pdl for m in model.modules() if isinstance(m, RMSNorm)} == {pdl}
    return generate_greedy_and_close(llm, prompts, max_tokens, before=switch_was_read)


@pytest.mark.parametrize("num_prompts", [9, 100])     # decode batches on the 3D kernel; on the 2D kernel
def test_greedy_tokens_equal_with_pdl_on_and_off(tiny_qwen3_dir, monkeypatch, num_prompts):  # noqa: F811
    on = _tokens(tiny_qwen3_dir, num_prompts, monkeypatch, pdl=True)
    off = _tokens(tiny_qwen3_dir, num_prompts, monkeypatch, pdl=False)
    eager = _tokens(tiny_qwen3_dir, num_prompts, monkeypatch, pdl=True, enforce_eager=True)
    assert on == off == eager


def test_qwen3_shape_bf16_with_pdl_equals_without(qwen3_shape_dir, monkeypatch):
    """Real decode shapes (the 151,936-row lm_head, qkv 4096, gate_up 6144), graphs, PDL on vs off."""
    on = _tokens(qwen3_shape_dir, 24, monkeypatch, pdl=True, max_tokens=32)
    off = _tokens(qwen3_shape_dir, 24, monkeypatch, pdl=False, max_tokens=32)
    assert on == off
    assert len({t for seq in on for t in seq}) > 8


def test_graph_replays_of_a_pdl_chain_equal_the_eager_chain():
    """norm -> gate_up GEMM -> silu_and_mul -> down GEMM (split-K, serial) -> norm, captured with PDL,
    replayed many times over fresh inputs: each replay bit-equal to the chain without PDL."""
    from vllm_anatomy.kernels.rms_norm import rms_norm
    from vllm_anatomy.kernels.silu_and_mul import silu_and_mul
    from vllm_anatomy.kernels.skinny_gemm import new_counters, skinny_gemm
    torch.manual_seed(0)
    m, h, inter = 32, 1024, 3072
    dev, dt = "cuda", torch.bfloat16
    w_norm = torch.randn(h, device=dev, dtype=dt)
    w_gate_up = (torch.randn(2 * inter, h, device=dev) / h ** 0.5).to(dt)
    w_down = (torch.randn(h, inter, device=dev) / inter ** 0.5).to(dt)
    c1, c2 = new_counters(2 * inter, 256, dev), new_counters(h, 256, dev)
    x_in = torch.empty(m, h, device=dev, dtype=dt)
    r_in = torch.empty(m, h, device=dev, dtype=dt)

    def chain(pdl):
        x, r = rms_norm(x_in, w_norm, 1e-6, r_in, pdl=pdl)
        y = silu_and_mul(skinny_gemm(x, w_gate_up, counters=c1, pdl=pdl), pdl=pdl)
        y = skinny_gemm(y, w_down, counters=c2, pdl=pdl)
        return rms_norm(y, w_norm, 1e-6, r, pdl=pdl)

    x_in.normal_()
    r_in.normal_()
    chain(True)                                        # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = chain(True)
    for step in range(20):
        torch.manual_seed(step)
        x_in.normal_()
        r_in.normal_()
        graph.replay()
        want_out, want_res = chain(False)
        torch.cuda.synchronize()
        assert torch.equal(out, want_out) and torch.equal(res, want_res), step
