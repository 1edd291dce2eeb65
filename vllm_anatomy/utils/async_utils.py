"""merge_async_iterators: several async generators read as one stream of (index, item).

Mirrors vllm/utils/async_utils.py (merge_async_iterators), which the
completions server uses for a list of prompts: one engine request per
prompt, their outputs interleaved as they come.

NOTE: closing the merged generator (a client that went away) closes every
input generator, so each prompt's request is aborted in the engine and its
KV blocks freed: the same guarantee a single request's stream has.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def merge_async_iterators(*iterators: AsyncGenerator[T, None]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield (i, item) for each item of iterators[i], in the order they arrive."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    loop = asyncio.get_running_loop()
    pending: dict[asyncio.Task, tuple[int, AsyncGenerator[T, None]]] = {
        loop.create_task(_anext(it)): (i, it) for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i, it = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue                     # this one is exhausted
                pending[loop.create_task(_anext(it))] = (i, it)
                yield i, item
    finally:
        # NOTE: a task still waiting on a generator is cancelled first (a
        # generator that is running cannot be closed), then each is closed.
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                await task
        for it in iterators:
            with contextlib.suppress(Exception):
                await it.aclose()


async def _anext(it: AsyncIterator[T]) -> T:
    return await it.__anext__()
