"""prompt_logprobs on the OpenAI requests, without a model: v0.27.1's validation (its
order and the field it names), what asks for prompt logprobs (the field, completions'
echo with logprobs, chat's echo), echo with max_tokens 0, and the -inf clamp."""
from __future__ import annotations

import re

import pytest

from vllm_anatomy.entrypoints.openai.chat_protocol import ChatCompletionRequest
from vllm_anatomy.entrypoints.openai.completion_protocol import CompletionRequest
from vllm_anatomy.entrypoints.openai.serving_engine import clamp_prompt_logprobs
from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.outputs import Logprob

MESSAGES = [{"role": "user", "content": "Hi"}]


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hi", **kw})


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **kw})


@pytest.mark.parametrize("make", [completion, chat])
@pytest.mark.parametrize("body, words", [
    ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
    ({"prompt_logprobs": -1, "stream": True}, "not available when `stream=True`"),
    ({"prompt_logprobs": -2}, "must be a positive value or -1, got -2"),
    ({"prompt_logprobs": -2, "stream": True}, "must be a positive value or -1"),   # (the stream rule lets it by)
])
def test_bad_prompt_logprobs_are_refused_naming_the_field(make, body, words):
    request = make(**body)
    with pytest.raises(VLLMValidationError, match=re.escape(words)) as e:
        request.to_sampling_params(16)
    assert e.value.parameter == "prompt_logprobs"


@pytest.mark.parametrize("make", [completion, chat])
def test_prompt_logprobs_reach_sampling_params(make):
    assert make(prompt_logprobs=3).to_sampling_params(16).prompt_logprobs == 3
    assert make().to_sampling_params(16).prompt_logprobs is None
    # 0 with a stream is let through (v0.27.1): the scored token only, sent in no chunk.
    assert make(prompt_logprobs=0, stream=True).to_sampling_params(16).prompt_logprobs == 0
    # Past max_logprobs: the engine's own bound, naming the field.
    with pytest.raises(VLLMValidationError) as e:
        make(prompt_logprobs=21).to_sampling_params(16)
    assert e.value.parameter == "prompt_logprobs"


def test_completion_echo_asks_for_prompt_logprobs_as_logprobs_says():
    assert completion(echo=True).to_sampling_params(16).prompt_logprobs is None
    assert completion(echo=True, logprobs=2).to_sampling_params(16).prompt_logprobs == 2
    assert completion(echo=True, logprobs=2, prompt_logprobs=4).to_sampling_params(16).prompt_logprobs == 4
    assert completion(logprobs=2).to_sampling_params(16).prompt_logprobs is None


def test_completion_echo_with_max_tokens_zero_runs_one_token():
    request = completion(echo=True, max_tokens=0, logprobs=1)
    assert request.echo_without_generation()
    params = request.to_sampling_params(16)
    assert params.max_tokens == 1 and params.prompt_logprobs == 1
    with pytest.raises(VLLMValidationError) as e:       # without echo, 0 stays refused (as in v0.27.1)
        completion(max_tokens=0).to_sampling_params(16)
    assert e.value.parameter == "max_tokens"


def test_chat_echo_asks_for_prompt_logprobs_with_top_logprobs():
    assert chat(echo=True).to_sampling_params(16).prompt_logprobs == 0       # top_logprobs defaults to 0
    assert chat(echo=True, logprobs=True, top_logprobs=3).to_sampling_params(16).prompt_logprobs == 3
    assert chat(echo=True, prompt_logprobs=2).to_sampling_params(16).prompt_logprobs == 2
    assert chat(logprobs=True, top_logprobs=3).to_sampling_params(16).prompt_logprobs is None


def test_clamp_prompt_logprobs_copies_and_clamps_minus_infinity():
    engine = [None, {5: Logprob(float("-inf"), 7, "a"), 6: Logprob(-1.5, 1, "b")}]
    clamped = clamp_prompt_logprobs(engine)
    assert clamped == [None, {5: Logprob(-9999.0, 7, "a"), 6: Logprob(-1.5, 1, "b")}]
    assert engine[1][5].logprob == float("-inf")          # the engine's objects are left as they were
    assert clamp_prompt_logprobs(None) is None
