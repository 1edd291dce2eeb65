"""The default model (SmolLM2-135M: 9 heads, 3 KV heads) split over 3 gloo ranks.

Each rank holds 3 query heads and 1 KV head. With chunked prefill (a 16-token
budget) and a KV cache too small for the batch (requests get preempted and
recomputed), TP=3 generates the same greedy tokens as TP=1, with the same
number of preemptions: the scheduler's accounting does not change with TP.
"""
import pytest
import torch

from vllm_anatomy import LLM, SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPTS = ["The quick brown fox jumps over the lazy dog because",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "What is the capital of France? The capital of France is",
           "List three prime numbers: 2, 3,"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# 7 usable blocks of 16 tokens for 4 requests of up to ~45 tokens: preemptions.
ENGINE_ARGS = dict(num_gpu_blocks_override=8, max_num_batched_tokens=16, max_model_len=112)


def _run(**kwargs) -> tuple[list[list[int]], int]:
    llm = LLM(**ENGINE_ARGS, **kwargs)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], int(llm.get_metrics()["vllm:num_preemptions"])
    finally:
        llm.llm_engine.shutdown()


def test_tp3_equals_tp1_with_chunked_prefill_and_preemption(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokens_1, preemptions_1 = _run()
    finally:
        torch.set_num_threads(threads)
    tokens_3, preemptions_3 = _run(tensor_parallel_size=3)
    assert preemptions_1 > 0
    assert (tokens_3, preemptions_3) == (tokens_1, preemptions_1)
