"""Pydantic models of the completions API: the request, the response and its stream chunks.

Mirrors vllm/entrypoints/openai/completion/protocol.py, names verbatim; what
every request shares (strict types, errors, usage, sampling fields) is in protocol.py.

Prompt logprobs, as in v0.27.1: `prompt_logprobs: k` asks for them; `echo` with
`logprobs: k` asks for them too (k, unless prompt_logprobs says otherwise), so the
echoed prompt tokens get logprobs (the first: null); `echo` with `max_tokens: 0`
answers the prompt alone (the engine runs one token, which is not returned:
the scoring request of evaluation harnesses). Each choice carries
`prompt_logprobs`: [null, {token id: {logprob, rank, decoded_token}}, ...].
"""
from __future__ import annotations

import time
from typing import Literal, cast

from pydantic import Field

from vllm_anatomy.entrypoints.openai.protocol import (Int64, OpenAIBaseModel, SamplingRequest, Text, TokenId,
                                                      UsageInfo, random_uuid)
from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.outputs import Logprob
from vllm_anatomy.sampling_params import SamplingParams

class CompletionRequest(SamplingRequest):
    # https://platform.openai.com/docs/api-reference/completions/create
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool | None = False
    suffix: Text | None = None
    best_of: Int64 | None = None
    # vLLM extras
    add_special_tokens: bool = True
    request_id: Text | None = None
    return_tokens_as_token_ids: bool | None = None

    def get_prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of texts or of token-id lists), each non-empty."""
        p = self.prompt
        batch: list[str | list[int]]
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            batch = cast("list[str | list[int]]", p)
        else:
            # NOTE: a list left here is list[int] (one prompt of token ids): pydantic validated the union.
            batch = [cast("str | list[int]", p)]
        for i, prompt in enumerate(batch):
            if len(prompt) == 0:
                raise VLLMValidationError("prompt must not be empty." if len(batch) == 1 else
                                          f"prompt {i} of the batch is empty.", parameter="prompt")
        return batch

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.check_unsupported()
        if self.suffix is not None:
            raise VLLMValidationError("suffix is not supported by this engine.", parameter="suffix")
        if self.best_of not in (None, 1):
            raise VLLMValidationError("best_of is not supported (vLLM v0.27.1 has no best_of); "
                                      "use n for several samples.", parameter="best_of")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs       # the echoed prompt's logprobs
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        # NOTE: the engine always samples at least one token; it is dropped (serving_completion.py).
        if self.echo_without_generation():
            max_tokens = 1
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)

    def echo_without_generation(self) -> bool:
        """echo with max_tokens 0: answer the prompt (and its logprobs) alone."""
        return bool(self.echo) and self.max_tokens == 0


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM extra: the choice's prompt, token by token (None first), when asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None

