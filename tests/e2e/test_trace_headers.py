"""An HTTP `traceparent` reaches the engine as the request's trace_headers.

In-process AsyncLLM (EngineCore on a worker thread of this process) so the test
can look into the scheduler: while the request runs, the engine-side Request
must carry the same W3C trace id the client sent.
"""
from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from vllm_anatomy.engine.arg_utils import EngineArgs
from vllm_anatomy.engine.async_llm import AsyncLLM
from vllm_anatomy.entrypoints.openai.api_server import build_app

pytestmark = [pytest.mark.model]

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def test_traceparent_reaches_engine():
    async def run():
        llm = AsyncLLM.from_engine_args(EngineArgs(max_model_len=256), multiprocess=False)
        try:
            app = build_app(llm, argparse.Namespace(served_model_name=None, model=None, api_key=None))
            scheduler = llm.engine_core.engine_core.scheduler
            seen: dict = {}

            async def watch_scheduler():
                # NOTE: httpx's ASGITransport returns the body only when complete,
                # so the running request is observed from a concurrent task.
                while True:
                    for rid, req in list(scheduler.requests.items()):
                        seen.setdefault(rid, req.trace_headers)
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch_scheduler())
            body = {"prompt": "Count:", "max_tokens": 30, "ignore_eos": True}
            headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1", "X-Request-Id": "traced"}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/completions", json=body, headers=headers)
            watcher.cancel()
            assert r.status_code == 200, r.text
            return seen
        finally:
            llm.shutdown()

    seen = asyncio.run(run())
    # The engine's id is the response id plus a random suffix (InputProcessor.assign_request_id).
    (headers,) = [h for rid, h in seen.items() if rid.startswith("cmpl-traced-")]
    # NOTE: with tracing on, the frontend may replace the parent span id with its own
    # `llm_request` span; the trace id must survive either way.
    assert headers["traceparent"].split("-")[1] == TRACE_ID
