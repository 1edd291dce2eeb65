"""OpenAIServingCompletion: POST /v1/completions (raw text or token-id prompts, no template).

Mirrors vllm/entrypoints/openai/completion/serving.py. `prompt` is one prompt
(a text or a list of token ids) or a batch (a list of texts or of token-id
lists): one engine request per prompt (id `{request id}-{i}`, as vLLM's),
their outputs merged as they come (merge_async_iterators). With n > 1 each
prompt has n choices; choice `prompt index * n + output index` (vLLM's
numbering). Every prompt is tokenized and validated before any is sent, so
a bad one is a 400 and nothing runs. Non-streaming answers one
`text_completion` (choices in that order, usage summed over them);
streaming sends `text_completion` chunks, each for one choice and carrying
its index, as server-sent events, then `data: [DONE]`. With `echo`, a choice's
text, tokens and logprobs begin with its prompt's (prompt logprobs:
completion_protocol.py); each non-streamed choice carries `prompt_logprobs`.
"""
from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any, AsyncGenerator, AsyncIterator, NamedTuple, Sequence

from starlette.requests import Request

from vllm_anatomy.entrypoints.openai.completion_protocol import (CompletionLogProbs, CompletionRequest,
                                                                 CompletionResponse, CompletionResponseChoice,
                                                                 CompletionResponseStreamChoice,
                                                                 CompletionStreamResponse)
from vllm_anatomy.entrypoints.openai.protocol import UsageInfo
from vllm_anatomy.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing, clamp_prompt_logprobs,
                                                            format_token_id_placeholder, raise_if_error, sse)
from vllm_anatomy.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.utils.async_utils import merge_async_iterators


