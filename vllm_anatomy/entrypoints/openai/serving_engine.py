"""OpenAIServing: what chat and completions share (errors, model check, prompt checks).

Mirrors vllm/entrypoints/serve/engine/serving.py (BaseServing) and
vllm/entrypoints/generate/base/serving.py (GenerateBaseServing), which v0.27.1
has instead of an OpenAIServing class. Everything a client can get
wrong is checked here, *before* a request reaches the engine and before a
stream answers 200, with the engine's own checks (InputProcessor.validate_inputs,
SamplingParams.verify), so the client gets a 400 that names the field instead
of a broken stream or a dead engine.

NOTE: tokenization and chat templating run in a thread pool (vLLM's renderer
executor), never on the event loop: the fast tokenizer releases the GIL, so a
long prompt does not stall /health or other streams. A text longer than
max_model_len x the longest token (in characters) cannot fit and is refused
before it is tokenized at all (vLLM's _text_len_check).

NOTE: (ours; issue 29) a structured-output constraint is checked once, off the
event loop too: to_sampling_params runs in a GrammarCompileExecutor thread (low
CPU priority, a CPU-time budget: VLLM_ANATOMY_GRAMMAR_VALIDATION_TIMEOUT_S) whenever the
request carries one, and the checks that follow hit the cache it filled
(backend_xgrammar.validate_xgrammar_grammar). vLLM parses the constraint on the
event loop, once per check (three times per request).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
from concurrent.futures import Executor, ThreadPoolExecutor
from http import HTTPStatus
from typing import AsyncGenerator, AsyncIterator, Callable, TypeVar

from starlette.requests import Request

from vllm_anatomy import envs
from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.entrypoints.openai.chat_protocol import ChatCompletionRequest
from vllm_anatomy.entrypoints.openai.completion_protocol import CompletionRequest
from vllm_anatomy.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, random_uuid
from vllm_anatomy.entrypoints.openai.serving_models import OpenAIServingModels
from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.outputs import PromptLogprobs, RequestOutput
from vllm_anatomy.sampling_params import MAX_LOGPROBS, SamplingParams
from vllm_anatomy.structured_output import GRAMMAR_ERROR_PREFIX
from vllm_anatomy.structured_output.compile_executor import GrammarCompileExecutor, GrammarCompileTimeout
from vllm_anatomy.utils.async_utils import merge_async_iterators

T = TypeVar("T")

# W3C trace context headers copied from HTTP into the engine request (vLLM's TRACE_HEADERS).
TRACE_HEADERS = ("traceparent", "tracestate")
# NOTE: vLLM takes X-Request-Id (and the body's request_id) as given; here it is
# bounded and restricted to characters that are safe in a log line, a trace
# attribute, a file name and a URL: it is logged, traced and stored with every
# request, and echoed in the response's id. Anything else is a 400 (issue 29:
# an ANSI escape sequence went raw into the server log).
MAX_REQUEST_ID_LEN = 128
REQUEST_ID_CHARS = "letters, digits and . _ : - + = @ /"
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-+=@/]+")


class OpenAIError(Exception):
    """An error to answer with an OpenAI error body; raised anywhere in a handler."""

    def __init__(self, message: str, err_type: str = "BadRequestError",
                 status_code: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.response = create_error_response(message, err_type, status_code, param, code)
        self.status_code = int(status_code)


def create_error_response(message: str, err_type: str = "BadRequestError",
                          status_code: HTTPStatus = HTTPStatus.BAD_REQUEST,
                          param: str | None = None, code: str | int | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=code if code is not None else int(status_code)))


def validation_error(e: VLLMValidationError) -> OpenAIError:
    """A VLLMValidationError (SamplingParams, the InputProcessor, protocol checks) -> 400 naming the field."""
    return OpenAIError(str(e), param=e.parameter)


def grammar_error(stop_reason: str) -> OpenAIError:
    """The engine refused the request's structured-output constraint after accepting it
    (it failed to compile, timed out, or allows no token of this vocabulary): the
    client's constraint, not a server fault, so a 400 that says why."""
    return OpenAIError(f"The structured_outputs constraint cannot be served: "
                       f"{stop_reason[len(GRAMMAR_ERROR_PREFIX):]}.", param="structured_outputs")


