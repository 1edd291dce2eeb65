"""EngineCoreProc: EngineCore in its own process, behind two ZMQ sockets.

Mirrors vllm/v1/engine/core.py (`EngineCoreProc`, its `run_engine_core`
entry point, `run_busy_loop`, `process_input_sockets` and
`process_output_sockets`); vLLM keeps it in the same file as `EngineCore`,
here it has its own so that engine/core.py holds only the step.

    client ROUTER --ipc--> DEALER [input thread]  decode, Request + block hashes
                                    |  input_queue
                              [busy loop, main thread]  add/abort/utility, step()
                                    |  output_queue
    client PULL  <--ipc--  PUSH  [output thread]  encode, send

The client side (SyncMPClient, AsyncMPClient) is engine/core_client_mp.py.
"""
from __future__ import annotations

import enum
import faulthandler
import functools
import logging
import os
import queue
import shutil
import signal
import socket
import threading
import time
from typing import Any, Callable

import msgspec
import zmq

from vllm_anatomy import envs
from vllm_anatomy.config import VllmConfig
from vllm_anatomy.engine.core import EngineCore
from vllm_anatomy.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from vllm_anatomy.engine.serial_utils import (EngineCoreOutputType, EngineCoreReadyResponse,
                                              EngineCoreRequestType, MsgpackDecoder, MsgpackEncoder,
                                              UtilityOutput, UtilityRequest)
from vllm_anatomy.executor.abstract import Executor
from vllm_anatomy.executor.shm_broadcast import unlink_shm_segments
from vllm_anatomy.tracing.factory import make_recorder
from vllm_anatomy.tracing.recorder import Recorder

logger = logging.getLogger(__name__)

# Internal input-queue markers (never on the wire).
_SHUTDOWN = "SHUTDOWN"                       # the parent process is gone
_INPUT_THREAD_FAILED = "INPUT_THREAD_FAILED"
# vLLM: EngineCoreRequestType.EXECUTOR_FAILED, put by the executor's failure callback.
_EXECUTOR_FAILED = "EXECUTOR_FAILED"
# vLLM: EngineCoreRequestType.WAKEUP: wakes an idle busy loop (here: to see a shutdown request).
_WAKEUP = "WAKEUP"
# How often the input thread wakes up to check for shutdown / a dead parent.
_POLL_TIMEOUT_MS = 200


class EngineShutdownState(enum.Enum):
    """vLLM's v1/engine EngineShutdownState: where the busy loop is in leaving."""
    RUNNING = enum.auto()
    REQUESTED = enum.auto()        # SIGTERM came; seen at the busy loop's next turn
    SHUTTING_DOWN = enum.auto()    # requests aborted; the steps in flight finish, then it exits


def _watch_sigterm(on_sigterm: Callable[[], Any]) -> None:
    """Call `on_sigterm` on a thread of its own each time SIGTERM arrives.

    NOTE: a Python signal handler runs on the main thread, and only once that
    thread runs Python code again: the kernel may hand the signal to any other
    thread (ZMQ's, the tracer's, torch's), and an idle busy loop blocked in
    input_queue.get() then never wakes to run it (seen here, with the handler
    alone: an idle engine slept through SIGTERM until the SIGKILL). Python also writes the number of every signal that has
    a Python handler to the wakeup fd, from whichever thread took it; this
    thread reads it there. (vLLM wakes its busy loop from a SignalCallback thread.)
    Call from the main thread, after installing a Python handler for SIGTERM.
    """
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        # (the thread holds `writer`: collected, it would close the fd Python writes to)
        while writer.fileno() >= 0 and (data := reader.recv(64)):
            if signal.SIGTERM in data:
                on_sigterm()

    threading.Thread(target=watch, name="EngineCoreSignalWatcher", daemon=True).start()


def _remove_orphaned_ipc_dir(ipc_dir: str | None) -> None:
    """The frontend died (SIGKILL) and cannot remove its socket directory: do it for it.

    NOTE: normally the frontend owns the directory (it outlives this process
    and removes it even if this one is killed); once it is gone, this process,
    the last user of the directory, is the only one left to remove it."""
    if ipc_dir:
        unlink_shm_segments(ipc_dir)
        shutil.rmtree(ipc_dir, ignore_errors=True)


