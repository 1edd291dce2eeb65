"""Tensor parallelism on GPUs (NCCL): TP = N generates the tokens TP = 1 generates.

The CPU tests (tests/distributed, gloo) prove the sharding; these run it where it is
meant to run: one worker process per GPU, NCCL all-reduces and all-gathers on the
current stream, the Triton backend, with CUDA graphs (that capture the collectives)
and without. fp32 weights, so that the all-reduce's different order of additions
cannot flip a greedy token. Needs at least 2 GPUs (`nvidia-h200-x2`); the default
model (9 query heads, 3 KV heads) shards only by 3, so its case needs 3.

    python3 -m pytest -q -m gpu tests/gpu/test_tp_gpu.py
"""

import pytest
import torch

from tests.gpu.conftest import NUM_BLOCKS
from vllm_anatomy.distributed.utils import disable_nvlink_multicast

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices or more")]

# NVLink multicast stays off in every process this starts; the workers inherit it.
disable_nvlink_multicast()


def _tokens(model_dir: str, tp: int, enforce_eager: bool) -> tuple[list[list[int]], dict]:
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model_dir, device="cuda", dtype="float32", tensor_parallel_size=tp, enforce_eager=enforce_eager,
              max_model_len=256, num_gpu_blocks_override=NUM_BLOCKS, max_num_batched_tokens=64, max_num_seqs=16)
    cfg = llm.llm_engine.vllm_config
    # Mixed lengths: chunked prefills beside decodes, then pure-decode steps (graph replays).
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for j in range(n)]}
               for i, n in enumerate([3, 17, 40, 90, 1, 33, 64, 120])]
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        info = {"backend": cfg.model_config.attention_backend, "graphs": cfg.compilation_config.cudagraph_mode,
                "executor": type(llm.llm_engine.engine_core.model_executor).__name__}
    finally:
        llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], info


@pytest.fixture(scope="module")
def qwen3_tp1(qwen3_shape_dir):
    return _tokens(qwen3_shape_dir, 1, enforce_eager=True)[0]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_qwen3_shape_tp_matches_tp1(qwen3_shape_dir, qwen3_tp1, tp, enforce_eager):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} CUDA devices")
    tokens, info = _tokens(qwen3_shape_dir, tp, enforce_eager)
    assert info["backend"] == "triton" and info["executor"] == "MultiprocExecutor", info
    assert (info["graphs"] == "NONE") == enforce_eager, info
    assert tokens == qwen3_tp1
    assert len({t for seq in tokens for t in seq}) > 8          # not one token repeated


@pytest.mark.model
def test_default_model_tp3_matches_tp1(default_model_dir):
    """SmolLM2-135M: 9 query and 3 KV heads split over 3 GPUs, one KV head each."""
    if torch.cuda.device_count() < 3:
        pytest.skip("the default model's 9 heads shard by 3: needs 3 CUDA devices")
    one, _ = _tokens(default_model_dir, 1, enforce_eager=False)
    three, info = _tokens(default_model_dir, 3, enforce_eager=False)
    assert info["executor"] == "MultiprocExecutor"
    assert three == one
