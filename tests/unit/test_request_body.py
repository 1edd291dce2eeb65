"""request_body.py: large JSON bodies are decoded off the event loop, in steps, within bounds (issue 29)."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from vllm_anatomy.entrypoints.openai import request_body
from vllm_anatomy.entrypoints.openai.request_body import (MAX_JSON_DEPTH, SMALL_BODY_BYTES, JSONBudgetError,
                                                          OffLoopJSONRequest, OffLoopJSONRoute, decode_json_in_steps)

DOCS = [b'{"a": [1, 2.5, -3e2, 1E+2, 0, -0, true, false, null, "x\\u00e9\\n"], "b": {}, "c": []}',
        b' [ ] ', b'"\\ud800"', b'{"k": "\xc3\xa9\xe2\x82\xac"}', b'123', b'-0.5e-3', b'{"a":{"a":{"a":[[[]]]}}}',
        '{"utf16": "ok"}'.encode("utf-16"), b'{"dup": 1, "dup": 2}', b'\t\n\r {"ws" : [ 1 , 2 ] }\n']
BAD = [b'{"a" 1}', b'[1,]', b'[1 2]', b'{"a":1}x', b'', b'{', b'[', b'{"a":}', b'{1: 2}', b'tru', b'"abc',
       b'01', b'[1.]', b'\xff\xfe\x00', b'{"a": 1,}', b'"\x01"']


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.randint(-10**20, 10**20)
    if kind == 1:
        return rng.uniform(-1e6, 1e6)
    if kind == 2:
        return "".join(rng.choice('ab"\\\n\u00e9\u20ac\U0001F600 ') for _ in range(rng.randrange(6)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.randrange(3)
    if kind in (5, 6):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{rng.randrange(9)}": _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


@pytest.mark.parametrize("doc", DOCS)
def test_decodes_as_json_loads(doc):
    assert decode_json_in_steps(doc) == json.loads(doc)


def test_decodes_random_documents_as_json_loads():
    rng = random.Random(0)
    for _ in range(300):
        value = _random_json(rng)
        for separators in ((",", ":"), (", ", ": ")):
            doc = json.dumps(value, separators=separators, ensure_ascii=rng.random() < 0.5).encode()
            assert decode_json_in_steps(doc) == json.loads(doc), doc


@pytest.mark.parametrize("doc", BAD)
def test_refuses_what_json_loads_refuses(doc):
    with pytest.raises(ValueError):
        json.loads(doc)
    with pytest.raises(json.JSONDecodeError):
        decode_json_in_steps(doc)


def test_bounds_on_values_and_depth():
    assert decode_json_in_steps(b"[1, 2, 3]", max_values=4) == [1, 2, 3]      # the array is a value too
    with pytest.raises(JSONBudgetError, match="more than 3 JSON values"):
        decode_json_in_steps(b"[1, 2, 3]", max_values=3)
    nested = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert decode_json_in_steps(nested) is not None
    with pytest.raises(JSONBudgetError, match=f"nested more than {MAX_JSON_DEPTH} levels"):
        decode_json_in_steps(b"[" + nested + b"]")
    with pytest.raises(JSONBudgetError):         # (json.loads would raise RecursionError, a 500 in waiting)
        decode_json_in_steps(b"[" * 100_000 + b"]" * 100_000)


def _request(body: bytes) -> OffLoopJSONRequest:
    chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)] or [b""]

    async def receive() -> dict:
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
    return OffLoopJSONRequest({"type": "http", "method": "POST", "headers": []}, receive)


def test_a_small_body_is_decoded_inline(monkeypatch):
    monkeypatch.setattr(request_body, "_body_executor", None)        # any use of the thread would fail
    body = json.dumps({"model": "m", "prompt": "x" * 900, "max_tokens": 8}).encode()
    assert len(body) < 1024 <= SMALL_BODY_BYTES
    assert asyncio.run(_request(body).json()) == json.loads(body)


def test_a_large_body_leaves_the_event_loop_answering():
    """700,000 stop strings (6.9 MB): json.loads holds the loop for the whole decode, the
    stepped decoder in its thread for a few ms at a time. The bound is a ratio: the loop's
    worst stall is under a quarter of the decode's own time."""
    body = json.dumps({"model": "m", "prompt": "p", "stop": [f"s{i}" for i in range(700_000)]},
                      separators=(",", ":")).encode()

    async def run() -> tuple[float, float, Exception | None]:
        worst, stop = 0.0, False

        async def ticker() -> None:
            nonlocal worst
            while not stop:
                t = time.perf_counter()
                await asyncio.sleep(0.002)
                worst = max(worst, time.perf_counter() - t - 0.002)
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        error = None
        try:
            await _request(body).json()
        except Exception as e:  # noqa: BLE001
            error = e
        took = time.perf_counter() - t0
        stop = True
        await task
        return worst, took, error
    worst, took, error = asyncio.run(run())
    assert error is not None and "262144 JSON values" in str(getattr(error, "detail", error)), error
    assert took > 0.1 and worst < took / 4, (worst, took)


class _Body(BaseModel):
    stop: list[str]


def _app() -> FastAPI:
    app = FastAPI()
    app.router.route_class = OffLoopJSONRoute

    @app.post("/count")
    async def count(body: _Body) -> dict:
        return {"n": len(body.stop)}
    return app


def test_the_route_validates_a_large_body_and_refuses_one_over_the_bound():
    async def run() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://t") as c:
            large = await c.post("/count", json={"stop": ["x" * 100] * 5000})          # ~0.5 MB: the stepped path
            over = await c.post("/count", json={"stop": ["s"] * 300_000})
            invalid = await c.post("/count", content=b'{"stop": [' + b'"a",' * 100_000 + b']}',
                                   headers={"content-type": "application/json"})
            return large, over, invalid
    large, over, invalid = asyncio.run(run())
    assert large.status_code == 200 and large.json() == {"n": 5000}
    assert over.status_code == 400 and "262144 JSON values" in over.text
    assert invalid.status_code == 422 and "json_invalid" in invalid.text       # FastAPI's own answer (no handlers here)
