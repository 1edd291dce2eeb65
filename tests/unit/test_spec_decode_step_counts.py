"""What one speculative-decoding step costs, counted on a CPU (no timing): how many draft-model
forwards and tokens, and which CUDA-graph mode the verify step and each draft forward would get
on a GPU (the dispatchers are pure logic).

    per step, R requests verifying K drafts each (all accepted, the draft being the target):
      target   one forward of R * (1 + K) tokens: a uniform decode of query length 1 + K
               -> FULL graph (vLLM: uniform_decode_query_len), capture sizes multiples of 1 + K
      draft    K forwards: R * (K + 2) tokens (the verified tokens and the bonus one: its KV
               catches up), then K - 1 of R tokens -> PIECEWISE graphs (vLLM's drafter)

The engine runs a tiny random Llama that is its own draft model, so greedy drafts are always
accepted and every count is exact.
"""
from __future__ import annotations

import random

import pytest
import torch

from vllm_anatomy.config import CompilationConfig, default_capture_sizes
from vllm_anatomy.worker.cudagraph import BatchDescriptor, CUDAGraphMode, CudagraphDispatcher, is_uniform_decode

K = 3
NUM_REQS = 4
PROMPT_LEN = 20


def gpu_compilation_config(mode: str = "FULL_AND_PIECEWISE", max_size: int = 64) -> CompilationConfig:
    """The config a GPU engine resolves (EngineArgs._compilation_config), rounded for K drafts."""
    sizes = default_capture_sizes(max_size)
    config = CompilationConfig(mode, sizes, sizes[-1])
    config.adjust_cudagraph_sizes_for_spec_decode(1 + K)
    return config


def test_capture_sizes_round_up_to_multiples_of_one_plus_k_as_vllm():
    config = CompilationConfig("FULL_AND_PIECEWISE", [1, 2, 4, 8, 16, 24, 32], 32)
    config.adjust_cudagraph_sizes_for_spec_decode(4)
    assert (config.cudagraph_capture_sizes, config.max_cudagraph_capture_size) == ([4, 8, 16, 24, 32], 32)
    config.adjust_cudagraph_sizes_for_spec_decode(4)                    # idempotent (one call per worker)
    assert config.cudagraph_capture_sizes == [4, 8, 16, 24, 32]
    odd = CompilationConfig("FULL_AND_PIECEWISE", [1, 2, 4, 8, 16, 24, 32], 32)
    odd.adjust_cudagraph_sizes_for_spec_decode(3)                       # 32 -> 33 is past the max: dropped
    assert (odd.cudagraph_capture_sizes, odd.max_cudagraph_capture_size) == ([3, 6, 9, 18, 24], 24)
    only = CompilationConfig("FULL_AND_PIECEWISE", [2], 5)
    only.adjust_cudagraph_sizes_for_spec_decode(4)                      # nothing but 1 + K itself
    assert only.cudagraph_capture_sizes == [4]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        CompilationConfig("FULL_AND_PIECEWISE", [1, 2], 2).adjust_cudagraph_sizes_for_spec_decode(4)
    plain = CompilationConfig("FULL_AND_PIECEWISE", [1, 2, 4], 4)
    plain.adjust_cudagraph_sizes_for_spec_decode(1)                     # no drafts: unchanged
    assert plain.cudagraph_capture_sizes == [1, 2, 4]


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_verify_step_is_a_uniform_decode_of_query_len_one_plus_k(mode):
    d = CudagraphDispatcher(gpu_compilation_config(mode), max_num_reqs=8, uniform_decode_query_len=1 + K)
    # Full graphs hold whole requests of 1 + K tokens, up to max_num_seqs of them.
    assert d.decode_sizes == [4, 8, 16, 24, 32] and all(s % (1 + K) == 0 for s in d.decode_sizes)
    verify = d.decide(num_tokens=3 * (1 + K), num_reqs=3, max_query_len=1 + K)
    assert (verify.mode, verify.batch_descriptor) == (CUDAGraphMode.FULL, BatchDescriptor(16, 4, uniform=True))
    assert "query_len 4" in verify.reason and "padded 12 -> 16" in verify.reason
    # Not uniform: one request without drafts, or a batch of plain one-token decodes (as vLLM).
    assert not is_uniform_decode(1 + K, 1 + K, 3 * (1 + K) - K, 3)
    plain = d.decide(num_tokens=4, num_reqs=4, max_query_len=1)
    ragged = d.decide(num_tokens=9, num_reqs=3, max_query_len=1 + K)
    expected = CUDAGraphMode.PIECEWISE if mode == "FULL_AND_PIECEWISE" else CUDAGraphMode.NONE
    assert plain.mode is ragged.mode is expected


