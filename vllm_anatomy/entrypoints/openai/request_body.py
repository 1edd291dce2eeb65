"""How a request's JSON body is decoded: small bodies inline, large ones in a worker thread, in steps.

Ours (issue 29). FastAPI (and so vLLM 0.27.1, whose routes take the pydantic
request as a parameter) decodes every body with `json.loads` on the event loop,
then validates it with pydantic, also on the loop. Both are C code that holds
the GIL for the whole call, so moving them to a thread changes nothing: a
6.9 MB body of 700,000 stop strings took 0.13 s to decode and 0.2 s to
validate, and /health waited 0.32-0.60 s behind it.

Here (OffLoopJSONRoute, FastAPI's documented custom-route pattern):

  * A body of at most SMALL_BODY_BYTES is decoded inline with `json.loads`, as
    FastAPI does (the fast path: ~0.1 ms for 1 KB).
  * A larger body is decoded in one worker thread by `decode_json_in_steps`, a
    recursive-descent decoder written in Python (strings go through the C
    `scanstring`). Python code gives the GIL back every few milliseconds, so the
    event loop keeps answering while it runs (it also offers the GIL every 256
    values); it is slower than json.loads (~1.3-2.7 us a value),
    and it stops at MAX_JSON_VALUES values or MAX_JSON_DEPTH levels with a 400.
  * pydantic then validates the decoded body on the loop, as before; bounded by
    MAX_JSON_VALUES (~0.1 s at the bound), it no longer grows with the body.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any, Callable, Coroutine

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

# Bodies up to this size are decoded inline (worst case ~130k tiny values: ~10 ms).
SMALL_BODY_BYTES = 256 * 1024
# NOTE: the most JSON values (strings, numbers, literals, arrays, objects) in a large
# body. vLLM has no such bound; a valid request needs far fewer (a prompt of token ids
# is one value per token: 8 prompts of 32k tokens fit). It is what keeps pydantic's
# validation, which runs on the event loop, under ~0.1 s.
MAX_JSON_VALUES = 262_144
MAX_JSON_DEPTH = 256
# NOTE: a thread that wants the GIL waits up to sys.getswitchinterval() (5 ms) for it; the
# decoder offers it every this many values (~0.5 ms), so the event loop, which streams every
# other client's tokens, barely waits (measured: 805 loop turns/s during a decode with it,
# 608 without, 879 idle; the decode itself 7 % slower).
YIELD_EVERY_VALUES = 256

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_LITERALS = (("true", True), ("false", False), ("null", None))


class JSONBudgetError(ValueError):
    """The body holds more values, or deeper nesting, than this server decodes."""


class _StepDecoder:
    """One decode: a recursive descent over `text`, counting values and depth."""

    def __init__(self, text: str, max_values: int, max_depth: int) -> None:
        self.text = text
        self.values_left = max_values
        self.max_values = max_values
        self.max_depth = max_depth

    def _error(self, msg: str, pos: int) -> json.JSONDecodeError:
        return json.JSONDecodeError(msg, self.text, pos)

    def _skip_ws(self, pos: int) -> int:
        return _WS.match(self.text, pos).end()     # type: ignore[union-attr]

    def value(self, pos: int, depth: int) -> tuple[Any, int]:
        self.values_left -= 1
        if self.values_left < 0:
            raise JSONBudgetError(f"The request body holds more than {self.max_values} JSON values.")
        if self.values_left % YIELD_EVERY_VALUES == 0:
            time.sleep(0)       # hand the GIL to the event loop now rather than at the next 5 ms switch
        text = self.text
        if pos >= len(text):
            raise self._error("Expecting value", pos)
        ch = text[pos]
        if ch == '"':
            return scanstring(text, pos + 1, True)
        if ch == "{" or ch == "[":
            if depth >= self.max_depth:
                raise JSONBudgetError(f"The request body is nested more than {self.max_depth} levels deep.")
            return self.obj(pos + 1, depth + 1) if ch == "{" else self.array(pos + 1, depth + 1)
        m = _NUMBER.match(text, pos)
        if m is not None:
            frac, exp = m.group(1), m.group(2)
            return (float(m.group()) if frac or exp else int(m.group())), m.end()
        for word, literal in _LITERALS:
            if text.startswith(word, pos):
                return literal, pos + len(word)
        if text.startswith("NaN", pos) or text.startswith("Infinity", pos) or text.startswith("-Infinity", pos):
            word = "-Infinity" if ch == "-" else ("NaN" if ch == "N" else "Infinity")
            return float(word), pos + len(word)      # (json.loads accepts them; pydantic refuses them)
        raise self._error("Expecting value", pos)

    def array(self, pos: int, depth: int) -> tuple[list, int]:
        out: list = []
        pos = self._skip_ws(pos)
        if self.text.startswith("]", pos):
            return out, pos + 1
        while True:
            item, pos = self.value(pos, depth)
            out.append(item)
            done, pos = self._end_or_comma(pos, "]")
            if done:
                return out, pos

    def obj(self, pos: int, depth: int) -> tuple[dict, int]:
        out: dict = {}
        pos = self._skip_ws(pos)
        if self.text.startswith("}", pos):
            return out, pos + 1
        while True:
            if not self.text.startswith('"', pos):
                raise self._error("Expecting property name enclosed in double quotes", pos)
            key, pos = scanstring(self.text, pos + 1, True)
            pos = self._skip_ws(pos)
            if not self.text.startswith(":", pos):
                raise self._error("Expecting ':' delimiter", pos)
            out[key], pos = self.value(self._skip_ws(pos + 1), depth)
            done, pos = self._end_or_comma(pos, "}")
            if done:
                return out, pos

    def _end_or_comma(self, pos: int, close: str) -> tuple[bool, int]:
        """After a container's item: (True, past `close`) at its end, else (False, the next item)."""
        pos = self._skip_ws(pos)
        if self.text.startswith(close, pos):
            return True, pos + 1
        if not self.text.startswith(",", pos):
            raise self._error("Expecting ',' delimiter", pos)
        return False, self._skip_ws(pos + 1)


