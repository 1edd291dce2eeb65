"""The OpenAI-compatible HTTP server: FastAPI app on top of AsyncLLM.

Mirrors vllm/entrypoints/openai/api_server.py. Run it with

    vllm-anatomy serve --port 8000          # then: the `openai` client, curl, bench/serve.py

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health (503 when the engine is dead), GET /version, GET /metrics.
Every error is an OpenAI error body {"error": {"message", "type", "param", "code"}}:
a bad field is a 400 naming it, a body over --max-request-body-bytes a 413
(counted while it is read, so a huge body is never buffered first), and even
an unexpected server error is a 500 in that shape, never a bare text page.

Lifecycle (run_server), as vLLM's launcher.serve_http:
  * SIGTERM / SIGINT: new requests and /health get 503; those in flight may
    finish for at most --shutdown-timeout s (vLLM's flag; default 0: none),
    then each ends with an error (a stream: an error event, then [DONE]);
    the engine is stopped and the process exits 0. A second signal skips
    the wait: exit now.
  * The engine dies (or one of its workers, even while idle): /health and
    new requests get 503 at once, in-flight requests end with an error, and
    the server exits with status 1 (vLLM's watchdog) so a supervisor can
    restart it; VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it up answering 503.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import secrets
import signal
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

import uvicorn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import vllm_anatomy
from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from vllm_anatomy.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm_anatomy.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm_anatomy.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES
from vllm_anatomy.entrypoints.openai.serving_engine import (OpenAIError, create_error_response,
                                                            engine_dead_error, validation_error)
from vllm_anatomy.entrypoints.openai.serving_models import BaseModelPath, OpenAIServingModels
from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger("vllm_anatomy.api_server")

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError"}
# Documented error responses, so the OpenAPI schema (and schemathesis) know them.
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)}


def error_json(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.response.model_dump(), status_code=e.status_code)


def with_cancellation(handler):
    """Cancel a non-streaming handler when its client disconnects (vLLM's decorator of that name).

    NOTE: cancelling the handler task raises CancelledError inside the engine
    generator it awaits, and AsyncLLM.generate aborts the request. Streams do
    not need this: Starlette cancels the body iterator itself.
    """
    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        raw_request: Request = kwargs["raw_request"]
        handler_task = asyncio.create_task(handler(*args, **kwargs))
        disconnect_task = asyncio.create_task(_listen_for_disconnect(raw_request))
        done, _ = await asyncio.wait({handler_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
        if handler_task in done:
            disconnect_task.cancel()
            return handler_task.result()
        handler_task.cancel()
        return Response(status_code=499)   # nobody is listening any more
    return wrapper


async def _listen_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator.

    NOTE: when the client disconnects, Starlette cancels the sending task and
    returns, leaving our generator suspended at a `yield` until garbage
    collection. Closing it here runs its `finally` now, which closes the engine
    generator, which aborts the request: blocks are freed within the step.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _respond(result):
    if isinstance(result, (JSONResponse, Response)):
        return result
    if hasattr(result, "__aiter__"):
        return ClosingStreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump())


def build_app(engine_client, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app serving `engine_client` (an AsyncLLM).

    Middleware, outermost first: CORS (only with --allowed-origins), the API
    key, the request-body limit; then FastAPI's routing.
    """
    max_body = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    app = FastAPI(title="vllm_anatomy OpenAI-compatible server", version=vllm_anatomy.__version__)
    app.state.max_request_body_bytes = max_body
    init_app_state(engine_client, app.state, args)
    _add_exception_handlers(app)
    app.add_middleware(RequestSizeLimitMiddleware, max_body_bytes=max_body)
    if getattr(args, "api_key", None):
        app.add_middleware(AuthenticationMiddleware, api_key=args.api_key)
    _add_cors(app, args)
    _add_routes(app)
    maybe_instrument_app(app, getattr(getattr(engine_client, "recorder", None), "provider", None))
    return app


def init_app_state(engine_client, state, args: argparse.Namespace) -> None:
    model_config = engine_client.model_config
    names = args.served_model_name or [args.model or _default_model_name()]
    base_model_paths = [BaseModelPath(name=name, model_path=model_config.model) for name in names]
    state.engine_client = engine_client
    state.openai_serving_models = models = OpenAIServingModels(base_model_paths, model_config.max_model_len)
    # One tokenizer thread for both handlers (vLLM: the renderer's executor).
    state.tokenizer_executor = executor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    state.openai_serving_chat = OpenAIServingChat(engine_client, models, executor)
    state.openai_serving_completion = OpenAIServingCompletion(engine_client, models, executor)
    state.stat_logger = PrometheusStatLogger(models.model_name, model_config.max_model_len)
    # NOTE: AsyncLLM calls every logger in `stat_loggers` after each output batch.
    engine_client.stat_loggers.append(state.stat_logger)


def _default_model_name() -> str:
    from vllm_anatomy.transformers_utils.default_model import DEFAULT_MODEL
    return DEFAULT_MODEL


def _add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error_handler(_: Request, exc: OpenAIError):
        return error_json(exc)

    @app.exception_handler(EngineDeadError)
    async def engine_dead_handler(_: Request, exc: EngineDeadError):
        return error_json(engine_dead_error(exc))

    @app.exception_handler(VLLMValidationError)
    async def vllm_validation_handler(_: Request, exc: VLLMValidationError):
        return error_json(validation_error(exc))

    @app.exception_handler(Exception)
    async def unexpected_error_handler(_: Request, exc: Exception):
        # NOTE: a bug, not the client's fault: still an OpenAI error body (the
        # default is a text/plain "Internal Server Error"). Starlette re-raises
        # the exception afterwards, so uvicorn logs its traceback.
        return error_json(OpenAIError(f"Internal server error: {type(exc).__name__}.", "InternalServerError",
                                      HTTPStatus.INTERNAL_SERVER_ERROR))

    @app.exception_handler(RequestValidationError)
    async def validation_exception_handler(_: Request, exc: RequestValidationError):
        # NOTE: FastAPI answers 422 with its own body; OpenAI clients expect 400
        # and an error object. The first error names the field (`param`).
        errors = _relevant_errors(exc.errors())
        if errors and errors[0].get("type") == "json_invalid":
            ctx = errors[0].get("ctx") or {}
            return error_json(OpenAIError(f"The request body is not valid JSON: {ctx.get('error', 'decode error')}."))
        message = "; ".join(f"{_loc(e) or 'body'}: {e.get('msg', 'invalid')}" for e in errors[:5])
        return error_json(OpenAIError(message or "Invalid request.", param=_loc(errors[0]) if errors else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_exception_handler(_: Request, exc: StarletteHTTPException):
        err = create_error_response(str(exc.detail), _ERROR_TYPES.get(exc.status_code, "Error"),
                                    HTTPStatus(exc.status_code))
        return JSONResponse(err.model_dump(), status_code=exc.status_code, headers=exc.headers)


class RequestSizeLimitMiddleware:
    """413 (an OpenAI error object) for a request body over `max_body_bytes`.

    NOTE: a declared Content-Length over the limit is refused before a byte of
    the body is read; otherwise (chunked bodies too) the bytes are counted as
    they arrive and reading stops at the limit, so a huge body is never
    buffered. The count raises an HTTPException(413) from `receive`, which
    FastAPI passes on to the exception handler above. (FastAPI's own
    max_body_size does the same, but answers a declared oversize body with a
    text/plain 413 that replaces any other response.)
    """

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> StarletteHTTPException:
        return StarletteHTTPException(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"The request body is larger than this server accepts ({self.max_body_bytes} bytes, "
            f"--max-request-body-bytes).")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            exc = self._too_large()
            await error_json(OpenAIError(exc.detail, _ERROR_TYPES[exc.status_code], exc.status_code))(
                scope, receive, send)
            return
        received = 0

        async def receive_with_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, receive_with_limit, send)


class AuthenticationMiddleware:
    """Pure ASGI middleware checking `Authorization: Bearer <api_key>` (vLLM's class of that name).

    NOTE: only the /v1 API is protected; /health, /metrics and /version stay
    open for probes and scrapers, and OPTIONS (a browser's CORS preflight,
    which never carries credentials) passes, as in vLLM. The scheme is
    case-insensitive (RFC 9110), and the key is compared as SHA-256 digests
    with secrets.compare_digest: constant time, whatever the lengths. A pure
    ASGI middleware (rather than @app.middleware("http")) leaves streaming and
    disconnects untouched.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key_digest = hashlib.sha256(api_key.encode()).digest()

    def verify_token(self, authorization: bytes | None) -> bool:
        scheme, _, token = (authorization or b"").decode("latin-1").partition(" ")
        token_digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        # NOTE: compare even for a wrong scheme, so both take the same time.
        return secrets.compare_digest(token_digest, self.api_key_digest) and scheme.lower() == "bearer"

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope.get("method") != "OPTIONS"
                and scope["path"].startswith("/v1")):
            headers = dict(scope.get("headers") or [])
            if not self.verify_token(headers.get(b"authorization")):
                response = error_json(OpenAIError("Incorrect API key provided.", "AuthenticationError",
                                                  HTTPStatus.UNAUTHORIZED, code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_cors(app: FastAPI, args: argparse.Namespace) -> None:
    """CORS headers for browsers, only for the origins given with --allowed-origins.

    NOTE: vLLM allows every origin ("*") by default. Here the default is none:
    any web page the user opens could otherwise call this local server.
    Added after the API-key middleware, so it is the outer one: its preflight
    answers and its headers on errors (401 included) reach the browser.
    """
    origins = getattr(args, "allowed_origins", None)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins,
                           allow_credentials=getattr(args, "allow_credentials", False),
                           allow_methods=getattr(args, "allowed_methods", ["*"]),
                           allow_headers=getattr(args, "allowed_headers", ["*"]))


def _relevant_errors(errors: list[dict]) -> list[dict]:
    """The errors worth reporting: for a union field ("prompt": str | list[int] | ...)
    pydantic reports one error per member; when the value had a member's type and
    failed its constraint (a lone surrogate, an int past 64 bits), only that one."""
    specific = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    return specific or errors


def _loc(error: dict) -> str | None:
    """'messages.0.content' from pydantic's ('body', 'messages', 0, 'content', 'str').

    Union members are tagged in `loc` ('str', 'list[int]', 'function-after[...]'):
    dropped, so `param` is the field's name."""
    parts = [str(x) for x in error.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    return ".".join(parts) or None


def _is_union_tag(x) -> bool:
    return isinstance(x, str) and ("[" in x or x in {"str", "int", "float", "bool", "constrained-int"})


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(raw_request: Request) -> Response:
        try:
            await raw_request.app.state.engine_client.check_health()
        except EngineDeadError:
            return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=HTTPStatus.OK)

    @app.get("/version")
    async def show_version() -> JSONResponse:
        return JSONResponse({"version": vllm_anatomy.__version__})

    @app.get("/metrics")
    async def metrics(raw_request: Request) -> Response:
        registry = raw_request.app.state.stat_logger.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_ERRORS)
    async def show_available_models(raw_request: Request) -> JSONResponse:
        models = await raw_request.app.state.openai_serving_models.show_available_models()
        return JSONResponse(models.model_dump())

    @app.post("/v1/chat/completions", responses=_ERRORS)
    @with_cancellation
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        handler = raw_request.app.state.openai_serving_chat
        return _respond(await handler.create_chat_completion(request, raw_request))

    @app.post("/v1/completions", responses=_ERRORS)
    @with_cancellation
    async def create_completion(request: CompletionRequest, raw_request: Request):
        handler = raw_request.app.state.openai_serving_completion
        return _respond(await handler.create_completion(request, raw_request))


def maybe_instrument_app(app: FastAPI, tracer_provider=None) -> bool:
    """Tracing hook: HTTP server spans via opentelemetry-instrumentation-fastapi.

    Only when a real SDK TracerProvider is configured (passed in, or set
    globally by the tracing setup): with the default no-op provider the
    instrumentation would only cost time. Returns whether it instrumented.
    """
    from opentelemetry import trace
    provider = tracer_provider or trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return False
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    return True


# A backstop for uvicorn's own wait for open connections at exit: every request
# has ended (drained or failed) by then, so only a stuck client is cut off.
UVICORN_GRACEFUL_SHUTDOWN_S = 5


def _keep_alive_on_engine_death() -> bool:
    return os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0") not in ("", "0")


class UvicornServer(uvicorn.Server):
    """uvicorn.Server without its own signal handling: serve_http's handlers decide.

    NOTE: uvicorn's handler waits, on SIGTERM, for every open connection to
    end (a long stream: for as long as it runs) and ignores a second SIGTERM.
    """

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def run_server(args: argparse.Namespace, **uvicorn_kwargs) -> int:
    """Start AsyncLLM (EngineCore in its own process), serve until a signal or the
    engine's death, stop the engine. Returns the exit status: 1 if the engine died."""
    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.engine.async_llm import AsyncLLM

    engine_client = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args), multiprocess=True)
    force_exit = False
    try:
        app = build_app(engine_client, args)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log,
                                timeout_graceful_shutdown=UVICORN_GRACEFUL_SHUTDOWN_S, **uvicorn_kwargs)
        server = UvicornServer(config)
        logger.warning("vllm_anatomy OpenAI server on http://%s:%d (model %s)", args.host, args.port,
                       app.state.openai_serving_models.model_name)
        force_exit = await serve_http(server, engine_client, args.shutdown_timeout)
        return 1 if engine_client.engine_core.engine_dead else 0
    finally:
        # NOTE: after a second signal the engine is killed at once; otherwise it
        # gets SIGTERM and a few seconds. Either way its process is reaped and
        # its socket directory and shared memory are removed here.
        engine_client.shutdown(timeout=0 if force_exit else None)


