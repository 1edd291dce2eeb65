"""OpenAIServingChat: POST /v1/chat/completions.

Mirrors vllm/entrypoints/openai/chat_completion/serving.py: render the conversation with
the tokenizer's chat template, tokenize, validate, hand the prompt token ids to
the engine, and turn RequestOutputs into a ChatCompletionResponse or a stream
of `chat.completion.chunk` server-sent events ending with `data: [DONE]`.
With n > 1 there are n choices (the engine's n child requests, engine/
parallel_sampling.py), each chunk carries one choice and its index, and
each choice's first chunk carries only the role, as in vLLM.

How the request's fields shape the prompt (vLLM's semantics): the template is
the tokenizer's, or the request's own (`chat_template`, only with
--trust-request-chat-template: chat_template.py); `chat_template_kwargs` and
`documents` become template variables; `add_generation_prompt` opens the
assistant's turn, while `continue_final_message` leaves the last message open so
the model continues it (its text, with `echo`, is also prepended to the answer
when it is the assistant's); `add_special_tokens` adds the tokenizer's BOS on top
of what the template wrote. `prompt_logprobs` (asked for, or by `echo`: chat_protocol.py)
come back once, top-level in the response, for the whole templated prompt.

NOTE: a stream is an async generator wrapping the engine's generator. When the
client goes away the server closes the stream (see api_server.py), the `finally`
of OpenAIServing._sse_stream closes the engine generator, and AsyncLLM aborts the request, so its KV
blocks go back to the pool.
"""
from __future__ import annotations

import time
from typing import AsyncGenerator

from starlette.requests import Request

from vllm_anatomy.entrypoints.openai.chat_protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                           ChatCompletionLogProbsContent, ChatCompletionRequest,
                                                           ChatCompletionResponse, ChatCompletionResponseChoice,
                                                           ChatCompletionResponseStreamChoice,
                                                           ChatCompletionStreamResponse, ChatMessage, DeltaMessage)
from vllm_anatomy.entrypoints.openai.chat_template import resolve_chat_template, validate_chat_template
from vllm_anatomy.entrypoints.openai.protocol import UsageInfo
from vllm_anatomy.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing, clamp_prompt_logprobs,
                                                            format_token_id_placeholder, raise_if_error, sse)
