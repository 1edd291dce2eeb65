"""EngineCoreClient: how a frontend (LLMEngine, AsyncLLM) talks to EngineCore.

Mirrors vllm/v1/engine/core_client.py. `EngineCoreClient.make_client` picks:

    InprocClient       EngineCore in this process, plain calls (lessons, tests, notebooks)
    AsyncInprocClient  (ours) the same for asyncio: steps run on one worker thread
    SyncMPClient       EngineCoreProc in a child process; a thread reads its outputs
    AsyncMPClient      EngineCoreProc in a child process; an asyncio task reads its outputs

vLLM keeps all four in one file; we split it for reading: this file holds the
interface and the in-process clients, core_client_mp.py the multi-process ones
(the sockets, the engine process, its death and its shutdown).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable

import msgspec

from vllm_anatomy.config import VllmConfig
from vllm_anatomy.engine.core import EngineCore
from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from vllm_anatomy.executor.abstract import Executor
from vllm_anatomy.tracing.recorder import Recorder


class EngineCoreClient:
    """The interface every client offers (sync and async halves)."""

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, vllm_config: VllmConfig,
                    executor_class: type[Executor] | None = None,
                    recorder: Recorder | None = None) -> "EngineCoreClient":
        # NOTE: a recorder object cannot follow the engine into another process;
        # the child builds its own from the config and attaches it to the same
        # run store (run_path), so all processes of a run write one file.
        if multiprocess_mode:
            # (imported on first use: the in-process clients need no ZMQ)
            from vllm_anatomy.engine.core_client_mp import AsyncMPClient, SyncMPClient
            mp_cls = AsyncMPClient if asyncio_mode else SyncMPClient
            return mp_cls(vllm_config, executor_class, run_path=getattr(recorder, "run_path", None),
                          recorder=recorder)
        inproc_cls = AsyncInprocClient if asyncio_mode else InprocClient
        return inproc_cls(vllm_config, executor_class, recorder)

    @property
    def engine_dead(self) -> bool:
        """True once the engine failed: every later call raises EngineDeadError."""
        return False

    # The synchronous half (LLMEngine) ...
    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    # ... and the asyncio half (AsyncLLM).
    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_scheduler_stats_async(self) -> SchedulerStats:
        raise NotImplementedError

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        raise NotImplementedError

    async def reset_prefix_cache_async(self, reset_running_requests: bool = False,
                                       reset_connector: bool = False) -> bool:
        raise NotImplementedError

    def has_steps_in_flight(self) -> bool:
        """Steps launched whose outputs the caller must still fetch with get_output().

        NOTE: an engine process drains its own in-flight steps in its busy loop."""
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine; `timeout`: seconds to wait for an engine process before killing it."""


class InprocClient(EngineCoreClient):
    """EngineCore in this process; `get_output()` runs one step (vLLM: InprocClient)."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor] | None = None,
                 recorder: Recorder | None = None) -> None:
        self.engine_core = EngineCore(vllm_config, recorder, executor_class)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step_fn()
        return outputs.get(0) or EngineCoreOutputs()

    def has_steps_in_flight(self) -> bool:
        # NOTE: async scheduling: the batch queue holds launched steps; in this
        # process only more get_output() calls take their outputs.
        return bool(self.engine_core.batch_queue)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        return msgspec.to_builtins(getattr(self.engine_core, method)(*args))

    def get_scheduler_stats(self) -> SchedulerStats:
        return self.engine_core.get_scheduler_stats()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.engine_core.reset_prefix_cache(reset_running_requests, reset_connector)

    def shutdown(self, timeout: float | None = None) -> None:
        self.engine_core.shutdown()


class AsyncInprocClient(InprocClient):
    """asyncio without a child process (ours: vLLM refuses this combination).

    NOTE: every EngineCore call runs on one worker thread, so calls are
    serialized (no locks needed) and a 100 ms step never blocks the event loop.
    """

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor] | None = None,
                 recorder: Recorder | None = None) -> None:
        super().__init__(vllm_config, executor_class, recorder)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="EngineCore")
        self._new_work = asyncio.Event()
        self._dead = False

    @property
    def engine_dead(self) -> bool:
        return self._dead

    async def _run(self, fn: Callable, *args: Any) -> Any:
        if self._dead:
            raise EngineDeadError("EngineCore failed earlier; see the first error.")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except (ValueError, TypeError):
            raise          # the caller's bad argument; the engine is fine
        except Exception as e:
            self._dead = True
            raise EngineDeadError(f"EngineCore failed: {e!r}") from e

    async def get_output_async(self) -> EngineCoreOutputs:
        while True:
            # NOTE: clear, then look: an add landing in between sets the event again.
            self._new_work.clear()
            if self.engine_core.has_work():
                break
            await self._new_work.wait()
        outputs, _ = await self._run(self.engine_core.step_fn)
        return outputs.get(0) or EngineCoreOutputs()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._run(self.engine_core.add_request, request)
        self._new_work.set()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._run(self.engine_core.abort_requests, request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return msgspec.to_builtins(await self._run(getattr(self.engine_core, method), *args))

    async def get_scheduler_stats_async(self) -> SchedulerStats:
        return msgspec.convert(await self.call_utility_async("get_scheduler_stats"), SchedulerStats)

    async def reset_prefix_cache_async(self, reset_running_requests: bool = False,
                                       reset_connector: bool = False) -> bool:
        return await self.call_utility_async("reset_prefix_cache", reset_running_requests, reset_connector)

    def shutdown(self, timeout: float | None = None) -> None:
        self._executor.shutdown(wait=True)
        super().shutdown()


def cancel_task_threadsafe(task: asyncio.Task | None) -> None:
    """Cancel an asyncio task from any thread, whether or not its loop is running."""
    if task is None or task.done() or task.get_loop().is_closed():
        return
    loop = task.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        task.cancel()
    elif loop.is_running():
        loop.call_soon_threadsafe(task.cancel)
    else:
        # NOTE: the loop is idle (e.g. shutdown from synchronous code): let the
        # task see its cancellation now, or it dies "pending" when the loop closes.
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