@pytest.fixture(scope="module")
def counted_run(tiny_llama_dir):
    """Generate with the model as its own draft; record every target and draft forward per step."""
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(tiny_llama_dir, max_model_len=256, speculative_config={
        "method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": K})
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    drafter = runner.drafter
    steps: list[dict] = []
    determine, propose = runner._determine_batch_execution_and_padding, drafter.propose

    def record_target(num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, *args, **kwargs):
        steps.append({"target": (num_tokens, num_reqs, max_num_scheduled_tokens), "draft": []})
        return determine(num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, *args, **kwargs)

    def record_draft(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        steps[-1]["draft"] = list(drafter.last_forwards)
        return drafts
    runner._determine_batch_execution_and_padding = record_target
    drafter.propose = record_draft
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randint(3, 500) for _ in range(PROMPT_LEN)]} for _ in range(NUM_REQS)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=13, ignore_eos=True), use_tqdm=False)
    metrics = llm.get_metrics()
    llm.llm_engine.shutdown()
    return steps, outs, metrics


def test_draft_model_runs_k_forwards_per_step_one_token_per_request_after_the_first(counted_run):
    steps, outs, metrics = counted_run
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == metrics["vllm:spec_decode_num_draft_tokens"] > 0
    assert [len(o.outputs[0].token_ids) for o in outs] == [13] * NUM_REQS
    # 13 tokens: the prefill samples 1, then 3 steps of 1 + K = 4 (all accepted).
    assert len(steps) == 4
    prefill, decodes = steps[0], steps[1:]
    assert prefill["target"] == (NUM_REQS * PROMPT_LEN, NUM_REQS, PROMPT_LEN)
    # The prefill's first pass: the whole prompt and the sampled token, once (never again).
    assert [n for _, n, _ in prefill["draft"]] == [NUM_REQS * (PROMPT_LEN + 1)] + [NUM_REQS] * (K - 1)
    for step in decodes:           # (the last one proposes too: the runner does not know who finished)
        assert step["target"] == (NUM_REQS * (1 + K), NUM_REQS, 1 + K)
        tokens = [n for _, n, _ in step["draft"]]
        assert tokens == [NUM_REQS * (K + 2)] + [NUM_REQS] * (K - 1)
        # Draft-model tokens per step: the verified ones + the bonus, then one per request per draft.
        assert sum(tokens) == NUM_REQS * (K + 2) + NUM_REQS * (K - 1)
    draft_modes = {mode for s in steps[1:] for mode, _, _ in s["draft"]}
    if torch.cuda.is_available():   # the engine runs on the GPU: decode steps' draft forwards replay pieces
        assert draft_modes == {CUDAGraphMode.PIECEWISE}
    else:                           # on a CPU every forward is eager
        assert draft_modes | {mode for mode, _, _ in steps[0]["draft"]} == {CUDAGraphMode.NONE}


def test_on_a_gpu_verify_steps_replay_full_graphs_and_draft_forwards_replay_pieces(counted_run):
    """The shapes counted above, through the dispatchers a GPU engine builds (same config logic)."""
    from vllm_anatomy.spec_decode.draft_model import DRAFTER_CUDAGRAPH_MODES
    steps, _, _ = counted_run
    config = gpu_compilation_config()
    target = CudagraphDispatcher(config, max_num_reqs=NUM_REQS, uniform_decode_query_len=1 + K)
    drafter = CudagraphDispatcher(config, max_num_reqs=NUM_REQS)
    target_modes = [target.decide(*s["target"]).mode for s in steps]
    assert target_modes == [CUDAGraphMode.NONE] + [CUDAGraphMode.FULL] * (len(steps) - 1)   # 80-token prefill > 64
    draft_modes = [drafter.dispatch(n, valid_modes=DRAFTER_CUDAGRAPH_MODES)[0]
                   for s in steps for _, n, _ in s["draft"]]
    assert draft_modes.count(CUDAGraphMode.NONE) == 1                   # the prefill's 84-token first pass
    assert draft_modes[1:] == [CUDAGraphMode.PIECEWISE] * (len(draft_modes) - 1)
