"""OpenAIServing: what chat and completions share (errors, model check, prompt checks).

Mirrors vllm/entrypoints/openai/serving_engine.py. Everything a client can get
wrong is checked here, *before* a request reaches the engine, so the client
gets a 400 that names the field instead of a broken stream.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import AsyncGenerator, AsyncIterator

from starlette.requests import Request

from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, random_uuid
from vllm_anatomy.entrypoints.openai.serving_models import OpenAIServingModels
from vllm_anatomy.outputs import RequestOutput
from vllm_anatomy.sampling_params import SamplingParams

# W3C trace context headers copied from HTTP into the engine request (vLLM's TRACE_HEADERS).
TRACE_HEADERS = ("traceparent", "tracestate")


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


def bad_request_from_value_error(e: Exception) -> OpenAIError:
    """A ValueError from SamplingParams / the InputProcessor -> 400.

    NOTE: their messages start with the offending field name ("top_p must be in
    (0, 1] ..."), which becomes the error's `param` when it looks like one.
    """
    message = str(e)
    first = message.split(" ", 1)[0]
    looks_like_field = first.isidentifier() and ("_" in first or first in _PARAMS)
    param = first if looks_like_field else None
    return OpenAIError(message, param=param)


_PARAMS = {"n", "temperature", "seed", "stop", "prompt", "logprobs", "echo", "suffix", "messages"}


def engine_dead_error(e: BaseException | None = None) -> OpenAIError:
    detail = f" ({e})" if e is not None and str(e) else ""
    return OpenAIError(f"The engine is dead and cannot serve requests{detail}.",
                       "ServiceUnavailableError", HTTPStatus.SERVICE_UNAVAILABLE)


def stream_error_event(e: OpenAIError) -> str:
    """An error inside a stream that already answered 200 (vLLM sends the same)."""
    return f"data: {e.response.model_dump_json()}\n\n"


class OpenAIServing:

    def __init__(self, engine_client, models: OpenAIServingModels) -> None:
        self.engine_client = engine_client
        self.models = models
        self.tokenizer = engine_client.get_tokenizer()
        self.max_model_len = engine_client.model_config.max_model_len
        hf = engine_client.model_config.hf_config or {}
        self.vocab_size = hf.get("vocab_size", len(self.tokenizer))

    def _check_model(self, model_name: str | None) -> None:
        if self.engine_client.errored:
            raise engine_dead_error(self.engine_client.dead_error)
        if not self.models.is_base_model(model_name):
            raise OpenAIError(f"The model `{model_name}` does not exist.", "NotFoundError",
                              HTTPStatus.NOT_FOUND, param="model", code="model_not_found")

    def _validate_prompt_ids(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise OpenAIError("The prompt is empty.", param="prompt")
        bad = next((t for t in prompt_ids if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"Token id {bad} is out of vocabulary (vocab_size={self.vocab_size}).",
                              param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(prompt_ids)} tokens; at least one token must remain for the output.",
                param="prompt")

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
        """The client's X-Request-Id if it sent one (vLLM honours it too), else a fresh uuid."""
        if raw_request is not None:
            header = raw_request.headers.get("X-Request-Id")
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
                  raw_request: Request | None) -> AsyncGenerator[RequestOutput, None]:
        return self.engine_client.generate(prompt, params, request_id,
                                           trace_headers=self._get_trace_headers(raw_request))

    @staticmethod
    async def _final_output(result_generator: AsyncIterator[RequestOutput]) -> RequestOutput:
        """Drain a FINAL_ONLY generator; engine errors become OpenAIErrors."""
        final = None
        try:
            async for final in result_generator:
                pass
        except EngineDeadError as e:
            raise engine_dead_error(e) from e
        except ValueError as e:
            raise bad_request_from_value_error(e) from e
        if final is None:
            raise OpenAIError("The engine returned no output.", "InternalServerError",
                              HTTPStatus.INTERNAL_SERVER_ERROR)
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
        if isinstance(e, ValueError):
            return stream_error_event(bad_request_from_value_error(e))
        return stream_error_event(OpenAIError(f"{type(e).__name__}: {e}", "InternalServerError",
                                              HTTPStatus.INTERNAL_SERVER_ERROR))


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"
