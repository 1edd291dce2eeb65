"""Speculative decoding on the GPU: the Triton attention backend, CUDA graphs (a step with
drafts is not a uniform one-token decode: piecewise graphs) and the rejection sampler's
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


def _run(model_dir, speculative_config=None, temperature=0.0, **kw):
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model_dir, device="cuda", dtype="float32", max_model_len=1024, num_gpu_blocks_override=2048,
              async_scheduling=False, speculative_config=speculative_config, **kw)
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


def test_random_sampling_with_drafts_runs_and_reproduces(default_dir):
    config = {"method": "draft_model", "model": default_dir, "num_speculative_tokens": K}
    first, m = _run(default_dir, config, temperature=0.8)
    again, _ = _run(default_dir, config, temperature=0.8)
    assert first == again                                   # seeded requests
    assert 0 < m["vllm:spec_decode_num_accepted_tokens"] <= m["vllm:spec_decode_num_draft_tokens"]