from vllm_anatomy.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):

    response_role = "assistant"

    def __init__(self, *args, trust_request_chat_template: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trust_request_chat_template = trust_request_chat_template

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request | None = None
                                     ) -> ChatCompletionResponse | AsyncGenerator[str, None]:
        """Validate everything (VLLMValidationError / OpenAIError -> 4xx), then answer or stream."""
        self._check_model(request.model)
        request_id = f"chatcmpl-{self._base_request_id(raw_request, request.request_id)}"
        request.check_unsupported()
        validate_chat_template(request.chat_template, request.chat_template_kwargs, self.trust_request_chat_template)
        self._check_text_len(sum(len(m.text()) for m in request.messages), "messages")
        prompt_text, prompt_ids = await self._run_in_tokenizer_thread(self._render_chat, request)
        self._validate_prompt_ids(prompt_ids)
        params = await self._to_sampling_params(request, self._default_max_tokens(prompt_ids))
        name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        self._validate_inputs(prompt_ids, params, name)
        model_name = self.models.model_name_for(request.model)
        generator = self._generate({"prompt_token_ids": prompt_ids, "prompt": prompt_text},
                                   params, request_id, raw_request, request.priority)
        num_top = request.top_logprobs or 0
        if request.stream:
            return self._sse_stream(self.chat_completion_stream_generator(
                request, generator, request_id, model_name, num_top), generator)
        return await self.chat_completion_full_generator(generator, request_id, model_name, num_top,
                                                         request)

    def _render_chat(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """Template, then tokenize (runs in the tokenizer thread)."""
        conversation = [m.for_template() for m in request.messages]
        template, template_kwargs = resolve_chat_template(self.tokenizer, request.chat_template,
                                                          request.chat_template_kwargs)
        if request.documents is not None:
            template_kwargs["documents"] = request.documents
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, chat_template=template, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, **template_kwargs)
        except Exception as e:  # jinja2 TemplateError / raise_exception() inside templates
            raise OpenAIError(f"The chat template could not render these messages: {e}",
                              param="messages") from e
        # NOTE: the template already wrote the special tokens (<|im_start|> ...),
        # so tokenizing adds a BOS of its own only if asked (vLLM's default: no).
        self._check_text_len(len(text), "messages")
        return text, self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

    def _echo_text(self, request: ChatCompletionRequest) -> str:
        """With echo: the last message's text, when it is the assistant's (vLLM's rule)."""
        last = request.messages[-1]
        return last.text() if request.echo and last.role == self.response_role else ""

    async def chat_completion_full_generator(self, result_generator: AsyncGenerator[RequestOutput, None],
                                             request_id: str, model_name: str, num_top: int,
                                             request: ChatCompletionRequest) -> ChatCompletionResponse:
        final = await self._final_output(result_generator, request_id)
        echo = self._echo_text(request)
        choices = [ChatCompletionResponseChoice(
            index=output.index, message=ChatMessage(role=self.response_role, content=echo + output.text),
            logprobs=self._create_chat_logprobs(output, num_top, request.return_tokens_as_token_ids),
            finish_reason=output.finish_reason, stop_reason=output.stop_reason) for output in final.outputs]
        num_prompt_tokens = len(final.prompt_token_ids)
        num_generated = sum(len(output.token_ids) for output in final.outputs)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                          total_tokens=num_prompt_tokens + num_generated)
        return ChatCompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage,
                                      prompt_logprobs=clamp_prompt_logprobs(final.prompt_logprobs))

    async def chat_completion_stream_generator(self, request: ChatCompletionRequest,
                                               result_generator: AsyncGenerator[RequestOutput, None],
                                               request_id: str, model_name: str,
                                               num_top: int) -> AsyncGenerator[str, None]:
        created = int(time.time())
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        num_prompt_tokens = 0
        previous_num_tokens = [0] * request.n      # tokens generated, per choice

        def chunk(choices: list, usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                    choices=choices, usage=usage).model_dump_json())

        def usage(completion_tokens: int) -> UsageInfo:
            return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                             total_tokens=num_prompt_tokens + completion_tokens)

        # Each choice's first chunk carries only the role, as OpenAI's does; then the echoed
        # last message (echo), once per choice.
        echo = self._echo_text(request)
        for i in range(request.n):
            yield chunk([ChatCompletionResponseStreamChoice(
                index=i, delta=DeltaMessage(role=self.response_role, content=""))])
            if echo:
                yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=echo))])
        async for res in result_generator:
            num_prompt_tokens = len(res.prompt_token_ids)
            for output in res.outputs:
                i = output.index
                raise_if_error(output.finish_reason, request_id, output.stop_reason)
                previous_num_tokens[i] += len(output.token_ids)
                want_logprobs = output.logprobs is not None
                if not output.text and not output.finished() and not (want_logprobs and output.token_ids):
                    continue   # nothing to show yet (text held back for a possible stop string)
                choice = ChatCompletionResponseStreamChoice(
                    index=i, delta=DeltaMessage(content=output.text),
                    logprobs=self._create_chat_logprobs(output, num_top, request.return_tokens_as_token_ids),
                    finish_reason=output.finish_reason, stop_reason=output.stop_reason)
                yield chunk([choice], usage(previous_num_tokens[i]) if continuous_usage else None)
        if include_usage:
            yield chunk([], usage(sum(previous_num_tokens)))

    def _create_chat_logprobs(self, output: CompletionOutput, num_top: int,
                              as_token_ids: bool | None = False) -> ChatCompletionLogProbs | None:
        if output.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(output.token_ids, output.logprobs):
            # NOTE: an entry holds the sampled token (its true rank) and the top-k
            # (ranks 1..k); top_logprobs are the entries ranked 1..num_top.
            tops = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
                          key=lambda item: item[1].rank or 0)     # (ranks here are not None)
            sampled = self._chat_logprob(token_id, entry.get(token_id), as_token_ids)
            content.append(ChatCompletionLogProbsContent(
                **sampled.model_dump(), top_logprobs=[self._chat_logprob(tid, lp, as_token_ids) for tid, lp in tops]))
        return ChatCompletionLogProbs(content=content)

    def _chat_logprob(self, token_id: int, lp: Logprob | None, as_token_ids: bool | None) -> ChatCompletionLogProb:
        token = format_token_id_placeholder(token_id) if as_token_ids else self._token_str(token_id, lp)
        return ChatCompletionLogProb(token=token, logprob=_clamp(lp.logprob if lp else -9999.0),
                                     bytes=list(token.encode("utf-8", errors="replace")))

    def _token_str(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])


def _clamp(logprob: float) -> float:
    # NOTE: -inf is not valid JSON; vLLM clamps to -9999.0 the same way.
    return max(logprob, -9999.0)
