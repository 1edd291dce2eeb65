"""The engine with tensor parallelism: TP=2 and TP=4 (gloo ranks) generate what TP=1 generates.

Greedy requests and a seeded sampled one, through chunked prefill, on tiny
random Llama / Qwen2 / Qwen3 models (TP=4: each KV head replicated on two
ranks). Every rank samples from the same all-gathered logits; only rank 0
replies. After shutdown no rank is left running.
"""
import os

import pytest
import torch

from vllm_anatomy import LLM, SamplingParams

PROMPTS = ["t5 t6 t7 t8 t9", "t100 t3 t4",
           " ".join(f"t{i}" for i in range(300, 330))]          # 30 tokens: three prefill chunks
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
ENGINE_ARGS = dict(num_gpu_blocks_override=64, max_model_len=256, max_num_batched_tokens=16)


def _generate(llm: LLM) -> list[list[int]]:
    params = [GREEDY, GREEDY, GREEDY, SEEDED]
    outs = llm.generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_tp_models):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for arch, model in tiny_tp_models.items():
            llm = LLM(model=model, **ENGINE_ARGS)
            out[arch] = _generate(llm)
            llm.llm_engine.shutdown()
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp_generates_what_tp1_generates(arch, tp, tiny_tp_models, reference):
    llm = LLM(model=tiny_tp_models[arch], tensor_parallel_size=tp, **ENGINE_ARGS)
    executor = llm.llm_engine.engine_core.model_executor
    pids = [w.proc.pid for w in executor.workers]
    try:
        assert type(executor).__name__ == "MultiprocExecutor" and len(pids) == tp
        assert _generate(llm) == reference[arch]
        assert len(set(reference[arch][0])) > 1         # the model does not just repeat a token
        # Every rank's KV cache holds its own heads: 2 KV heads over tp ranks (at least one).
        shapes = [s["kv_cache_shape"] for s in executor.collective_rpc("snapshot")]
        assert [shape[-2] for shape in shapes] == [max(1, 2 // tp)] * tp
    finally:
        llm.llm_engine.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