def decode_json_in_steps(body: bytes, max_values: int = MAX_JSON_VALUES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(body)`, in Python steps (the GIL is released between them), within the bounds.

    Raises json.JSONDecodeError (as json.loads would) or JSONBudgetError."""
    try:
        text = body.decode(json.detect_encoding(body))
    except UnicodeDecodeError as e:
        raise json.JSONDecodeError(f"the body is not valid text ({e.reason})", "", 0) from None
    decoder = _StepDecoder(text, max_values, max_depth)
    value, end = decoder.value(decoder._skip_ws(0), 0)
    end = decoder._skip_ws(end)
    if end != len(text):
        raise decoder._error("Extra data", end)
    return value


# One thread: large bodies are decoded one at a time (they share the GIL anyway).
# NOTE: at normal priority. Niced like grammar compiles (+10) it holds the GIL while it waits
# for a core, and the event loop waits with it: /health took 1.3 s on the loaded 2-core machine.
_body_executor = ThreadPoolExecutor(1, thread_name_prefix="json_body")


class OffLoopJSONRequest(Request):
    """A Request whose json() decodes a large body in the worker thread."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) <= SMALL_BODY_BYTES:
                self._json = json.loads(body)
            else:
                loop = asyncio.get_running_loop()
                try:
                    self._json = await loop.run_in_executor(_body_executor, decode_json_in_steps, body)
                except JSONBudgetError as e:
                    # (an HTTPException passes FastAPI's body parsing untouched: a 400 that says why)
                    raise HTTPException(HTTPStatus.BAD_REQUEST, str(e)) from None
        return self._json


class OffLoopJSONRoute(APIRoute):
    """An APIRoute whose handler reads its JSON body with OffLoopJSONRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(OffLoopJSONRequest(request.scope, request.receive))
        return route_handler