class EngineInput(NamedTuple):
    """One prompt of the request, ready for the engine."""
    prompt: dict[str, Any]           # {"prompt_token_ids": [...], "prompt": text (if it was text)}
    params: SamplingParams
    echo_text: str | None            # what echo puts before each of its choices (None: no echo)


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, request: CompletionRequest, raw_request: Request | None = None
                                ) -> CompletionResponse | AsyncGenerator[str, None]:
        """Validate everything (VLLMValidationError / OpenAIError -> 4xx), then answer or stream."""
        self._check_model(request.model)
        request_id = f"cmpl-{self._base_request_id(raw_request, request.request_id)}"
        request.check_unsupported()
        inputs = [await self._render_prompt(request, prompt) for prompt in request.get_prompts()]
        model_name = self.models.model_name_for(request.model)
        generators = [self._generate(inp.prompt, inp.params, f"{request_id}-{i}", raw_request, request.priority)
                      for i, inp in enumerate(inputs)]
        result_generator = merge_async_iterators(*generators)
        echo_texts = [inp.echo_text for inp in inputs]
        if request.stream:
            return self._sse_stream(self.completion_stream_generator(
                request, result_generator, request_id, model_name, echo_texts), result_generator)
        return await self.completion_full_generator(request, result_generator, request_id, model_name, echo_texts)

    async def _render_prompt(self, request: CompletionRequest, prompt: str | list[int]) -> EngineInput:
        """Tokenize (a text) and validate one prompt with its own SamplingParams (max_tokens
        defaults to what is left of max_model_len after *this* prompt)."""
        if isinstance(prompt, str):
            # As the InputProcessor tokenizes (special tokens added, unless the request says no).
            prompt_text, prompt_ids = prompt, await self._tokenize(prompt, request.add_special_tokens)
        else:
            prompt_text, prompt_ids = None, list(prompt)
        self._validate_prompt_ids(prompt_ids)
        params = await self._to_sampling_params(request, self._default_max_tokens(prompt_ids))
        self._validate_inputs(prompt_ids, params, "max_tokens")
        engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if prompt_text is not None:
            engine_prompt["prompt"] = prompt_text
        echo_text = None
        if request.echo:
            echo_text = prompt_text if prompt_text is not None else \
                await self._run_in_tokenizer_thread(self.tokenizer.decode, prompt_ids)
        return EngineInput(engine_prompt, params, echo_text)

    async def completion_full_generator(self, request: CompletionRequest,
                                        result_generator: AsyncIterator[tuple[int, RequestOutput]],
                                        request_id: str, model_name: str,
                                        echo_texts: list[str | None]) -> CompletionResponse:
        finals = await self._final_outputs(result_generator, len(echo_texts), request_id)
        choices: list[CompletionResponseChoice] = []
        num_prompt_tokens = num_generated = 0
        for final, echo_text in zip(finals, echo_texts):
            prompt_logprobs = clamp_prompt_logprobs(final.prompt_logprobs)
            for output in final.outputs:             # its n outputs, by index
                text, token_ids, out_logprobs = self._choice_content(request, output, echo_text,
                                                                     final.prompt_token_ids, prompt_logprobs)
                choices.append(CompletionResponseChoice(
                    index=len(choices), text=text,
                    logprobs=self._create_completion_logprobs(token_ids, out_logprobs, request.logprobs, 0,
                                                              request.return_tokens_as_token_ids),
                    finish_reason=output.finish_reason, stop_reason=output.stop_reason,
                    prompt_logprobs=prompt_logprobs))
                num_generated += len(output.token_ids)
            num_prompt_tokens += len(final.prompt_token_ids)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                          total_tokens=num_prompt_tokens + num_generated)
        return CompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage)

    @staticmethod
    def _choice_content(request: CompletionRequest, output: CompletionOutput, echo_text: str | None,
                        prompt_token_ids: list[int], prompt_logprobs: PromptLogprobs | None
                        ) -> tuple[str, list[int], Sequence[dict[int, Logprob] | None] | None]:
        """A choice's text, token ids and their logprobs: the output's, after the
        prompt's when echo_text is given (the prompt's alone with max_tokens 0)."""
        if echo_text is None:
            return output.text, output.token_ids, output.logprobs
        if request.logprobs is not None and prompt_logprobs is None:
            raise OpenAIError("The engine returned no prompt logprobs for an echo with logprobs.",
                              "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR)
        if request.echo_without_generation():    # the one token the engine ran is not shown
            return echo_text, prompt_token_ids, prompt_logprobs
        out_logprobs = None if prompt_logprobs is None or output.logprobs is None else \
            [*prompt_logprobs, *output.logprobs]
        return echo_text + output.text, [*prompt_token_ids, *output.token_ids], out_logprobs

    async def completion_stream_generator(self, request: CompletionRequest,
                                          result_generator: AsyncIterator[tuple[int, RequestOutput]],
                                          request_id: str, model_name: str,
                                          echo_texts: list[str | None]) -> AsyncGenerator[str, None]:
        created = int(time.time())
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        num_choices, num_prompts = request.n, len(echo_texts)
        # Per choice (prompt index * n + output index): characters sent (logprobs' text_offset),
        # tokens generated, whether the prompt was echoed. Per prompt: its prompt tokens.
        previous_text_lens = [0] * (num_choices * num_prompts)
        previous_num_tokens = [0] * (num_choices * num_prompts)
        has_echoed = [False] * (num_choices * num_prompts)
        num_prompt_tokens = [0] * num_prompts
        prompt_logprobs: list[PromptLogprobs | None] = [None] * num_prompts

        def chunk(choices: list, usage_info: UsageInfo | None = None) -> str:
            return sse(CompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                choices=choices, usage=usage_info).model_dump_json())

        async for prompt_idx, res in result_generator:
            num_prompt_tokens[prompt_idx] = len(res.prompt_token_ids)
            if res.prompt_logprobs is not None:   # (a delta stream has them in each choice's first output)
                prompt_logprobs[prompt_idx] = clamp_prompt_logprobs(res.prompt_logprobs)
            for output in res.outputs:
                i = output.index + prompt_idx * num_choices
                raise_if_error(output.finish_reason, request_id, output.stop_reason)
                previous_num_tokens[i] += len(output.token_ids)
                # The prompt goes first, once per choice.
                echo_text = echo_texts[prompt_idx] if not has_echoed[i] else None
                has_echoed[i] = True
                text, token_ids, out_logprobs = self._choice_content(request, output, echo_text, res.prompt_token_ids,
                                                                     prompt_logprobs[prompt_idx])
                if not text and not output.finished() and not (output.logprobs and output.token_ids):
                    continue
                logprobs = self._create_completion_logprobs(token_ids, out_logprobs, request.logprobs,
                                                            previous_text_lens[i], request.return_tokens_as_token_ids)
                previous_text_lens[i] += len(text)
                choice = CompletionResponseStreamChoice(index=i, text=text, logprobs=logprobs,
                                                        finish_reason=output.finish_reason,
                                                        stop_reason=output.stop_reason)
                usage = None
                if continuous_usage:    # this choice's prompt and tokens so far (vLLM's numbers)
                    usage = UsageInfo(prompt_tokens=num_prompt_tokens[prompt_idx],
                                      completion_tokens=previous_num_tokens[i],
                                      total_tokens=num_prompt_tokens[prompt_idx] + previous_num_tokens[i])
                yield chunk([choice], usage)
        if include_usage:
            total_prompt, total_generated = sum(num_prompt_tokens), sum(previous_num_tokens)
            yield chunk([], UsageInfo(prompt_tokens=total_prompt, completion_tokens=total_generated,
                                      total_tokens=total_prompt + total_generated))

    def _create_completion_logprobs(self, token_ids: list[int],
                                    top_logprobs: Sequence[dict[int, Logprob] | None] | None,
                                    num_top: int | None, initial_text_offset: int,
                                    as_token_ids: bool | None = False) -> CompletionLogProbs | None:
        """OpenAI's logprobs of these tokens (an entry None: the prompt's first token, which has none)."""
        if top_logprobs is None or num_top is None:
            return None
        out = CompletionLogProbs()
        offset = initial_text_offset

        def token_str(tid: int, lp: Logprob | None) -> str:
            if as_token_ids:
                return format_token_id_placeholder(tid)
            return lp.decoded_token if lp is not None and lp.decoded_token is not None else self.tokenizer.decode([tid])

        for token_id, entry in zip(token_ids, top_logprobs):
            sampled = entry.get(token_id) if entry is not None else None
            token = token_str(token_id, sampled)
            out.tokens.append(token)
            out.token_logprobs.append(max(sampled.logprob, -9999.0) if sampled is not None else None)
            # NOTE: like vLLM, the top dict holds the top-k *and* the sampled token.
            out.top_logprobs.append(None if entry is None else {
                token_str(tid, lp): max(lp.logprob, -9999.0)
                for tid, lp in entry.items()
                if tid == token_id or (lp.rank is not None and lp.rank <= num_top)})
            out.text_offset.append(offset)
            offset += len(token)
        return out
