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
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor, ThreadPoolExecutor
from http import HTTPStatus
from typing import AsyncGenerator, AsyncIterator, Callable, TypeVar

from starlette.requests import Request

from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, random_uuid
from vllm_anatomy.entrypoints.openai.serving_models import OpenAIServingModels
from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.outputs import RequestOutput
from vllm_anatomy.sampling_params import SamplingParams

T = TypeVar("T")

# W3C trace context headers copied from HTTP into the engine request (vLLM's TRACE_HEADERS).
TRACE_HEADERS = ("traceparent", "tracestate")
# NOTE: vLLM takes X-Request-Id as given, whatever its length; here it is
# bounded: it is logged, traced and stored with every request.
MAX_REQUEST_ID_LEN = 128


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
                 tokenizer_executor: Executor | None = None) -> None:
        self.engine_client = engine_client
        self.models = models
        self.tokenizer = engine_client.get_tokenizer()
        self.input_processor = engine_client.input_processor
        self.max_model_len = engine_client.model_config.max_model_len
        # NOTE: one worker: a HF fast tokenizer must not be used from two
        # threads at once; requests queue for it, the event loop does not.
        self._tokenizer_executor = tokenizer_executor or ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # The most characters one token covers (vLLM: tokenizer.max_chars_per_token).
        self.max_chars_per_token = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.max_input_chars = self.max_model_len * self.max_chars_per_token

    async def _run_in_tokenizer_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_executor, functools.partial(fn, *args, **kwargs))

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
        self.input_processor.validate_inputs(prompt_ids, params)

    def _default_max_tokens(self, prompt_ids: list[int]) -> int:
        return self.max_model_len - len(prompt_ids)

    def _check_max_tokens(self, params: SamplingParams, prompt_ids: list[int], name: str) -> None:
        room = self._default_max_tokens(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise OpenAIError(
                f"{name}={params.max_tokens} is too large: the prompt has {len(prompt_ids)} tokens and "
                f"this model's maximum context length is {self.max_model_len} tokens.", param=name)

    @staticmethod
    def _base_request_id(raw_request: Request | None) -> str:
        """The client's X-Request-Id if it sent one (vLLM honours it too), else a fresh uuid.

        NOTE: the engine's id is this plus a random suffix (AsyncLLM, via
        InputProcessor.assign_request_id), so two requests with the same header
        both run; the response's `id` is built from the header, as in vLLM.
        """
        if raw_request is not None:
            header = raw_request.headers.get("X-Request-Id")
            if header and len(header) > MAX_REQUEST_ID_LEN:
                raise OpenAIError(f"X-Request-Id must be at most {MAX_REQUEST_ID_LEN} characters, "
                                  f"got {len(header)}.", param="X-Request-Id")
            if header:
                return header
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

    @staticmethod
    async def _final_output(result_generator: AsyncIterator[RequestOutput], request_id: str) -> RequestOutput:
        """Drain a FINAL_ONLY generator; engine errors become OpenAIErrors."""
        final = None
        try:
            async for final in result_generator:
                pass
        except EngineDeadError as e:
            raise engine_dead_error(e) from e
        except VLLMValidationError as e:
            raise validation_error(e) from e
        if final is None:
            raise OpenAIError("The engine returned no output.", "InternalServerError",
                              HTTPStatus.INTERNAL_SERVER_ERROR)
        raise_if_error(final.outputs[0].finish_reason, request_id)
        return final

    async def _sse_stream(self, events: AsyncGenerator[str, None],
                          result_generator: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[str, None]:
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


def raise_if_error(finish_reason: str | None, request_id: str) -> None:
    """finish_reason "error" -> the request failed inside the engine (vLLM: _raise_if_error)."""
    if finish_reason == "error":
        raise generation_error(request_id)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"
