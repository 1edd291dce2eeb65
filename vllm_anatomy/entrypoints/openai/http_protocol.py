"""The HTTP/1.1 connection the server speaks: uvicorn's h11 protocol, with timeouts and a connection cap.

Ours (issue 29); vLLM serves with uvicorn's defaults, which close a connection
only after a complete response (keep-alive, 5 s). A client that opens a
socket and never sends a byte, or sends half a request line, or a body one byte
a minute, holds a file descriptor forever: 1,100 such sockets exhausted the
default 1,024 descriptors, /health timed out, and every refused accept() logged
a traceback (29.5 MB in ~10 s).

GuardedH11Protocol adds, per connection (flags in cli_args.py):

  * --header-read-timeout: a request's headers must be complete this many
    seconds after the connection opens or its previous response ends; else the
    connection is closed. (Counting the whole head, not the gap between bytes,
    is what stops a client that sends one byte every few seconds.)
  * --body-read-timeout: the whole body must arrive this many seconds after the
    headers; else the connection is closed (the handler sees a disconnect).
  * --limit-concurrency: the most open connections. A connection past it makes
    room by closing the connection that has been idle longest (no request in
    flight: waiting for headers or kept alive), as nginx reuses idle keep-alive
    connections; when every other connection is busy with a request, the new
    one's request gets a 503 (an OpenAI error body) and the connection closes.
    So idle sockets can never crowd out /health or a real request.
  * --write-timeout: a response whose client reads none of it for this many
    seconds is abandoned. uvicorn stops writing when the connection's send
    buffer (asyncio's transport: 64 KiB high-water mark, on top of the kernel's
    socket buffers) is full, and the handler waits in `send`: a client that
    never reads its stream held the request, its connection and its slot under
    --limit-concurrency for ever (the engine kept generating; nothing drained).
    The kernel's share is bounded too: each connection's SO_SNDBUF is set to
    SEND_BUFFER_BYTES (Linux doubles it; its autotuning would let a socket
    nobody reads from absorb up to tcp_wmem's 4 MiB, minutes of a stream).
    When writing has been paused that long the connection is aborted (no
    flush): the handler sees a disconnect, the stream's generator is closed,
    and the request is aborted in the engine (its KV blocks freed).
  * --timeout-keep-alive is uvicorn's own (passed to uvicorn.Config).
"""
from __future__ import annotations

import json
import logging
import resource
import socket
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("vllm_anatomy.api_server")


# The kernel send buffer of each connection (ample for a token stream: 128 KiB per RTT).
SEND_BUFFER_BYTES = 128 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    header_read_timeout: float
    body_read_timeout: float
    max_connections: int
    write_timeout: float = 30.0


def default_max_connections(fd_reserve: int, cap: int) -> int:
    """The open-file limit minus what the server needs for itself, at most `cap`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return cap
    return max(1, min(cap, soft - fd_reserve))


def raise_fd_limit(target: int = 65535) -> None:
    """Raise the soft open-file limit toward the hard one (vLLM's set_ulimit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            logger.warning("Open-file limit %d could not be raised (%s); connections are capped below it.", soft, e)


_OVER_CAPACITY_BODY = json.dumps({"error": {
    "message": "The server has too many open connections that are all busy; retry shortly "
               "(--limit-concurrency).", "type": "ServiceUnavailableError", "param": None, "code": 503}}).encode()


async def over_capacity_app(scope: dict, receive: Any, send: Any) -> None:
    """A 503 in the OpenAI error shape, and the connection closes (uvicorn's own answer is text/plain)."""
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                            (b"content-length", str(len(_OVER_CAPACITY_BODY)).encode())]})
    await send({"type": "http.response.body", "body": _OVER_CAPACITY_BODY})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol plus header/body read deadlines and the connection cap."""

    limits = ConnectionLimits(header_read_timeout=10.0, body_read_timeout=30.0, max_connections=1024)

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[GuardedH11Protocol]:
        """A subclass bound to `limits` (uvicorn builds protocols from a class)."""
        return type("GuardedH11Protocol", (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: Any = None
        self._body_timer: Any = None
        self._write_timer: Any = None
        self._idle_since = 0.0

    # -- connection -------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            except OSError:
                pass
        self._idle_since = self.loop.time()
        self._header_timer = self.loop.call_later(self.limits.header_read_timeout, self._on_header_timeout)
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def is_idle(self) -> bool:
        """No request in flight: waiting for a request's headers, or kept alive."""
        return self.cycle is None or self.cycle.response_complete

    def _make_room(self) -> None:
        idle = [c for c in self.connections
                if c is not self and isinstance(c, GuardedH11Protocol) and c.is_idle()
                and not c.transport.is_closing()]
        if idle:
            min(idle, key=lambda c: c._idle_since).transport.close()
            return
        logger.warning("%d open connections, all busy (--limit-concurrency %d): answering 503.",
                       len(self.connections), self.limits.max_connections)
        self.app = over_capacity_app

    # -- the request's head and body -------------------------------------------------
    def handle_events(self) -> None:
        cycle_before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not cycle_before:
            # A request's headers arrived: its body (if any) has its own deadline.
            self._cancel(self._header_timer)
            self._header_timer = None
            if cycle.more_body and self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_read_timeout, self._on_body_timeout)
        if self._body_timer is not None and (cycle is None or not cycle.more_body):
            self._cancel(self._body_timer)
            self._body_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        self._idle_since = self.loop.time()
        self._cancel(self._header_timer)
        self._header_timer = self.loop.call_later(self.limits.header_read_timeout, self._on_header_timeout)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.is_idle() and not self.transport.is_closing():
            self._close()

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            logger.warning("A request body did not arrive within %g s (--body-read-timeout): connection closed.",
                           self.limits.body_read_timeout)
            self._close()

    # -- the response: a client that stops reading ------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._on_write_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(self._write_timer)
        self._write_timer = None

    def _on_write_timeout(self) -> None:
        self._write_timer = None
        if self.flow.write_paused:
            logger.warning("A client read none of its response for %g s (--write-timeout): connection "
                           "aborted, its request ended.", self.limits.write_timeout)
            # NOTE: abort, not close: close() would wait to flush a buffer nobody reads.
            self.transport.abort()

    def _close(self) -> None:
        # (connection_lost then ends the h11 state machine and the request cycle, if any)
        self.transport.close()

    def _cancel_timers(self) -> None:
        self._cancel(self._header_timer)
        self._cancel(self._body_timer)
        self._cancel(self._write_timer)
        self._header_timer = self._body_timer = self._write_timer = None

    @staticmethod
    def _cancel(timer: Any) -> None:
        if timer is not None:
            timer.cancel()
