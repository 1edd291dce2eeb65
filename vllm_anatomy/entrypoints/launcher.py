"""Serving lifecycle: serve_http runs uvicorn until a signal (then drains) or the
engine's death (vLLM's vllm/entrypoints/launcher.py: serve_http, watchdog_loop,
terminate_if_errored). The behaviour is described in api_server.py's docstring.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import uvicorn

logger = logging.getLogger("vllm_anatomy.api_server")

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
