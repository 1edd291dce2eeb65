"""Speculative decoding on the GPU: the Triton attention backend, CUDA graphs (a step where every
request verifies K drafts is a uniform decode of query length 1 + K: a FULL graph; the draft
model's forwards replay its own PIECEWISE graphs) and the rejection sampler's
Triton kernels give the same greedy tokens as the engine without speculation, for ngram, the
model as its own draft (every draft accepted) and a cut of it (most rejected). fp32, so that
verifying 1 + K positions in one forward cannot flip an argmax that a one-token step would
not (bf16 rounds the two kernel paths differently)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

K = 3
QUESTIONS = ["Repeat this sentence exactly: the small red boat sails across the quiet blue lake at dawn.",
             "Write the numbers from one to twenty as words, separated by commas.",
             "What is the capital of France?", "def fibonacci(n):"]


def _run(model_dir, speculative_config=None, temperature=0.0, async_scheduling=False, **kw):
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model_dir, device="cuda", dtype="float32", max_model_len=1024, num_gpu_blocks_override=2048,
              async_scheduling=async_scheduling, speculative_config=speculative_config, **kw)
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is async_scheduling
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                            add_generation_prompt=True, return_dict=False)}
               for q in QUESTIONS]
    sp = SamplingParams(temperature=temperature, max_tokens=48, seed=7 if temperature else None)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    metrics = llm.get_metrics()
    llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], metrics


@pytest.fixture(scope="module")
def default_dir():
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    return str(ensure_default_model())


@pytest.fixture(scope="module")
def baseline(default_dir):
    return _run(default_dir)[0]


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_cut"])
def test_greedy_tokens_equal_without_speculation(default_dir, baseline, method, tmp_path):
    if method == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    else:
        from vllm_anatomy.transformers_utils.draft_model_utils import write_truncated_draft
        model = default_dir if method == "draft_self" else write_truncated_draft(default_dir, 8, tmp_path / "d")
        config = {"method": "draft_model", "model": model, "num_speculative_tokens": K}
    tokens, m = _run(default_dir, config)
    assert tokens == baseline
    assert m["vllm:spec_decode_num_drafts"] > 0
    if method == "draft_self":
        assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("method", ["draft_self", "draft_cut"])
def test_async_scheduling_with_a_draft_model_equals_without_speculation(default_dir, baseline, method, tmp_path):
    """Explicit async scheduling + a draft model (worker/async_spec_decode.py): the drafts stay on the
    device (-1 placeholders in the scheduler), the padded drafter batch replays the draft model's
    pieces, the next step reads the accepted counts; the same greedy tokens as without speculation."""
    from vllm_anatomy.transformers_utils.draft_model_utils import write_truncated_draft
    model = default_dir if method == "draft_self" else write_truncated_draft(default_dir, 8, tmp_path / "d")
    config = {"method": "draft_model", "model": model, "num_speculative_tokens": K}
    tokens, m = _run(default_dir, config, async_scheduling=True)
    assert tokens == baseline
    assert m["vllm:spec_decode_num_drafts"] > 0
    if method == "draft_self":
        assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"]
    else:
        assert m["vllm:spec_decode_num_accepted_tokens"] < m["vllm:spec_decode_num_draft_tokens"]


def test_random_sampling_with_drafts_runs_and_reproduces(default_dir):
    config = {"method": "draft_model", "model": default_dir, "num_speculative_tokens": K}
    first, m = _run(default_dir, config, temperature=0.8)
    again, _ = _run(default_dir, config, temperature=0.8)
    assert first == again                                   # seeded requests
    assert 0 < m["vllm:spec_decode_num_accepted_tokens"] <= m["vllm:spec_decode_num_draft_tokens"]


def test_verify_steps_replay_full_graphs_and_draft_forwards_replay_pieces(default_dir):
    """The structural fix of the per-step cost (tests/unit/test_spec_decode_step_counts.py counts the
    same shapes on a CPU): every decode step of the model as its own draft verifies K drafts per
    request in one FULL graph (capture sizes multiples of 1 + K), and each draft forward that fits
    the largest capture size replays the draft model's pieces."""
    from vllm_anatomy import LLM, SamplingParams
    from vllm_anatomy.worker.cudagraph import CUDAGraphMode
    llm = LLM(default_dir, device="cuda", max_model_len=1024, num_gpu_blocks_override=2048, async_scheduling=False,
              speculative_config={"method": "draft_model", "model": default_dir, "num_speculative_tokens": K})
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    assert runner.cudagraph_dispatcher.decode_sizes and all(s % (1 + K) == 0 for s in runner.cudagraph_dispatcher.decode_sizes)
    target_modes, draft_modes = [], []
    determine, propose = runner._determine_batch_execution_and_padding, runner.drafter.propose

    def record_target(*args, **kwargs):
        out = determine(*args, **kwargs)
        num_tokens, num_reqs, _, max_query_len = args[:4]
        target_modes.append((runner.cudagraph_decision.mode, num_tokens == num_reqs * max_query_len == num_reqs * (1 + K)))
        return out

    def record_draft(*args, **kwargs):
        out = propose(*args, **kwargs)
        draft_modes.extend(mode for mode, _, _ in runner.drafter.last_forwards)
        return out
    runner._determine_batch_execution_and_padding, runner.drafter.propose = record_target, record_draft
    llm.generate([{"prompt_token_ids": [100 + i] * 16} for i in range(8)],
                 SamplingParams(temperature=0, max_tokens=33, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    verify = [mode for mode, uniform in target_modes if uniform]
    assert verify and set(verify) == {CUDAGraphMode.FULL}, target_modes
    assert draft_modes and set(draft_modes) == {CUDAGraphMode.PIECEWISE}, draft_modes