async def serve_http(server: uvicorn.Server, engine_client, shutdown_timeout: float) -> bool:
    """Serve until a signal (then drain) or the engine's death; True if a second signal forced the exit."""
    loop = asyncio.get_running_loop()
    shutdown_requested, force_exit = asyncio.Event(), asyncio.Event()

    def signal_handler(signum: int) -> None:
        name = signal.Signals(signum).name
        if shutdown_requested.is_set():
            # NOTE: ends the drain at once; every request then ends with an error,
            # so uvicorn's wait for open connections is short (and bounded anyway).
            logger.warning("%s again: exiting now.", name)
            force_exit.set()
            return
        logger.warning("%s: shutting down; requests in flight get at most %g s (--shutdown-timeout). "
                       "Send it again to exit now.", name, shutdown_timeout)
        shutdown_requested.set()

    # NOTE: loop.add_signal_handler runs the handler as a loop callback, where
    # setting asyncio events is safe (a plain signal.signal handler is not).
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signal_handler, sig)
    tasks = [loop.create_task(watchdog_loop(server, engine_client)),
             loop.create_task(handle_shutdown(server, engine_client, shutdown_timeout,
                                              shutdown_requested, force_exit))]
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()
    return force_exit.is_set()


async def handle_shutdown(server: uvicorn.Server, engine_client, timeout: float,
                          shutdown_requested: asyncio.Event, force_exit: asyncio.Event) -> None:
    """On the first signal: drain (bounded), fail what is left, then stop the HTTP server."""
    await shutdown_requested.wait()
    failed = await engine_client.drain(timeout, abort_now=force_exit)
    if failed:
        logger.warning("Shutdown: %d request(s) still running were ended with an error.", len(failed))
    server.should_exit = True


async def watchdog_loop(server: uvicorn.Server, engine_client) -> None:
    """Stop the server once the engine is dead (vLLM's watchdog_loop).

    NOTE: vLLM looks at `engine.errored` every 5 s. AsyncLLM's output handler
    ends exactly when the engine dies (it hands EngineDeadError to every
    request, then returns), so waiting for that task is enough: no polling.
    """
    if engine_client.output_handler is not None:
        await asyncio.wait({engine_client.output_handler})
    terminate_if_errored(server, engine_client)


def terminate_if_errored(server: uvicorn.Server, engine_client) -> None:
    if not (engine_client.errored and not engine_client.is_running) or server.should_exit:
        return
    if _keep_alive_on_engine_death():
        logger.error("EngineCore is dead; the server stays up and answers 503 (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH).")
        return
    logger.error("EngineCore is dead: stopping the server (exit status 1). "
                 "Set VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 to keep it up, answering 503.")
    server.should_exit = True