class EngineCoreProc(EngineCore):
    """EngineCore in its own process: an input thread, the busy loop, an output thread.

        client ROUTER --ipc--> DEALER [input thread]  decode, Request + block hashes
                                        |  input_queue
                                  [busy loop, main thread]  add/abort/utility, step()
                                        |  output_queue
        client PULL  <--ipc--  PUSH  [output thread]  encode, send

    NOTE: the threads only move bytes and build Requests; all scheduler state
    is touched by the main thread alone, so the core needs no locks. ZMQ and
    msgpack release the GIL, so I/O overlaps the step.

    Simplified: one frontend per engine (vLLM has one PUSH socket per client
    index), no data-parallel coordinator, no eager aborts queue (an abort
    waits for the step in progress; its in-flight output is then skipped).

    Lifecycle: the frontend owns it. SIGTERM asks the busy loop to stop (vLLM's
    shutdown_timeout=0 "abort" mode: the frontend has already drained or
    failed the requests it cares about): at its next turn it aborts every
    request, finishes the steps in flight and returns; SIGINT is ignored, since a terminal's
    Ctrl-C reaches the whole process group and the frontend decides. A worker
    that dies, even while the engine is idle, wakes the busy loop through the
    executor's failure callback, and the engine exits with ENGINE_CORE_DEAD.
    """

    # NOTE: only these methods may be called through a UTILITY message; the
    # socket is owner-only, but the callable surface stays explicit.
    UTILITY_METHODS = frozenset({"get_scheduler_stats", "reset_prefix_cache",
                                 "get_num_unfinished_requests"})

    def __init__(self, vllm_config: VllmConfig, input_path: str, output_path: str,
                 engine_index: int = 0, recorder: Recorder | None = None,
                 executor_class: type[Executor] | None = None, ipc_dir: str | None = None) -> None:
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[EngineCoreOutputType, Any] | None] = queue.Queue()
        # NOTE: the executor's sockets and shared memory go under the frontend's
        # ipc_dir: if this process is SIGKILLed, the frontend still removes them.
        make_executor = functools.partial(executor_class or Executor.get_class(vllm_config), ipc_dir=ipc_dir)
        super().__init__(vllm_config, recorder, make_executor)
        # vLLM passes executor_fail_callback to EngineCore.__init__; same effect.
        self.model_executor.register_failure_callback(self._executor_failed)
        self.engine_index = engine_index
        self._parent_pid = os.getppid()
        self._shutdown_event = threading.Event()
        self.shutdown_state = EngineShutdownState.RUNNING
        self.ctx = zmq.Context()
        cfg = vllm_config
        assert cfg.cache_config.num_gpu_blocks is not None      # sized by EngineCore.__init__
        ready = EngineCoreReadyResponse(engine_index, os.getpid(), cfg.cache_config.num_gpu_blocks,
                                        cfg.cache_config.block_size, cfg.model_config.max_model_len)
        self.output_thread = threading.Thread(target=self.process_output_sockets, args=(output_path,),
                                              name="EngineCoreOutputThread", daemon=True)
        self.input_thread = threading.Thread(target=self.process_input_sockets, args=(input_path, ready),
                                             name="EngineCoreInputThread", daemon=True)
        self.output_thread.start()
        self.input_thread.start()

    # -- process entry point --------------------------------------------------------
    @staticmethod
    def run_engine_core(*args, **kwargs) -> None:
        """Target of the spawned process: build the core, loop until told to stop."""
        logging.basicConfig(level=os.environ.get("VLLM_ANATOMY_LOG_LEVEL", "WARNING"))
        shutdown_requested = False
        engine_core: EngineCoreProc | None = None

        def signal_handler(signum, frame):
            nonlocal shutdown_requested
            if engine_core is not None:
                # NOTE: the busy loop runs: _watch_sigterm's thread asks it to stop
                # at its next turn, between steps. An exception raised here could
                # land anywhere in a step (half a span tree exported, its
                # EngineCore.step root never ended).
                return
            # NOTE: still starting: SystemExit unwinds the start-up into the
            # finally below; only raise it once.
            if not shutdown_requested:
                shutdown_requested = True
                raise SystemExit()

        signal.signal(signal.SIGTERM, signal_handler)

        def on_sigterm() -> None:      # (on _watch_sigterm's thread)
            if engine_core is not None:
                engine_core.request_shutdown()

        _watch_sigterm(on_sigterm)
        # NOTE: Ctrl-C reaches every process of the terminal's group; only the
        # frontend acts on it (drain, then SIGTERM here). Workers inherit this.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        parent_pid = os.getppid()
        # This process' own recorder, attached to the frontend's run store.
        recorder = make_recorder(kwargs["vllm_config"], "engine_core", run_path=kwargs.pop("run_path", None),
                                 process_name="EngineCore_0")
        try:
            kwargs["recorder"] = recorder
            engine_core = EngineCoreProc(*args, **kwargs)
            engine_core.run_busy_loop()
        except SystemExit:
            logger.debug("EngineCore exiting.")
        except BaseException as e:
            if engine_core is None:
                logger.exception("EngineCore failed to start.")
            else:
                logger.exception("EngineCore encountered a fatal error.")
                engine_core._send_engine_dead(e)
                # NOTE: the frontend already knows (ENGINE_CORE_DEAD): a dead engine
                # must not linger, whatever its shutdown or the interpreter's exit
                # waits on. Past this timeout, faulthandler writes every thread's
                # stack to stderr (the place to look) and the process exits with 1.
                faulthandler.dump_traceback_later(envs.VLLM_ANATOMY_DEAD_ENGINE_EXIT_TIMEOUT_S, exit=True)
            raise
        finally:
            if engine_core is not None:
                engine_core.shutdown()
            recorder.shutdown()          # flush this process' spans into the store
            if os.getppid() != parent_pid:
                _remove_orphaned_ipc_dir(kwargs.get("ipc_dir"))

    # -- the busy loop (main thread) --------------------------------------------------
    def run_busy_loop(self) -> None:
        """Core busy loop: take in requests, step, hand outputs to the output thread;
        return once a shutdown was requested and the steps in flight are done."""
        while self._handle_shutdown():
            self._process_input_queue()
            self._process_engine_step()

    def request_shutdown(self) -> None:
        """Ask the busy loop to stop after the step in progress (from any thread but
        a signal handler: it puts on input_queue, whose lock the main thread may hold)."""
        if self.shutdown_state == EngineShutdownState.RUNNING:
            self.shutdown_state = EngineShutdownState.REQUESTED
        self.input_queue.put_nowait((_WAKEUP, None))       # (an idle loop waits on the queue)

    def _handle_shutdown(self) -> bool:
        """False once the loop may end (vLLM's abort mode, shutdown_timeout 0).

        NOTE: checked between steps only, so a step is either complete or never
        started: every request is aborted, then the loop runs until no work is
        left (the step that tells the workers, the async steps already launched),
        each step ending, and its trace with it, as usual."""
        if self.shutdown_state == EngineShutdownState.RUNNING:
            return True
        if self.shutdown_state == EngineShutdownState.REQUESTED:
            self.abort_requests(list(self.scheduler.requests))
            self.shutdown_state = EngineShutdownState.SHUTTING_DOWN
        return self.has_work()

    def _process_input_queue(self) -> None:
        # NOTE: with nothing to do, block on the queue: an idle engine uses no CPU.
        while not self.has_work() and self.shutdown_state == EngineShutdownState.RUNNING:
            self._handle_client_request(*self.input_queue.get())
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        outputs, model_executed = self.step_fn()
        # NOTE: one frontend, so every client index's outputs go to the same socket.
        for engine_core_outputs in outputs.values():
            engine_core_outputs.engine_index = self.engine_index
            self.output_queue.put_nowait((EngineCoreOutputType.OUTPUTS, engine_core_outputs))
        if not model_executed and self.scheduler.has_requests():
            time.sleep(0.001)   # requests wait for blocks: don't spin at 100 % CPU

    def _handle_client_request(self, request_type: Any, request: Any) -> None:
        if request_type == _WAKEUP:
            return
        if request_type == EngineCoreRequestType.ADD:
            if self.shutdown_state != EngineShutdownState.RUNNING:
                # (vLLM's _reject_add_in_shutdown; the frontend that sent it is stopping)
                logger.debug("Shutting down: request %s not added.", request.request_id)
                return
            try:
                self.add_request(request)
            except ValueError as e:   # e.g. a duplicate id: refuse it, keep serving
                logger.warning("Refused request %s: %s", request.request_id, e)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(request)
        elif request_type == EngineCoreRequestType.UTILITY:
            self.output_queue.put_nowait((EngineCoreOutputType.UTILITY, self._call_utility(request)))
        elif request_type == _SHUTDOWN:      # the parent process exited: nobody to serve
            self.request_shutdown()
        elif request_type == _INPUT_THREAD_FAILED:
            raise RuntimeError("EngineCore input thread failed") from request
        elif request_type == _EXECUTOR_FAILED:
            # NOTE: raised here, the busy loop ends as for any fatal error:
            # run_engine_core sends ENGINE_CORE_DEAD (with this reason), so
            # the frontend learns of a worker's death even while idle.
            raise RuntimeError(getattr(self.model_executor, "failure_message", None) or "Executor failed.")

    def _executor_failed(self) -> None:
        """The executor's failure callback (runs on its monitor thread): wake the busy loop."""
        self.input_queue.put_nowait((_EXECUTOR_FAILED, None))

    def _call_utility(self, request: UtilityRequest) -> UtilityOutput:
        method = request.method_name
        try:
            if method not in self.UTILITY_METHODS:
                raise ValueError(f"unknown utility method {method!r}; "
                                 f"allowed: {', '.join(sorted(self.UTILITY_METHODS))}")
            result = getattr(self, method)(*request.args)
            return UtilityOutput(request.call_id, result=msgspec.to_builtins(result))
        except Exception as e:   # a failed call is the caller's error, not the engine's
            return UtilityOutput(request.call_id, failure_message=f"Call to {method} failed: {e!r}")

    def _send_engine_dead(self, error: BaseException) -> None:
        """Tell the frontend why we are exiting, and give the message time to leave."""
        self.output_queue.put_nowait((EngineCoreOutputType.ENGINE_CORE_DEAD,
                                      f"{type(error).__name__}: {error}"))
        self.output_thread.join(timeout=5.0)

    # -- the I/O threads ------------------------------------------------------------
    def process_input_sockets(self, input_path: str, ready: EngineCoreReadyResponse) -> None:
        """Input thread: receive, decode and preprocess requests into input_queue."""
        decoders = {EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                    EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
                    EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest)}
        try:
            with self.ctx.socket(zmq.DEALER) as socket:
                socket.setsockopt(zmq.LINGER, 0)
                socket.connect(input_path)
                # NOTE: the first message registers this DEALER with the client's
                # ROUTER and is the startup handshake (vLLM sends its ready response).
                socket.send(MsgpackEncoder().encode(ready))
                while not self._shutdown_event.is_set():
                    if not socket.poll(_POLL_TIMEOUT_MS):
                        if os.getppid() != self._parent_pid:   # orphaned: nobody to serve
                            self.input_queue.put_nowait((_SHUTDOWN, None))
                            return
                        continue
                    self._decode_into_queue(socket.recv_multipart(), decoders)
        except Exception as e:
            logger.exception("EngineCore input thread failed.")
            self.input_queue.put_nowait((_INPUT_THREAD_FAILED, e))

    def _decode_into_queue(self, frames: list[bytes], decoders: dict) -> None:
        # NOTE: a malformed message is logged and dropped: it must not kill the engine.
        t0 = self.recorder.now_ns()
        try:
            type_frame, payload = frames
            request_type = EngineCoreRequestType(type_frame)
            request = decoders[request_type].decode(payload)
        except (ValueError, msgspec.DecodeError) as e:
            logger.error("Dropped a malformed message (%d frames): %s", len(frames), e)
            self._refuse_undecodable_add(frames, e)
            return
        # The ZMQ hop's engine side (input thread): a span per message, with its size, in the
        # trace of the request it carries (a follower: nothing in the frontend waits for it).
        cause = self._hop_cause(request_type, request)
        if cause is not None:
            attrs: dict[str, Any] = {
                "vllm_anatomy.hop": "zmq", "vllm_anatomy.thread": "input",
                "vllm_anatomy.message_type": request_type.name, "vllm_anatomy.message_bytes": len(payload),
                "vllm_anatomy.request_id": getattr(request, "request_id", None) or ""}
            self.recorder.record_span("EngineCoreProc.process_input_sockets", t0, self.recorder.now_ns(),
                                      follows_from=cause, **attrs)
        if request_type == EngineCoreRequestType.ADD:
            try:
                request = self.preprocess_add_request(request)
            except Exception as e:
                # NOTE: finish it as an error, so the frontend does not wait forever.
                logger.error("Request %s failed preprocessing: %r", request.request_id, e)
                self.output_queue.put_nowait((EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(
                    engine_index=self.engine_index, finished_requests={request.request_id},
                    outputs=[EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR)],
                    trace_headers=request.trace_headers)))
                return
        self.input_queue.put_nowait((request_type, request))

    def _hop_cause(self, request_type: EngineCoreRequestType, request: Any) -> dict | None:
        """The trace an input message's hop span joins: an ADD's request, an ABORT's first
        request still known here; None (no span) for what belongs to no request (UTILITY).

        NOTE: this thread reads the scheduler's request table without the busy loop's
        lock: one dict look-up, and a Request's trace_headers never change."""
        if not self.recorder.enabled:
            return None
        if request_type == EngineCoreRequestType.ADD:
            return request.trace_headers
        if request_type == EngineCoreRequestType.ABORT:
            scheduler = getattr(self, "scheduler", None)
            requests = scheduler.requests if scheduler is not None else {}
            for req_id in request:
                found = requests.get(req_id)
                if found is not None and found.trace_headers:
                    return found.trace_headers
        return None

    def _refuse_undecodable_add(self, frames: list[bytes], error: Exception) -> None:
        """An ADD whose payload does not decode (e.g. sampling params the engine's
        own checks reject): if its request id can be read, finish it with an
        error, so its caller is answered instead of waiting forever.

        NOTE: EngineCoreRequest is array_like: on the wire it is a msgpack
        array whose first item is the request id, readable without the schema.
        """
        if len(frames) != 2 or frames[0] != EngineCoreRequestType.ADD.value:
            return
        try:
            request_id = msgspec.msgpack.decode(frames[1])[0]
        except Exception:
            return
        if not isinstance(request_id, str):
            return
        logger.error("Request %s could not be decoded: finished with an error: %s", request_id, error)
        self.output_queue.put_nowait((EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(
            engine_index=self.engine_index, finished_requests={request_id},
            outputs=[EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR)])))

    def process_output_sockets(self, output_path: str) -> None:
        """Output thread: encode and send what the busy loop put on output_queue."""
        encoder = MsgpackEncoder()
        with self.ctx.socket(zmq.PUSH) as socket:
            # NOTE: on close, wait up to 1 s for unsent messages (the last outputs,
            # the engine-dead reason); forever would hang if the frontend is gone.
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(output_path)
            while (item := self.output_queue.get()) is not None:
                output_type, payload = item
                # The ZMQ hop's engine side (output thread): a span per message, with its size, in
                # the trace of the step that made the outputs (a follower: the step is over), and
                # the outputs name it to the frontend's next hop (EngineCoreOutputs.trace_headers).
                cause = getattr(payload, "trace_headers", None)
                attrs: dict[str, Any] = {"vllm_anatomy.hop": "zmq", "vllm_anatomy.thread": "output",
                                         "vllm_anatomy.message_type": output_type.name}
                span = self.recorder.start_span("EngineCoreProc.process_output_sockets", follows_from=cause,
                                                **attrs) if cause else None
                if span is not None:
                    payload.trace_headers = span.trace_headers()
                buf = encoder.encode(payload)
                socket.send_multipart((output_type.value, buf))
                if span is not None:
                    span.set_attribute("vllm_anatomy.message_bytes", len(buf))
                    span.end()
                if output_type == EngineCoreOutputType.ENGINE_CORE_DEAD:
                    return

    def shutdown(self) -> None:
        self._shutdown_event.set()
        self.output_queue.put_nowait(None)
        self.output_thread.join(timeout=2.0)
        self.input_thread.join(timeout=2.0)
        if not (self.output_thread.is_alive() or self.input_thread.is_alive()):
            self.ctx.term()
        super().shutdown()

