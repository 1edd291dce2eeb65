"""The OpenAI-compatible HTTP server: FastAPI app on top of AsyncLLM.

Mirrors vllm/entrypoints/openai/api_server.py. Run it with

    vllm-anatomy serve --port 8000          # then: the `openai` client, curl, bench/serve.py

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health (503 when the engine is dead), GET /version, GET /metrics.
Every error is an OpenAI error body {"error": {"message", "type", "param", "code"}}:
a bad field is a 400 naming it, a body over --max-request-body-bytes a 413
(counted while it is read, so a huge body is never buffered first), and even
an unexpected server error is a 500 in that shape, never a bare text page
(server_utils.py: the error mapping and the middleware).

Lifecycle (run_server; entrypoints/launcher.py, as vLLM's launcher.serve_http):
  * SIGTERM / SIGINT: new requests and /health get 503; those in flight may
    finish for at most --shutdown-timeout s (vLLM's flag; default 0: none),
    then each ends with an error (a stream: an error event, then [DONE]);
    the engine is stopped and the process exits 0. A second signal skips
    the wait: exit now.
  * The engine dies (or one of its workers, even while idle): /health and
    new requests get 503 at once, in-flight requests end with an error, and
    the server exits with status 1 (vLLM's watchdog) so a supervisor can
    restart it; VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it up answering 503.

Slow and idle clients (ours; issue 29): connections must send their headers
within --header-read-timeout and their body within --body-read-timeout, a
response nobody reads is abandoned after --write-timeout (its request aborted), idle
keep-alive connections close after --timeout-keep-alive, and at most
--limit-concurrency connections are open (http_protocol.py). Log lines are
escaped and rate-limited (log_guard.py).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any, Callable, Coroutine

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import vllm_anatomy
from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.entrypoints.launcher import UVICORN_GRACEFUL_SHUTDOWN_S, UvicornServer, serve_http
from vllm_anatomy.entrypoints.openai.cli_args import (DEFAULT_HEADER_READ_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS,
                                                      DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_WRITE_TIMEOUT_S,
                                                      FD_RESERVE)
from vllm_anatomy.entrypoints.openai.http_protocol import (ConnectionLimits, GuardedH11Protocol,
                                                           default_max_connections, raise_fd_limit)
from vllm_anatomy.entrypoints.openai.log_guard import install_log_guard
from vllm_anatomy.entrypoints.openai.chat_protocol import ChatCompletionRequest
from vllm_anatomy.entrypoints.openai.completion_protocol import CompletionRequest
from vllm_anatomy.entrypoints.openai.protocol import ErrorResponse
from vllm_anatomy.entrypoints.openai.request_body import OffLoopJSONRoute
from vllm_anatomy.entrypoints.openai.server_utils import (AuthenticationMiddleware, RequestSizeLimitMiddleware,
                                                          add_exception_handlers)
from vllm_anatomy.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm_anatomy.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm_anatomy.entrypoints.openai.serving_models import BaseModelPath, OpenAIServingModels
from vllm_anatomy.metrics.prometheus import PrometheusStatLogger
from vllm_anatomy.structured_output.compile_executor import GrammarCompileExecutor

logger = logging.getLogger("vllm_anatomy.api_server")

# Documented error responses, so the OpenAPI schema (and schemathesis) know them.
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)}


def with_cancellation(handler: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Coroutine[Any, Any, Any]]:
    """Cancel a non-streaming handler when its client disconnects (vLLM's decorator of that name).

    NOTE: cancelling the handler task raises CancelledError inside the engine
    generator it awaits, and AsyncLLM.generate aborts the request. Streams do
    not need this: Starlette cancels the body iterator itself.
    """
    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
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
            if isinstance(self.body_iterator, AsyncGenerator):
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
    add_exception_handlers(app)
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
    # One low-priority thread checks structured-output constraints (serving_engine.py).
    state.grammar_executor = grammar = GrammarCompileExecutor(1, thread_name_prefix="grammar_validate")
    state.openai_serving_chat = OpenAIServingChat(
        engine_client, models, executor, grammar,
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False))
    state.openai_serving_completion = OpenAIServingCompletion(engine_client, models, executor, grammar)
    vllm_config = getattr(engine_client, "vllm_config", None)
    state.stat_logger = PrometheusStatLogger(models.model_name, model_config.max_model_len,
                                             num_speculative_tokens=vllm_config.num_speculative_tokens
                                             if vllm_config is not None else 0)
    # NOTE: AsyncLLM calls every logger in `stat_loggers` after each output batch.
    engine_client.stat_loggers.append(state.stat_logger)


def _default_model_name() -> str:
    from vllm_anatomy.transformers_utils.default_model import DEFAULT_MODEL
    return DEFAULT_MODEL


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


def _add_routes(app: FastAPI) -> None:
    # NOTE: (ours) large JSON bodies are decoded off the event loop (request_body.py).
    app.router.route_class = OffLoopJSONRoute

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
    # NOTE: no ASGI "http receive"/"http send" spans (one per streamed chunk; the disconnect
    # check's receive outlives the request's span), and no trace for a probe (/health, /ping,
    # /metrics: a trace of one span each) unless OTEL_PYTHON_FASTAPI_EXCLUDED_URLS says otherwise.
    excluded = None if os.environ.get("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS") else "/health,/ping,/metrics,/version"
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, excluded_urls=excluded,
                                       exclude_spans=["receive", "send"])
    return True


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The per-connection limits from the flags (http_protocol.py)."""
    max_connections = args.limit_concurrency or default_max_connections(FD_RESERVE, DEFAULT_MAX_CONNECTIONS)
    return ConnectionLimits(header_read_timeout=getattr(args, "header_read_timeout", DEFAULT_HEADER_READ_TIMEOUT_S),
                            body_read_timeout=args.body_read_timeout, max_connections=max_connections,
                            write_timeout=getattr(args, "write_timeout", DEFAULT_WRITE_TIMEOUT_S))


async def run_server(args: argparse.Namespace, **uvicorn_kwargs) -> int:
    """Start AsyncLLM (EngineCore in its own process), serve until a signal or the
    engine's death, stop the engine. Returns the exit status: 1 if the engine died."""
    from vllm_anatomy.engine.arg_utils import EngineArgs
    from vllm_anatomy.engine.async_llm import AsyncLLM

    install_log_guard()
    raise_fd_limit()
    engine_client = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args), multiprocess=True)
    force_exit = False
    try:
        app = build_app(engine_client, args)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log,
                                timeout_graceful_shutdown=UVICORN_GRACEFUL_SHUTDOWN_S,
                                http=GuardedH11Protocol.with_limits(connection_limits(args)),
                                timeout_keep_alive=args.timeout_keep_alive, **uvicorn_kwargs)
        install_log_guard()     # again: uvicorn.Config has just set up its own handlers
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
