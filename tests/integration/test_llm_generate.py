"""LLM.generate on the real default model equals transformers' greedy tokens,
under the scheduler's interesting regimes: defaults, chunked prefill, preemption
and prefix caching. The regime is asserted from the engine's own counters.
Greedy with repetition_penalty equals transformers' `generate(repetition_penalty=...)`
(its RepetitionPenaltyLogitsProcessor penalizes prompt and generated tokens, as
vLLM's does), also under async scheduling (the penalty reads tokens that arrive
as placeholders) and preemption (a resumed request's output list is rebuilt)."""
import pytest
import torch

from vllm_anatomy import LLM, SamplingParams

pytestmark = pytest.mark.model

MAX_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What is 12 plus 30?",
    "Write one sentence about the sea.",
    "Who wrote Romeo and Juliet?",
    "What do bees make?",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):",
    "In 1969, the first humans",
]
# A long shared system prompt: more than a few KV blocks of common prefix.
SYSTEM = ("You are a meticulous assistant for a museum of computing history. "
          "Answer briefly, precisely and politely. Mention dates when you know them. " * 3)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
    return get_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def _chat_ids(tok, question, system=None):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [_chat_ids(tokenizer, q) for q in QUESTIONS] + [tokenizer.encode(p) for p in RAW]


@pytest.fixture(scope="module")
def shared_prefix_prompts(tokenizer):
    return [_chat_ids(tokenizer, q, SYSTEM) for q in QUESTIONS[:4]]


_hf_cache: dict[tuple, list[int]] = {}


def hf_greedy(hf_model, ids, max_tokens=MAX_TOKENS, eos=2, repetition_penalty=1.0):
    key = (tuple(ids), max_tokens, repetition_penalty)
    if key not in _hf_cache:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos, repetition_penalty=repetition_penalty)
        _hf_cache[key] = out[0, len(ids):].tolist()
    return _hf_cache[key]


def _engine_tokens(llm, prompts, repetition_penalty=1.0):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=repetition_penalty),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def _check_equal(hf_model, prompts, got, repetition_penalty=1.0):
    for ids, toks in zip(prompts, got):
        want = hf_greedy(hf_model, ids, repetition_penalty=repetition_penalty)
        assert toks == want, f"prompt {ids[-8:]}...: engine {toks} != transformers {want}"


def test_defaults(default_model_dir, hf_model, prompts):
    assert len(prompts) >= 8
    llm = LLM(default_model_dir)
    got, outs = _engine_tokens(llm, prompts)
    _check_equal(hf_model, prompts, got)
    assert "Paris" in outs[0].outputs[0].text
    m = llm.get_metrics()
    assert m["vllm:num_preemptions"] == 0


# NOTE: async scheduling is off by default on a CPU; these regimes are where
# its bookkeeping (placeholders, stale outputs of preempted requests, blocks
# cached a step late) could go wrong, so they run both ways.
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@ASYNC
def test_chunked_prefill(default_model_dir, hf_model, prompts, async_scheduling):
    llm = LLM(default_model_dir, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    got, _ = _engine_tokens(llm, prompts)
    _check_equal(hf_model, prompts, got)
    # Every prompt is longer than nothing; several chat prompts exceed 32 tokens, so
    # prefill must have been split over steps: more steps than the longest output.
    assert max(len(p) for p in prompts) > 32
    assert llm.get_metrics()["vllm_anatomy:engine_steps"] > MAX_TOKENS + max(len(p) for p in prompts) // 32


@ASYNC
def test_preemption(default_model_dir, hf_model, prompts, async_scheduling):
    # 12 usable blocks of 16 tokens for 9 requests of ~30-60 tokens each: they
    # cannot all stay resident, so the scheduler must preempt (and recompute).
    llm = LLM(default_model_dir, num_gpu_blocks_override=13, max_model_len=192,
              enable_prefix_caching=False, async_scheduling=async_scheduling)
    got, _ = _engine_tokens(llm, prompts)
    _check_equal(hf_model, prompts, got)
    assert llm.get_metrics()["vllm:num_preemptions"] > 0


@ASYNC
def test_prefix_caching(default_model_dir, hf_model, shared_prefix_prompts, async_scheduling):
    llm = LLM(default_model_dir, async_scheduling=async_scheduling)
    # First one alone fills the cache with the shared prefix; then the others hit it.
    got0, _ = _engine_tokens(llm, shared_prefix_prompts[:1])
    got1, outs = _engine_tokens(llm, shared_prefix_prompts[1:])
    _check_equal(hf_model, shared_prefix_prompts, got0 + got1)
    m = llm.get_metrics()
    assert m["vllm:prefix_cache_hits"] > 0
    assert all(o.num_cached_tokens >= 16 for o in outs)


# -- greedy + repetition_penalty ---------------------------------------------------------------
PENALTY = 1.3


def test_repetition_penalty(default_model_dir, hf_model, prompts):
    llm = LLM(default_model_dir)
    got, _ = _engine_tokens(llm, prompts, PENALTY)
    _check_equal(hf_model, prompts, got, PENALTY)
    # The test can fail: the penalty changes what plain greedy decoding says.
    assert sum(hf_greedy(hf_model, p, repetition_penalty=PENALTY) != hf_greedy(hf_model, p) for p in prompts) >= 2


def test_repetition_penalty_async_chunked_prefill(default_model_dir, hf_model, prompts):
    llm = LLM(default_model_dir, max_num_batched_tokens=32, async_scheduling=True)
    got, _ = _engine_tokens(llm, prompts, PENALTY)
    _check_equal(hf_model, prompts, got, PENALTY)


def test_repetition_penalty_preemption(default_model_dir, hf_model, prompts):
    llm = LLM(default_model_dir, num_gpu_blocks_override=13, max_model_len=192,
              enable_prefix_caching=False, async_scheduling=True)
    got, _ = _engine_tokens(llm, prompts, PENALTY)
    _check_equal(hf_model, prompts, got, PENALTY)
    assert llm.get_metrics()["vllm:num_preemptions"] > 0
