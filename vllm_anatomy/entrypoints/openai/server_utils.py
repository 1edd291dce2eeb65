"""Error mapping and middleware of the OpenAI server (vLLM's
vllm/entrypoints/serve/utils/server_utils.py): every error becomes an OpenAI
error body {"error": {"message", "type", "param", "code"}}; the request-body
limit (413) and the API key (401) are pure ASGI middleware.
"""
from __future__ import annotations

import hashlib
import secrets
from http import HTTPStatus
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.entrypoints.openai.serving_engine import (OpenAIError, create_error_response,
                                                            engine_dead_error, validation_error)
from vllm_anatomy.exceptions import VLLMValidationError

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError"}


def error_json(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.response.model_dump(), status_code=e.status_code)

def add_exception_handlers(app: FastAPI) -> None:
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
            error = OpenAIError(exc.detail, _ERROR_TYPES[exc.status_code], HTTPStatus(exc.status_code))
            await error_json(error)(scope, receive, send)
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


def _relevant_errors(errors: Sequence[dict]) -> list[dict]:
    """The errors worth reporting: for a union field ("prompt": str | list[int] | ...)
    pydantic reports one error per member; when the value had a member's type and
    failed its constraint (a lone surrogate, an int past 64 bits), only that one."""
    specific = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    return specific or list(errors)


def _loc(error: dict) -> str | None:
    """'messages.0.content' from pydantic's ('body', 'messages', 0, 'content', 'str').

    Union members are tagged in `loc` ('str', 'list[int]', 'function-after[...]'):
    dropped, so `param` is the field's name."""
    parts = [str(x) for x in error.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    return ".".join(parts) or None


def _is_union_tag(x) -> bool:
    return isinstance(x, str) and ("[" in x or x in {"str", "int", "float", "bool", "constrained-int"})
