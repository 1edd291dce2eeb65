"""WorkerProc: the worker process' side of MultiprocExecutor (one process per rank).

Mirrors vllm/v1/executor/multiproc_executor.py (WorkerProc, WorkerProc.worker_main,
WorkerProc.worker_busy_loop); vLLM keeps it in one file with the executor, we
split it for reading (the executor's side is multiproc_executor.py).

    make_worker_process   spawn the process (ready pipe, death pipe)
    worker_main           build the Worker (device, model, its two queues), say READY,
                          run the busy loop; leave through `finally` on SIGTERM or EOF
                          on the death pipe
    worker_busy_loop      dequeue (method, args) from rpc_broadcast_mq, call
                          getattr(worker, method)(*args), enqueue the reply

The messages on the queues (RPCRequest, RPCResponse) and at start-up
(WorkerReady, PeerInfo) are msgspec structs; each argument is decoded with the
type the Worker method's annotation gives it (worker_method_types).
"""
from __future__ import annotations

import functools
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import traceback
import types
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_anatomy.config import ParallelConfig, VllmConfig
from vllm_anatomy.core.outputs import AsyncModelRunnerOutput
from vllm_anatomy.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                     get_world_group)
from vllm_anatomy.engine.serial_utils import dec_hook, enc_hook, ext_hook
from vllm_anatomy.executor.shm_broadcast import Handle, MessageQueue, MessageQueueCancelled
from vllm_anatomy.tracing.factory import make_recorder
from vllm_anatomy.tracing.recorder import NullRecorder
from vllm_anatomy.utils.network_utils import get_ip
from vllm_anatomy.worker.worker import Worker

logger = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 1 << 20      # vLLM: VLLM_MQ_MAX_CHUNK_BYTES_MB = 16 MiB; our messages are small
WORKER_READY_TIMEOUT_S = 600.0


class RPCRequest(msgspec.Struct, array_like=True):
    method: str
    # NOTE: each argument is encoded on its own and decoded lazily (Raw) with
    # the type the worker method declares for it.
    args: list[msgspec.Raw]
    kwargs: dict[str, msgspec.Raw]
    output_rank: int | None          # only this rank replies; None = every rank
    # The caller's W3C context: the worker's spans join the engine's trace.
    trace_headers: dict[str, str] | None = None
    # The engine step the call works for (its EngineCore.step span): the device lane's GPU.step hangs under it.
    step_trace_headers: dict[str, str] | None = None


class RPCResponse(msgspec.Struct, array_like=True):
    status: str                      # "SUCCESS" | "FAILURE" (vLLM: ResponseStatus)
    result: msgspec.Raw              # encoded return value (msgpack nil on failure)
    error: str | None = None         # the worker's traceback text


class PeerInfo(msgspec.Struct, array_like=True):
    """A rank as the others learn of it at start-up (several nodes)."""
    rank: int
    pid: int
    host: str
    response_handle: Handle


class WorkerReady(msgspec.Struct):
    status: str                      # "READY" | "FAILED"
    response_handle: Handle | None = None
    error: str | None = None
    # From rank 0 with several nodes: every rank, so the executor can reach
    # the reply queues of ranks on other hosts (and record their pids).
    peers: list[PeerInfo] | None = None


_encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)     # numpy arrays: the grammar bitmask


def encode_raw(obj: Any) -> msgspec.Raw:
    return msgspec.Raw(_encoder.encode(obj))


@functools.cache
def worker_method_types(method: str) -> tuple[list[Any], dict[str, Any], Any]:
    """(positional types, keyword types, return type) from Worker's annotations."""
    fn = getattr(Worker, method, None)
    if method.startswith("_") or not callable(fn):
        raise AttributeError(f"Worker has no RPC method {method!r}")
    hints = typing.get_type_hints(fn)
    params = list(inspect.signature(fn).parameters.values())[1:]     # drop self
    types = {p.name: hints.get(p.name, Any) for p in params}
    return list(types.values()), types, _wire_type(hints.get("return", Any))


def _wire_type(tp: Any) -> Any:
    """The part of a return annotation that can cross the queue.

    NOTE: sample_tokens may return an AsyncModelRunnerOutput (async scheduling);
    the worker process resolves it before replying: over the queue it is a
    ModelRunnerOutput.
    """
    members = [t for t in typing.get_args(tp) if t is not AsyncModelRunnerOutput]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(members) == 1:
        return members[0]
    return tp


@dataclass
class UnreadyWorkerProcHandle:
    proc: multiprocessing.process.BaseProcess
    rank: int
    ready_pipe: multiprocessing.connection.Connection
    death_writer: multiprocessing.connection.Connection


@dataclass
class WorkerProcHandle:
    proc: multiprocessing.process.BaseProcess
    rank: int
    worker_response_mq: MessageQueue | None      # None on a headless node (node 0 reads it)
    death_writer: multiprocessing.connection.Connection
    peers: list[PeerInfo] | None = None