def generation_error(request_id: str) -> OpenAIError:
    """A request the engine finished with finish_reason "error" (vLLM's GenerationError: a 500).

    NOTE: the input was valid (it passed every check above); the engine could
    not run it. It failed alone: the server and the other requests are fine.
    """
    return OpenAIError(f"Request {request_id} failed inside the engine (see the server log); "
                       f"other requests are unaffected.", "InternalServerError",
                       HTTPStatus.INTERNAL_SERVER_ERROR)


def engine_dead_error(e: BaseException | None = None) -> OpenAIError:
    detail = f" ({e})" if e is not None and str(e) else ""
    return OpenAIError(f"The engine is dead and cannot serve requests{detail}.",
                       "ServiceUnavailableError", HTTPStatus.SERVICE_UNAVAILABLE)


def stream_error_event(e: OpenAIError) -> str:
    """An error inside a stream that already answered 200 (vLLM sends the same)."""
    return f"data: {e.response.model_dump_json()}\n\n"


class OpenAIServing:

    def __init__(self, engine_client, models: OpenAIServingModels,
                 tokenizer_executor: Executor | None = None,
                 grammar_executor: GrammarCompileExecutor | None = None) -> None:
        self.engine_client = engine_client
        self.models = models
        self.tokenizer = engine_client.get_tokenizer()
        self.input_processor = engine_client.input_processor
        self.max_model_len = engine_client.model_config.max_model_len
        # NOTE: one worker: a HF fast tokenizer must not be used from two
        # threads at once; requests queue for it, the event loop does not.
        self._tokenizer_executor = tokenizer_executor or ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # NOTE: one worker, low priority: checking constraints never takes the
        # event loop's core, and one slow check ends with its budget, not never.
        self._grammar_executor = grammar_executor or GrammarCompileExecutor(1, thread_name_prefix="grammar_validate")
        # The most characters one token covers (vLLM: tokenizer.max_chars_per_token).
        self.max_chars_per_token = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.max_input_chars = self.max_model_len * self.max_chars_per_token

    async def _run_in_tokenizer_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_executor, functools.partial(fn, *args, **kwargs))

    async def _to_sampling_params(self, request: ChatCompletionRequest | CompletionRequest,
                                  default_max_tokens: int) -> SamplingParams:
        """request.to_sampling_params, in the grammar thread when the request carries a
        structured-output constraint (its check compiles it); inline otherwise."""
        if not request.has_structured_outputs():
            return request.to_sampling_params(default_max_tokens)
        timeout = envs.VLLM_ANATOMY_GRAMMAR_VALIDATION_TIMEOUT_S
        future = self._grammar_executor.submit(request.to_sampling_params, default_max_tokens, timeout=timeout)
        try:
            return await asyncio.wrap_future(future)
        except GrammarCompileTimeout:
            param = "response_format" if request.uses_response_format() else "structured_outputs"
            raise OpenAIError(f"The {param} constraint could not be checked within {timeout:g} s of CPU time "
                              f"(VLLM_ANATOMY_GRAMMAR_VALIDATION_TIMEOUT_S); simplify it.", param=param) from None

    def _check_text_len(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit in max_model_len tokens."""
        if num_chars > self.max_input_chars:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{param} has {num_chars} characters (more than {self.max_input_chars}, the upper bound "
                f"for {self.max_model_len} tokens of at most {self.max_chars_per_token} characters each).",
                param=param)

    async def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        self._check_text_len(len(text), "prompt")
        return await self._run_in_tokenizer_thread(self.tokenizer.encode, text,
                                                   add_special_tokens=add_special_tokens)

    def _check_model(self, model_name: str | None) -> None:
        if self.engine_client.errored:
            raise engine_dead_error(self.engine_client.dead_error)
        if not self.models.is_base_model(model_name):
            raise OpenAIError(f"The model `{model_name}` does not exist.", "NotFoundError",
                              HTTPStatus.NOT_FOUND, param="model", code="model_not_found")

    def _validate_prompt_ids(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise OpenAIError("The prompt is empty.", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(prompt_ids)} tokens; at least one token must remain for the output.",
                param="prompt")

    def _validate_inputs(self, prompt_ids: list[int], params: SamplingParams, max_tokens_name: str) -> None:
        """What the engine would refuse, refused now (a stream has not answered 200 yet)."""
        self._check_max_tokens(params, prompt_ids, max_tokens_name)
        self._check_prompt_logprobs(params)
        self.input_processor.validate_inputs(prompt_ids, params)

    def _check_prompt_logprobs(self, params: SamplingParams) -> None:
        """prompt_logprobs -1 means the whole vocabulary: more than the max_logprobs
        bound, as v0.27.1 refuses it under its default max_logprobs (20).

        NOTE: our SamplingParams accepts -1 (the LLM API can ask for the whole
        vocabulary); over HTTP it would be vocab_size entries per prompt token.
        """
        if params.prompt_logprobs == -1:
            raise OpenAIError(f"Requested prompt logprobs of {self.input_processor.vocab_size} (-1: the whole "
                              f"vocabulary), which is greater than max allowed: {MAX_LOGPROBS}.",
                              param="prompt_logprobs")

    def _default_max_tokens(self, prompt_ids: list[int]) -> int:
        return self.max_model_len - len(prompt_ids)

    def _check_max_tokens(self, params: SamplingParams, prompt_ids: list[int], name: str) -> None:
        room = self._default_max_tokens(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise OpenAIError(
                f"{name}={params.max_tokens} is too large: the prompt has {len(prompt_ids)} tokens and "
                f"this model's maximum context length is {self.max_model_len} tokens.", param=name)

    @staticmethod
    def _base_request_id(raw_request: Request | None, default: str | None = None) -> str:
        """The client's X-Request-Id if it sent one (vLLM honours it too), else the
        body's request_id (`default`), else a fresh uuid.

        NOTE: the engine's id is this plus a random suffix (AsyncLLM, via
        InputProcessor.assign_request_id), so two requests with the same header
        both run; the response's `id` is built from the header, as in vLLM.
        """
        header = raw_request.headers.get("X-Request-Id") if raw_request is not None else None
        if header:
            return validate_request_id(header, "X-Request-Id")
        if default:
            return validate_request_id(default, "request_id")
        return random_uuid()

    def _get_trace_headers(self, raw_request: Request | None) -> dict[str, str] | None:
        recorder = getattr(self.engine_client, "recorder", None)
        if recorder is not None and recorder.enabled:
            # NOTE: with tracing on, the HTTP server span (FastAPI instrumentation,
            # itself a child of any incoming traceparent) is the current context:
            # the request's spans become its children.
            headers = recorder.inject_trace_headers()
            if headers:
                return headers
        if raw_request is None:
            return None
        headers = {h: raw_request.headers[h] for h in TRACE_HEADERS if h in raw_request.headers}
        return headers or None

    def _generate(self, prompt, params: SamplingParams, request_id: str,
                  raw_request: Request | None, priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        return self.engine_client.generate(prompt, params, request_id,
                                           trace_headers=self._get_trace_headers(raw_request), priority=priority)

    @classmethod
    async def _final_output(cls, result_generator: AsyncGenerator[RequestOutput, None],
                            request_id: str) -> RequestOutput:
        """Drain one FINAL_ONLY generator; engine errors become OpenAIErrors."""
        return (await cls._final_outputs(merge_async_iterators(result_generator), 1, request_id))[0]

    @staticmethod
    async def _final_outputs(result_generator: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int,
                             request_id: str) -> list[RequestOutput]:
        """Drain merged FINAL_ONLY generators ((prompt index, output) pairs) into one final
        RequestOutput per prompt; engine errors become OpenAIErrors, and a choice the
        engine failed fails the response (vLLM: _raise_if_error on each)."""
        finals: list[RequestOutput | None] = [None] * num_prompts
        try:
            async for i, final in result_generator:
                finals[i] = final
        except EngineDeadError as e:
            raise engine_dead_error(e) from e
        except VLLMValidationError as e:
            raise validation_error(e) from e
        done = [f for f in finals if f is not None]
        if len(done) != num_prompts:
            raise OpenAIError("The engine returned no output.", "InternalServerError",
                              HTTPStatus.INTERNAL_SERVER_ERROR)
        for final in done:
            for output in final.outputs:
                raise_if_error(output.finish_reason, request_id, output.stop_reason)
        return done

    async def _sse_stream(self, events: AsyncGenerator[str, None],
                          result_generator: AsyncGenerator) -> AsyncGenerator[str, None]:
        """The SSE frame around a stream's events: an error is reported in the stream
        (the 200 and its headers are already sent), the engine generator is always
        closed, and `data: [DONE]` comes last."""
        try:
            async for event in events:
                yield event
        except OpenAIError as e:
            yield sse(e.response.model_dump_json())
        except Exception as e:  # noqa: BLE001 - headers are sent: report it in-stream
            yield self._stream_exception_event(e)
        finally:
            # NOTE: closing the engine generator is what aborts the request when
            # we stop early (client gone). Harmless when it already finished.
            await events.aclose()
            await result_generator.aclose()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _stream_exception_event(e: Exception) -> str:
        if isinstance(e, EngineDeadError):
            return stream_error_event(engine_dead_error(e))
        if isinstance(e, VLLMValidationError):
            return stream_error_event(validation_error(e))
        return stream_error_event(OpenAIError(f"{type(e).__name__}: {e}", "InternalServerError",
                                              HTTPStatus.INTERNAL_SERVER_ERROR))


def validate_request_id(value: str, param: str) -> str:
    """A client-chosen request id, if it is short and made of safe characters (else a 400
    that does not repeat it: it may hold terminal escape sequences)."""
    if len(value) > MAX_REQUEST_ID_LEN:
        raise OpenAIError(f"{param} must be at most {MAX_REQUEST_ID_LEN} characters, got {len(value)}.",
                          param=param)
    if not _REQUEST_ID_RE.fullmatch(value):
        raise OpenAIError(f"{param} may contain only {REQUEST_ID_CHARS}.", param=param)
    return value


def raise_if_error(finish_reason: str | None, request_id: str, stop_reason: int | str | None = None) -> None:
    """finish_reason "error" -> the request failed inside the engine (vLLM: _raise_if_error),
    or (ours) the engine refused its grammar, which says why in stop_reason: a 400."""
    if finish_reason == "error":
        if isinstance(stop_reason, str) and stop_reason.startswith(GRAMMAR_ERROR_PREFIX):
            raise grammar_error(stop_reason)
        raise generation_error(request_id)


def clamp_prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobs | None:
    """-inf logprobs (not valid JSON) as -9999.0, as vLLM's helper of that name
    (which edits them in place; this returns copies)."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {tid: lp if lp.logprob != float("-inf") else dataclasses.replace(lp, logprob=-9999.0)
             for tid, lp in entry.items()}
            for entry in prompt_logprobs]


def format_token_id_placeholder(token_id: int) -> str:
    """A logprobs token shown as its id (return_tokens_as_token_ids; vLLM's helper)."""
    return f"token_id:{token_id}"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"
