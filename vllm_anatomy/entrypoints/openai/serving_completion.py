"""OpenAIServingCompletion: POST /v1/completions (raw text or token-id prompt, no template).

Mirrors vllm/entrypoints/openai/completion/serving.py, for one prompt per
request (vLLM also takes batches; here a batch of more than one is a 400).
Non-streaming answers one `text_completion`; streaming sends
`text_completion` chunks as server-sent events, then `data: [DONE]`.
"""
from __future__ import annotations

import time
from typing import Any, AsyncGenerator, AsyncIterator

from starlette.requests import Request

from vllm_anatomy.entrypoints.openai.completion_protocol import (CompletionLogProbs, CompletionRequest,
                                                                 CompletionResponse, CompletionResponseChoice,
                                                                 CompletionResponseStreamChoice,
                                                                 CompletionStreamResponse)
from vllm_anatomy.entrypoints.openai.protocol import UsageInfo
from vllm_anatomy.entrypoints.openai.serving_engine import OpenAIServing, raise_if_error, sse
from vllm_anatomy.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, request: CompletionRequest, raw_request: Request | None = None
                                ) -> CompletionResponse | AsyncGenerator[str, None]:
        """Validate everything (VLLMValidationError / OpenAIError -> 4xx), then answer or stream."""
        self._check_model(request.model)
        request_id = f"cmpl-{self._base_request_id(raw_request)}"
        request.check_unsupported()
        prompt = request.get_single_prompt()
        if isinstance(prompt, str):
            # Same tokenization as the InputProcessor would do (special tokens added).
            prompt_text, prompt_ids = prompt, await self._tokenize(prompt, add_special_tokens=True)
        else:
            prompt_text, prompt_ids = None, list(prompt)
        self._validate_prompt_ids(prompt_ids)
        params = request.to_sampling_params(self._default_max_tokens(prompt_ids))
        self._validate_inputs(prompt_ids, params, "max_tokens")
        model_name = self.models.model_name_for(request.model)
        engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if prompt_text is not None:
            engine_prompt["prompt"] = prompt_text
        echo_text = None
        if request.echo:
            echo_text = prompt_text if prompt_text is not None else \
                await self._run_in_tokenizer_thread(self.tokenizer.decode, prompt_ids)
        generator = self._generate(engine_prompt, params, request_id, raw_request, request.priority)
        if request.stream:
            return self._sse_stream(self.completion_stream_generator(
                request, generator, request_id, model_name, echo_text), generator)
        return await self.completion_full_generator(request, generator, request_id, model_name, echo_text)

    async def completion_full_generator(self, request: CompletionRequest,
                                        result_generator: AsyncIterator[RequestOutput], request_id: str,
                                        model_name: str, echo_text: str | None) -> CompletionResponse:
        final = await self._final_output(result_generator, request_id)
        output = final.outputs[0]
        prefix = echo_text or ""
        choice = CompletionResponseChoice(
            index=0, text=prefix + output.text,
            logprobs=self._create_completion_logprobs(output, request.logprobs, len(prefix)),
            finish_reason=output.finish_reason, stop_reason=output.stop_reason)
        num_prompt_tokens = len(final.prompt_token_ids)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=len(output.token_ids),
                          total_tokens=num_prompt_tokens + len(output.token_ids))
        return CompletionResponse(id=request_id, model=model_name, choices=[choice], usage=usage)

    async def completion_stream_generator(self, request: CompletionRequest,
                                          result_generator: AsyncGenerator[RequestOutput, None],
                                          request_id: str, model_name: str,
                                          echo_text: str | None) -> AsyncGenerator[str, None]:
        created = int(time.time())
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        num_prompt_tokens = num_generated = 0
        text_offset = 0     # characters already sent (for logprobs' text_offset)

        def usage() -> UsageInfo:
            return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                             total_tokens=num_prompt_tokens + num_generated)

        def chunk(choices: list, usage_info: UsageInfo | None = None) -> str:
            return sse(CompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                choices=choices, usage=usage_info).model_dump_json())

        async for res in result_generator:
            output = res.outputs[0]
            raise_if_error(output.finish_reason, request_id)
            num_prompt_tokens = len(res.prompt_token_ids)
            num_generated += len(output.token_ids)
            text = output.text
            if echo_text is not None:   # the prompt goes first, once
                text, echo_text = echo_text + text, None
            if not text and not output.finished() and not (output.logprobs and output.token_ids):
                continue
            logprobs = self._create_completion_logprobs(output, request.logprobs,
                                                        text_offset + len(text) - len(output.text))
            text_offset += len(text)
            choice = CompletionResponseStreamChoice(index=0, text=text, logprobs=logprobs,
                                                    finish_reason=output.finish_reason,
                                                    stop_reason=output.stop_reason)
            yield chunk([choice], usage() if continuous_usage else None)
        if include_usage:
            yield chunk([], usage())

    def _create_completion_logprobs(self, output: CompletionOutput, num_top: int | None,
                                    initial_text_offset: int) -> CompletionLogProbs | None:
        if output.logprobs is None or num_top is None:
            return None
        out = CompletionLogProbs()
        offset = initial_text_offset
        for token_id, entry in zip(output.token_ids, output.logprobs):
            sampled = entry.get(token_id)
            token = (sampled.decoded_token if sampled is not None and sampled.decoded_token is not None
                     else self.tokenizer.decode([token_id]))
            out.tokens.append(token)
            out.token_logprobs.append(max(sampled.logprob, -9999.0) if sampled is not None else None)
            # NOTE: like vLLM, the top dict holds the top-k *and* the sampled token.
            out.top_logprobs.append({
                (lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([tid])):
                    max(lp.logprob, -9999.0)
                for tid, lp in entry.items()
                if tid == token_id or (lp.rank is not None and lp.rank <= num_top)})
            out.text_offset.append(offset)
            offset += len(token)
        return out