def _install_worker_signal_handlers(shutdown_requested: threading.Event) -> None:
    """SIGTERM: leave through `finally` (close the queues, flush spans), as vLLM's worker_main.

    NOTE: SIGINT is ignored: Ctrl-C in a terminal reaches the whole process
    group, and the worker's lifetime belongs to its executor (death pipe,
    then SIGTERM, then SIGKILL), so that the frontend can drain in-flight
    requests before anything below it stops.
    """
    def signal_handler(signum, frame) -> None:
        if not shutdown_requested.is_set():      # NOTE: raise once, or `finally` itself is interrupted
            shutdown_requested.set()
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, signal_handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


response_decoder = msgspec.msgpack.Decoder(RPCResponse)
_request_decoder = msgspec.msgpack.Decoder(RPCRequest)


class WorkerProc:
    """One worker process: a Worker plus the two queues (mirrors vLLM's WorkerProc)."""

    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str,
                 input_shm_handle: Handle | None, ipc_dir: str, run_path: str | None = None,
                 trace_headers: dict[str, str] | None = None) -> None:
        self.rank = rank
        pc = vllm_config.parallel_config
        device = vllm_config.model_config.device
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
        # NOTE: each process has its own recorder, attached to the run's store
        # (run_path); the engine's context arrives with each message, so the
        # worker's spans join the engine's trace. A headless node's ranks
        # record nothing: the store is a file on node 0.
        self.recorder = make_recorder(vllm_config, "worker", run_path=run_path, process_name=f"worker-{rank}") \
            if pc.node_rank == 0 else NullRecorder()
        self.worker = Worker(vllm_config, device=device, recorder=self.recorder, local_rank=local_rank,
                             rank=rank, distributed_init_method=distributed_init_method)
        # (the executor waits for every rank's READY: its start-up spans are children of the engine's)
        with self.recorder.remote_parent(trace_headers):
            self.worker.init_device()
            self.worker.load_model()
        self.peers: list[PeerInfo] | None = None
        # NOTE: after init_device: with several nodes the queues are set up over the world group.
        self._init_message_queues(pc, input_shm_handle, ipc_dir)

    def _init_message_queues(self, pc: ParallelConfig, input_shm_handle: Handle | None, ipc_dir: str) -> None:
        if pc.nnodes == 1:
            assert input_shm_handle is not None, "on one node every worker is handed the executor's queue"
            self.rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle, self.rank)
            self.worker_response_mq = MessageQueue(1, MAX_CHUNK_BYTES, ipc_dir=ipc_dir)
            return
        world = get_world_group()
        # Only rank 0 (node 0) was handed the executor's queue: it tells the others.
        encoded = world.broadcast_bytes(_encoder.encode(input_shm_handle) if self.rank == 0 else None)
        self.rpc_broadcast_mq = MessageQueue.create_from_handle(msgspec.msgpack.decode(encoded, type=Handle),
                                                                self.rank)
        # NOTE: a reply queue's reader is the executor: on node 0 it reads the
        # shared memory; from another node it subscribes over TCP.
        remote: dict[str, Any] = (dict(n_local_reader=0, connect_ip=get_ip(pc.master_addr))
                                  if pc.node_rank > 0 else {})
        self.worker_response_mq = MessageQueue(1, MAX_CHUNK_BYTES, ipc_dir=ipc_dir, **remote)
        me = PeerInfo(self.rank, os.getpid(), socket.gethostname(), self.worker_response_mq.export_handle())
        peers = [msgspec.msgpack.decode(b, type=PeerInfo) for b in world.all_gather_bytes(_encoder.encode(me))]
        self.peers = peers if self.rank == 0 else None

    @staticmethod
    def make_worker_process(vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str,
                            input_shm_handle: Handle | None, ipc_dir: str, run_path: str | None = None,
                            trace_headers: dict[str, str] | None = None) -> UnreadyWorkerProcHandle:
        context = multiprocessing.get_context("spawn")     # NOTE: never fork a process holding threads
        ready_reader, ready_writer = context.Pipe(duplex=False)
        death_reader, death_writer = context.Pipe(duplex=False)
        proc = context.Process(target=WorkerProc.worker_main, name=f"VllmWorker-{rank}", daemon=True,
                               args=(vllm_config, local_rank, rank, distributed_init_method,
                                     _encoder.encode(input_shm_handle), ipc_dir, ready_writer, death_reader,
                                     run_path, trace_headers))
        proc.start()
        # NOTE: close our copies, so EOF on these pipes means "that process is gone".
        ready_writer.close()
        death_reader.close()
        return UnreadyWorkerProcHandle(proc, rank, ready_reader, death_writer)

    @staticmethod
    def wait_for_ready(unready: list[UnreadyWorkerProcHandle], attach: bool = True) -> list[WorkerProcHandle]:
        """The started workers, by rank; attach: read their reply queues (not on a headless node)."""
        pending = {u.ready_pipe: u for u in unready}
        ready: dict[int, WorkerProcHandle] = {}
        while pending:
            conns = multiprocessing.connection.wait(list(pending), timeout=WORKER_READY_TIMEOUT_S)
            if not conns:
                raise TimeoutError(f"Workers did not start within {WORKER_READY_TIMEOUT_S} s")
            for conn in [c for c in pending if c in conns]:      # (wait() hands back the pipes given)
                u = pending.pop(conn)
                try:
                    msg = msgspec.msgpack.decode(conn.recv_bytes(), type=WorkerReady)
                except EOFError:
                    u.proc.join(1.0)
                    raise RuntimeError(f"WorkerProc rank {u.rank} died during start-up "
                                       f"(exit code {u.proc.exitcode})") from None
                finally:
                    conn.close()
                if msg.status != "READY":
                    raise RuntimeError(f"WorkerProc rank {u.rank} failed to start:\n{msg.error}")
                assert msg.response_handle is not None, "READY carries the reply queue's handle"
                mq = MessageQueue.create_from_handle(msg.response_handle, 0) if attach else None
                ready[u.rank] = WorkerProcHandle(u.proc, u.rank, mq, u.death_writer, msg.peers)
        return [ready[rank] for rank in sorted(ready)]

    @staticmethod
    def worker_main(vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str,
                    handle_bytes: bytes, ipc_dir: str, ready_pipe, death_pipe, run_path: str | None = None,
                    trace_headers: dict[str, str] | None = None) -> None:
        shutdown_requested = threading.Event()
        _install_worker_signal_handlers(shutdown_requested)

        def monitor_parent_death() -> None:
            # NOTE: EOF arrives when the executor closes its end (shutdown) or its
            # process dies, even by SIGKILL: the kernel closes the pipe.
            try:
                death_pipe.recv_bytes()
            except (EOFError, OSError):
                pass
            shutdown_requested.set()

        threading.Thread(target=monitor_parent_death, daemon=True, name="WorkerDeathMonitor").start()
        proc: WorkerProc | None = None
        try:
            proc = WorkerProc(vllm_config, local_rank, rank, distributed_init_method,
                              msgspec.msgpack.decode(handle_bytes, type=Handle | None), ipc_dir, run_path,
                              trace_headers)
            ready_pipe.send_bytes(_encoder.encode(WorkerReady("READY", proc.worker_response_mq.export_handle(),
                                                              peers=proc.peers)))
            ready_pipe.close()
            proc.rpc_broadcast_mq.wait_until_ready(cancel=shutdown_requested)
            proc.worker_response_mq.wait_until_ready(cancel=shutdown_requested)
            proc.worker_busy_loop(shutdown_requested)
        except MessageQueueCancelled:
            pass                                  # the executor shut down, or is gone
        except Exception:
            if not ready_pipe.closed:
                ready_pipe.send_bytes(_encoder.encode(WorkerReady("FAILED", error=traceback.format_exc())))
            raise
        finally:
            if proc is not None:
                proc.rpc_broadcast_mq.close()
                proc.worker_response_mq.close()
                proc.recorder.shutdown()          # flush this process' spans into the store
            destroy_model_parallel()
            destroy_distributed_environment()

    def worker_busy_loop(self, cancel: threading.Event) -> None:
        while True:
            request = self.rpc_broadcast_mq.dequeue(cancel=cancel, decoder=_request_decoder)
            replies = request.output_rank is None or request.output_rank == self.rank
            try:
                arg_types, kwarg_types, _ = worker_method_types(request.method)
                args = [msgspec.msgpack.decode(a, type=arg_types[i] if i < len(arg_types) else Any,
                                               dec_hook=dec_hook, ext_hook=ext_hook)
                        for i, a in enumerate(request.args)]
                kwargs = {k: msgspec.msgpack.decode(v, type=kwarg_types.get(k, Any), dec_hook=dec_hook,
                                                    ext_hook=ext_hook)
                          for k, v in request.kwargs.items()}
                # NOTE: the caller waits for the replying ranks only: the others' spans follow from its.
                with self.worker.remote_trace_context(request.trace_headers, follows=not replies,
                                                      step_headers=request.step_trace_headers):
                    output = getattr(self.worker, request.method)(*args, **kwargs)
                    if isinstance(output, AsyncModelRunnerOutput):
                        # NOTE: every rank, so each one's copy of the tokens is filled in.
                        output = output.get_output()
                response = RPCResponse("SUCCESS", encode_raw(output))
            except Exception:
                # NOTE: vLLM sends str(e); the whole traceback is more useful to a reader.
                response = RPCResponse("FAILURE", encode_raw(None), traceback.format_exc())
            if replies:
                self.worker_response_mq.enqueue(response, cancel=cancel)
            elif response.status != "SUCCESS":
                # NOTE: vLLM only logs a non-replying rank's error. Here the rank
                # also exits: its peers already ran the step, and would wait in
                # the next collective for a rank that skipped it; the executor's
                # monitor sees the exit and fails the engine with this rank's name.
                logger.error("Worker rank %d failed in %s:\n%s", self.rank, request.method, response.error)
                raise SystemExit(1)
