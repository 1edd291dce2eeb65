"""Pydantic models of the chat completions API: the request, the response and its stream chunks.

Mirrors vllm/entrypoints/openai/chat_completion/protocol.py, names verbatim; what
every request shares (strict types, errors, usage, sampling fields) is in protocol.py.

Prompt logprobs, as in v0.27.1: `prompt_logprobs: k` asks for them, and so does
`echo` (with top_logprobs' k, 0 by default, unless prompt_logprobs says otherwise);
the response carries them once, top-level (`prompt_logprobs`), never in a stream.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_serializer

from vllm_anatomy.entrypoints.openai.protocol import (Int64, OpenAIBaseModel, SamplingRequest, Text, UsageInfo,
                                                      random_uuid)
from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.outputs import Logprob
from vllm_anatomy.sampling_params import SamplingParams

class ChatCompletionContentPartTextParam(OpenAIBaseModel):
    type: Literal["text"]
    text: Text


class ChatCompletionMessageParam(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ChatCompletionContentPartTextParam] | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as the chat template reads it: role, text content, and every
        other field the client sent (name, tool_calls, ...), as vLLM passes them on."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in ("role", "content")}
        message = {"role": self.role, "content": self.text(), **extra}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    # Ordered like the OpenAI API reference: https://platform.openai.com/docs/api-reference/chat
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: Int64 | None = 0
    max_completion_tokens: Int64 | None = None
    # vLLM extras (vLLM's chat_completion/protocol.py; how each changes the prompt: serving_chat.py)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    request_id: Text | None = None
    return_tokens_as_token_ids: bool | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.continue_final_message and self.add_generation_prompt:
            raise VLLMValidationError("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                      "True (add_generation_prompt defaults to true: set it to false).",
                                      parameter="continue_final_message")

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.check_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise VLLMValidationError("top_logprobs needs logprobs to be true.", parameter="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens if self.max_tokens is not None else default_max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.top_logprobs   # NOTE: v0.27.1's rule: echo alone asks for 0 (scored token only)
        return self._sampling_params(max_tokens, logprobs, prompt_logprobs)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    # vLLM extra: the prompt, token by token (None first), when asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        # NOTE: OpenAI's deltas omit absent fields ({"content": "Hi"}, no "role": null).
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


