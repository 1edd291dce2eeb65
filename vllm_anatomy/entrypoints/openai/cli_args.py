"""Command-line arguments of the OpenAI-compatible server.

Mirrors vllm/entrypoints/openai/cli_args.py (make_arg_parser): the server's
own flags plus every engine argument (EngineArgs.add_cli_args).
"""
from __future__ import annotations

import argparse

from vllm_anatomy.engine.arg_utils import EngineArgs

# NOTE: vLLM sets no limit. A prompt of max_model_len tokens is well under
# 1 MB of JSON for the models this project serves; 8 MiB leaves room for long
# contexts and escaped text while keeping one request from pinning gigabytes.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
# NOTE: (issue 29) uvicorn closes nothing that never sends a complete request:
# 1,100 idle sockets exhausted the 1,024 file descriptors and /health timed out.
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0          # uvicorn's and vLLM's default
DEFAULT_HEADER_READ_TIMEOUT_S = 10.0
DEFAULT_BODY_READ_TIMEOUT_S = 30.0          # 8 MiB at ~300 KB/s
DEFAULT_WRITE_TIMEOUT_S = 30.0             # a client that reads nothing of its response this long
DEFAULT_MAX_CONNECTIONS = 1024
FD_RESERVE = 128                            # descriptors kept for the server's own files and sockets


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser.add_argument
    # NOTE: 127.0.0.1 by default (vLLM binds all interfaces): a learning server
    # should not be reachable from the network unless asked (--host 0.0.0.0).
    p("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p("--port", type=int, default=8000)
    p("--api-key", default=None,
      help="if set, every /v1 request needs the header `Authorization: Bearer <key>`")
    p("--served-model-name", nargs="+", default=None,
      help="model name(s) clients use (default: the --model value, or the default model's alias)")
    p("--uvicorn-log-level", default="warning",
      choices=["critical", "error", "warning", "info", "debug", "trace"])
    p("--disable-uvicorn-access-log", action="store_true")
    p("--shutdown-timeout", type=int, default=0,
      help="on SIGTERM/SIGINT, seconds requests in flight may still run before they are ended "
           "with an error (vLLM's flag and default: 0 = end them at once); a second signal exits now")
    p("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
      help="largest request body accepted; a larger one gets 413, counted while it is read "
           f"(default {DEFAULT_MAX_REQUEST_BODY_BYTES} = 8 MiB)")
    p("--trust-request-chat-template", action="store_true",
      help="accept a chat template sent with a request (chat_template, chat_template_kwargs.chat_template); "
           "refused with a 400 otherwise (vLLM's flag: a template is code the server runs)")
    # Slow and idle clients (ours: vLLM leaves uvicorn's defaults; see http_protocol.py).
    p("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
      help="seconds an idle keep-alive connection stays open after a response (uvicorn's flag, "
           f"default {DEFAULT_TIMEOUT_KEEP_ALIVE_S:g})")
    p("--header-read-timeout", type=float, default=DEFAULT_HEADER_READ_TIMEOUT_S,
      help="seconds a connection has to send a request's complete headers, from when it opens or its "
           f"previous response ends; then it is closed (default {DEFAULT_HEADER_READ_TIMEOUT_S:g})")
    p("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S,
      help="seconds a request has to send its whole body after its headers; then the connection is "
           f"closed (default {DEFAULT_BODY_READ_TIMEOUT_S:g})")
    p("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT_S,
      help="seconds a client may read nothing of its response while the server has data to send (its "
           "send buffer full); then the connection is aborted and its request ended "
           f"(default {DEFAULT_WRITE_TIMEOUT_S:g})")
    p("--limit-concurrency", type=int, default=None,
      help="most open connections; past it the oldest idle connection is closed to make room, and if "
           "none is idle the new one gets 503 (default: the open-file limit minus "
           f"{FD_RESERVE}, at most {DEFAULT_MAX_CONNECTIONS})")
    # CORS, vLLM's flags (vLLM allows every origin by default; here none unless given).
    p("--allowed-origins", nargs="+", default=None,
      help="origins a browser may call the API from (CORS), e.g. http://localhost:3000 or '*'")
    p("--allowed-methods", nargs="+", default=["*"], help="CORS allowed methods (with --allowed-origins)")
    p("--allowed-headers", nargs="+", default=["*"], help="CORS allowed headers (with --allowed-origins)")
    p("--allow-credentials", action="store_true", help="CORS: allow credentials (with --allowed-origins)")
    EngineArgs.add_cli_args(parser)
    return parser


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be at least 1, got {args.max_request_body_bytes}")
    for flag in ("timeout_keep_alive", "header_read_timeout", "body_read_timeout", "write_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.limit_concurrency is not None and args.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be at least 1, got {args.limit_concurrency}")
