"""The multi-process engine clients: EngineCoreProc in a child process, reached over ZMQ.

Mirrors vllm/v1/engine/core_client.py (MPClient, SyncMPClient, AsyncMPClient,
BackgroundResources); vLLM keeps them in one file with the in-process clients,
we split it for reading (the interface and InprocClient are core_client.py).

The multi-process clients bind two ZMQ sockets on `ipc://` paths inside a fresh
private directory (mode 0o700, socket files 0o600: only this user can connect):
a ROUTER for inputs (ADD / ABORT / UTILITY, see serial_utils.py) and a PULL for
outputs. The engine process is started with multiprocessing "spawn" (a fresh
interpreter: no forked torch / thread state) and handshakes with its ready
message on the input socket.

NOTE: engine death is detected two ways, so no caller ever waits forever:
the engine says why it is exiting (ENGINE_CORE_DEAD message), and a monitor
thread waits on the process sentinel (this also catches SIGKILL / OOM kills).
Either way every pending and future call raises EngineDeadError.

The client's process owns everything of the run that outlives a process: the
socket directory (the engine's executor puts its sockets there too, and names
its shared-memory segments after it) and the engine process itself. So when
the engine dies, even by SIGKILL, this side reaps it (no zombie), unlinks the
segments it left in /dev/shm and, at shutdown, removes the directory.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from vllm_anatomy.config import VllmConfig
from vllm_anatomy.engine.core_client import EngineCoreClient, cancel_task_threadsafe
from vllm_anatomy.engine.core_proc import EngineCoreProc
from vllm_anatomy.engine.exceptions import EngineDeadError
from vllm_anatomy.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from vllm_anatomy.engine.serial_utils import (EngineCoreOutputType, EngineCoreReadyResponse,
                                              EngineCoreRequestType, MsgpackDecoder, MsgpackEncoder,
                                              UtilityOutput, UtilityRequest)
from vllm_anatomy.executor.abstract import Executor
from vllm_anatomy.executor.shm_broadcast import unlink_shm_segments
from vllm_anatomy.tracing.recorder import NullRecorder, Recorder
from vllm_anatomy.utils.shutdown import shutdown

logger = logging.getLogger(__name__)

# How long to wait for the engine's ready message (model loading included).
VLLM_ENGINE_READY_TIMEOUT_S = float(os.environ.get("VLLM_ENGINE_READY_TIMEOUT_S", "600"))
# How long shutdown waits for the engine to exit after SIGTERM before SIGKILL
# (vLLM: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS / the process manager's 5 s).
ENGINE_SHUTDOWN_GRACE_S = 5.0


@dataclass
class BackgroundResources:
    """Everything a multi-process client must release; called once at shutdown / exit."""
    ipc_dir: str
    ctx: zmq.Context | None = None
    sockets: tuple = ()
    engine_proc: multiprocessing.process.BaseProcess | None = None
    output_thread: threading.Thread | None = None
    output_task: asyncio.Task | None = None
    engine_dead: bool = False
    dead_reason: str | None = None
    shutting_down: bool = False
    shutdown_grace_s: float = ENGINE_SHUTDOWN_GRACE_S

    def __call__(self) -> None:
        self.shutting_down = True
        self.stop_engine(self.shutdown_grace_s)
        cancel_task_threadsafe(self.output_task)
        if self.output_thread is not None and self.output_thread is not threading.current_thread():
            self.output_thread.join(1.0)
        for socket in self.sockets:
            socket.close(linger=0)
        if self.ctx is not None:
            self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def stop_engine(self, timeout: float) -> None:
        """SIGTERM the engine, wait up to `timeout` s, then SIGKILL (at once if
        timeout is 0); reap it; unlink its segments.

        NOTE: (vLLM's process manager `shutdown(procs, timeout)`) EngineCoreProc
        exits at once on SIGTERM and stops its workers (death pipes); the kill
        is for an engine stuck in a step. Its workers, if it was killed, see
        their death pipe close and exit on their own.
        """
        if self.engine_proc is not None:
            shutdown([self.engine_proc], terminate_wait_s=timeout)
        self.reap_engine()

    def reap_engine(self) -> None:
        """Wait for the (ended or ending) engine process, then unlink what it could not.

        NOTE: join() reaps: a dead child stays a zombie until its parent waits
        for it. A killed engine never unlinked its shared memory; the segments
        are named after our ipc_dir, so they are found here.
        """
        if self.engine_proc is not None:
            self.engine_proc.join()
        unlink_shm_segments(self.ipc_dir)


class MPClient(EngineCoreClient):
    """Starts EngineCoreProc in a child process and owns the two sockets."""

    def __init__(self, asyncio_mode: bool, vllm_config: VllmConfig,
                 executor_class: type[Executor] | None = None, run_path: str | None = None,
                 recorder: Recorder | None = None) -> None:
        self.vllm_config = vllm_config
        self.run_path = run_path
        # This (frontend) process' recorder: the ZMQ hops get a span each, with their size.
        self.recorder = recorder or NullRecorder()
        self.encoder = MsgpackEncoder()
        self.outputs_decoder = MsgpackDecoder(EngineCoreOutputs)
        self.utility_decoder = MsgpackDecoder(UtilityOutput)
        self.call_ids = itertools.count()
        # NOTE: mkdtemp creates the directory with mode 0o700 (owner only).
        self.resources = BackgroundResources(ipc_dir=tempfile.mkdtemp(prefix="vllm_anatomy_"))
        self._finalizer = weakref.finalize(self, self.resources)
        try:
            self._start(asyncio_mode, vllm_config, executor_class)
        except BaseException:
            self._finalizer()
            raise

    def _start(self, asyncio_mode: bool, vllm_config: VllmConfig, executor_class) -> None:
        res = self.resources
        input_path = f"ipc://{res.ipc_dir}/input.sock"
        output_path = f"ipc://{res.ipc_dir}/output.sock"
        res.ctx = zmq.Context()
        self.input_socket = res.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)           # never drop a request
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone engine is an error
        self.input_socket.bind(input_path)
        out_ctx = zmq.asyncio.Context.shadow(res.ctx) if asyncio_mode else res.ctx
        # (a zmq.Socket, or a zmq.asyncio.Socket whose recv returns an awaitable)
        self.output_socket: Any = out_ctx.socket(zmq.PULL)
        self.output_socket.bind(output_path)
        res.sockets = (self.input_socket, self.output_socket)
        for path in (input_path, output_path):
            os.chmod(path.removeprefix("ipc://"), 0o600)
        proc = multiprocessing.get_context("spawn").Process(
            target=EngineCoreProc.run_engine_core, name="EngineCore_0",
            kwargs=dict(vllm_config=vllm_config, input_path=input_path, output_path=output_path,
                        engine_index=0, executor_class=executor_class, run_path=self.run_path,
                        ipc_dir=res.ipc_dir))
        proc.start()
        res.engine_proc = proc
        self.ready = self._wait_for_engine_startup(proc)
        # NOTE: as vLLM's wait_for_engine_startup: the engine process sized the KV cache;
        # this process' copy of the config learns the number of blocks from its ready message.
        vllm_config.cache_config.num_gpu_blocks = self.ready.num_gpu_blocks

    def _wait_for_engine_startup(self, proc) -> EngineCoreReadyResponse:
        deadline = time.monotonic() + VLLM_ENGINE_READY_TIMEOUT_S
        while not self.input_socket.poll(100):
            if not proc.is_alive():
                raise RuntimeError(f"Engine core initialization failed (exit code {proc.exitcode}). "
                                   "See the root cause above.")
            if time.monotonic() > deadline:
                raise TimeoutError(f"EngineCore not ready after {VLLM_ENGINE_READY_TIMEOUT_S:.0f} s "
                                   "(VLLM_ENGINE_READY_TIMEOUT_S).")
        # NOTE: ROUTER prefixes each message with the sender's identity; replies
        # to the engine are addressed with it.
        self.engine_identity, payload = self.input_socket.recv_multipart()
        return MsgpackDecoder(EngineCoreReadyResponse).decode(payload)

    def _start_engine_monitor(self, on_dead: Callable[[EngineDeadError], None]) -> None:
        res = self.resources
        proc = res.engine_proc
        assert proc is not None          # started by __init__ before the monitor

        def monitor_engine_cores() -> None:
            multiprocessing.connection.wait([proc.sentinel])
            if res.shutting_down:
                return   # our own shutdown reaps and cleans up
            res.reap_engine()
            if res.engine_dead:
                return   # the engine already said why it died
            res.engine_dead = True
            res.dead_reason = f"EngineCore process died unexpectedly (exit code {proc.exitcode})."
            logger.error(res.dead_reason)
            on_dead(EngineDeadError(res.dead_reason))

        threading.Thread(target=monitor_engine_cores, daemon=True, name="EngineCoreMonitor").start()

    @property
    def engine_dead(self) -> bool:
        return self.resources.engine_dead

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(self.resources.dead_reason or "EngineCore is dead.")

    def _send_input(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if self.resources.engine_dead:
            raise self.dead_error()
        msg = (self.engine_identity, request_type.value, self.encoder.encode(payload))
        attrs: dict[str, Any] = {
            "vllm_anatomy.hop": "zmq", "vllm_anatomy.message_type": request_type.name,
            "vllm_anatomy.message_bytes": len(msg[2]),
            "vllm_anatomy.request_id": getattr(payload, "request_id", None) or ""}
        # (a span in its caller's trace, the request's; none for a call no trace is open for)
        with self.recorder.span("MPClient._send_input", **attrs) if self.recorder.has_current_span() \
                else contextlib.nullcontext():
            try:
                self.input_socket.send_multipart(msg)
            except zmq.ZMQError as e:   # EHOSTUNREACH: the engine's socket is gone
                raise EngineDeadError(f"Cannot reach EngineCore: {e}") from e

    def _decode_output(self, frames: list[bytes], put_outputs: Callable[[Any], None],
                       resolve_utility: Callable[[UtilityOutput], None]) -> bool:
        """Route one message from the output socket; False once the engine is dead."""
        kind_frame, payload = frames
        kind = EngineCoreOutputType(kind_frame)
        if kind == EngineCoreOutputType.OUTPUTS:
            t0 = self.recorder.now_ns()
            outputs = self.outputs_decoder.decode(payload)
            if outputs.trace_headers:
                # In the trace of the step that made them, following the engine's send; the
                # outputs then name this span to whoever processes them.
                attrs: dict[str, Any] = {"vllm_anatomy.hop": "zmq", "vllm_anatomy.message_type": kind.name,
                                         "vllm_anatomy.message_bytes": len(payload),
                                         "vllm_anatomy.num_outputs": len(outputs.outputs)}
                span = self.recorder.record_span("MPClient._decode_output", t0, self.recorder.now_ns(),
                                                 follows_from=outputs.trace_headers, **attrs)
                outputs.trace_headers = span.trace_headers() or None
            put_outputs(outputs)
        elif kind == EngineCoreOutputType.UTILITY:
            resolve_utility(self.utility_decoder.decode(payload))
        else:
            self.resources.dead_reason = f"EngineCore died: {msgspec.msgpack.decode(payload)}"
            self.resources.engine_dead = True
            return False
        return True

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine (SIGTERM, then SIGKILL after `timeout` s, default
        ENGINE_SHUTDOWN_GRACE_S), close the sockets, remove the socket directory."""
        if timeout is not None:
            self.resources.shutdown_grace_s = timeout
        self._finalizer()


def _utility_result(output: UtilityOutput) -> tuple[Any, Exception | None]:
    if output.failure_message is not None:
        return None, RuntimeError(output.failure_message)
    return output.result, None


class SyncMPClient(MPClient):
    """Blocking client: a thread decodes the output socket into a queue.Queue."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor] | None = None,
                 run_path: str | None = None, recorder: Recorder | None = None) -> None:
        super().__init__(False, vllm_config, executor_class, run_path, recorder)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self.utility_results: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.resources.output_thread = threading.Thread(
            target=self.process_outputs_socket, daemon=True, name="EngineCoreOutputQueueThread")
        self.resources.output_thread.start()
        self._start_engine_monitor(self._fail_all)

    def process_outputs_socket(self) -> None:
        res = self.resources
        while not res.shutting_down:
            if not self.output_socket.poll(100):
                continue
            if not self._decode_output(self.output_socket.recv_multipart(),
                                       self.outputs_queue.put_nowait, self._resolve_utility):
                self._fail_all(self.dead_error())
                return

    def _resolve_utility(self, output: UtilityOutput) -> None:
        with self._lock:
            future = self.utility_results.pop(output.call_id, None)
        if future is not None:
            result, error = _utility_result(output)
            future.set_exception(error) if error else future.set_result(result)

    def _fail_all(self, error: EngineDeadError) -> None:
        self.outputs_queue.put_nowait(error)
        with self._lock:
            futures, self.utility_results = self.utility_results, {}
        for future in futures.values():
            future.set_exception(error)

    def get_output(self) -> EngineCoreOutputs:
        if self.engine_dead and self.outputs_queue.empty():
            raise self.dead_error()
        outputs = self.outputs_queue.get()
        if isinstance(outputs, Exception):
            self.outputs_queue.put_nowait(outputs)   # later callers get it too
            raise outputs
        return outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_input(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send_input(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self.call_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:   # register first: a death from now on fails this future
            self.utility_results[call_id] = future
        try:
            self._send_input(EngineCoreRequestType.UTILITY, UtilityRequest(0, call_id, method, list(args)))
        except BaseException:
            with self._lock:
                self.utility_results.pop(call_id, None)
            raise
        return future.result()

    def get_scheduler_stats(self) -> SchedulerStats:
        return msgspec.convert(self.call_utility("get_scheduler_stats"), SchedulerStats)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.call_utility("reset_prefix_cache", reset_running_requests, reset_connector)


class AsyncMPClient(MPClient):
    """asyncio client: a task decodes the output socket into an asyncio.Queue.

    The task (and the event loop it belongs to) is set up on first use, so the
    client may be built before the loop runs.
    """

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor] | None = None,
                 run_path: str | None = None, recorder: Recorder | None = None) -> None:
        super().__init__(True, vllm_config, executor_class, run_path, recorder)
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] = asyncio.Queue()
        self.utility_results: dict[int, asyncio.Future] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._start_engine_monitor(self._fail_all_threadsafe)

    def _ensure_output_queue_task(self) -> None:
        if self.resources.output_task is None:
            self.loop = asyncio.get_running_loop()
            self.resources.output_task = self.loop.create_task(
                self.process_outputs_socket(), name="EngineCoreOutputQueueTask")

    async def process_outputs_socket(self) -> None:
        while True:
            frames = await self.output_socket.recv_multipart()
            if not self._decode_output(frames, self.outputs_queue.put_nowait, self._resolve_utility):
                self._fail_all(self.dead_error())
                return

    def _resolve_utility(self, output: UtilityOutput) -> None:
        future = self.utility_results.pop(output.call_id, None)
        if future is not None and not future.done():
            result, error = _utility_result(output)
            future.set_exception(error) if error else future.set_result(result)

    def _fail_all(self, error: EngineDeadError) -> None:
        self.outputs_queue.put_nowait(error)
        futures, self.utility_results = self.utility_results, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(error)

    def _fail_all_threadsafe(self, error: EngineDeadError) -> None:
        # Called by the monitor thread: hop onto the event loop (if it ever ran).
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fail_all, error)
            except RuntimeError:   # the loop closed meanwhile
                pass

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_output_queue_task()
        if self.engine_dead and self.outputs_queue.empty():
            raise self.dead_error()
        outputs = await self.outputs_queue.get()
        if isinstance(outputs, Exception):
            self.outputs_queue.put_nowait(outputs)
            raise outputs
        return outputs

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_output_queue_task()
        self._send_input(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send_input(EngineCoreRequestType.ABORT, list(request_ids))

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_output_queue_task()
        call_id = next(self.call_ids)
        assert self.loop is not None     # set by _ensure_output_queue_task
        future = self.loop.create_future()
        self.utility_results[call_id] = future
        try:
            self._send_input(EngineCoreRequestType.UTILITY, UtilityRequest(0, call_id, method, list(args)))
        except BaseException:
            self.utility_results.pop(call_id, None)
            raise
        return await future

    async def get_scheduler_stats_async(self) -> SchedulerStats:
        return msgspec.convert(await self.call_utility_async("get_scheduler_stats"), SchedulerStats)

    async def reset_prefix_cache_async(self, reset_running_requests: bool = False,
                                       reset_connector: bool = False) -> bool:
        return await self.call_utility_async("reset_prefix_cache", reset_running_requests, reset_connector)
