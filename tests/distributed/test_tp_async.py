"""Async scheduling with worker processes: TP=2 (gloo ranks) under
--async-scheduling generates what TP=1 generates synchronously, plain and under
a grammar (the bitmask is broadcast to both ranks, each applies it).

The engine schedules step N+1 and enqueues it before it reads step N's reply
(execute_model / sample_tokens with non_block=True: FutureWrapper); every rank
resolves its AsyncModelRunnerOutput before the next call.
"""
import pytest
import torch

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.sampling_params import StructuredOutputsParams

PROMPTS = ["t5 t6 t7 t8 t9", " ".join(f"t{i}" for i in range(300, 330))]   # the second: chunked prefill
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# The tiny models' word-level vocabulary: "t0".."t511", EOS "t2". Single-digit tokens
# only: "t10" would let "t1" in (a prefix of it, the grammar allows it), and after
# "t1" no token of this vocabulary continues: every logit -inf (xgrammar's masks
# look one token ahead, in vLLM too).
CHOICE = SamplingParams(temperature=1.0, seed=7, max_tokens=12,
                        structured_outputs=StructuredOutputsParams(choice=["t7t8", "t9", "t5t6t7"]))
ENGINE_ARGS = dict(num_gpu_blocks_override=64, max_model_len=256, max_num_batched_tokens=16)


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS + PROMPTS[:1], [GREEDY, GREEDY, CHOICE], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_async_generates_what_tp1_sync_generates(arch, tiny_tp_models):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(model=tiny_tp_models[arch], **ENGINE_ARGS)
        reference = _generate(llm)
        llm.llm_engine.shutdown()
    finally:
        torch.set_num_threads(threads)
    llm = LLM(model=tiny_tp_models[arch], tensor_parallel_size=2, async_scheduling=True, **ENGINE_ARGS)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        assert _generate(llm) == reference
    finally:
        llm.llm_engine.shutdown()
    # The constrained request wrote one of the choices, then EOS ("t2").
    assert reference[2] in ([7, 8, 2], [9, 2], [5, 6, 7, 2])
