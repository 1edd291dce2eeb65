"""MultiprocExecutor: workers in their own processes, reached through shared memory.

Mirrors vllm/v1/executor/multiproc_executor.py (MultiprocExecutor, WorkerProc).

    EngineCore --collective_rpc--> rpc_broadcast_mq (1 writer, world_size readers)
         ^                              |
         |                    WorkerProc.worker_busy_loop (one process per rank):
         |                    dequeue (method, args) -> getattr(worker, method)(*args)
         +---- worker_response_mq (one per worker; only the replying ranks write)

Everything on the queues is msgspec msgpack, never pickle. NOTE: the types are
the Worker's own annotations: a worker decodes `execute_model`'s argument as
SchedulerOutput because `Worker.execute_model` says so, and the executor
decodes the reply with the method's return annotation. vLLM pickles instead,
and also accepts a cloudpickled function as the "method": we accept names only.
The VllmConfig reaches a worker once, as a spawn argument (multiprocessing
pickles those at start-up, as in vLLM); nothing is pickled after that.

Tensor parallelism: the workers are the ranks. Each joins torch.distributed
(worker.py: init_worker_distributed_environment) at `distributed_init_method`
and loads its slice of the model; every rank runs every step it reads from
rpc_broadcast_mq, and only `output_rank` (0) replies to execute_model and
sample_tokens. A rank that fails a step it does not reply to exits: its peers
would otherwise wait in the next collective for a rank that will never come.

Several hosts (nnodes > 1): node 0 runs the engine, this executor and
local_world_size ranks; every other node runs `vllm-anatomy serve --headless`,
an executor with no queue of its own whose ranks join the same world at
master_addr:master_port. rpc_broadcast_mq then has remote readers (TCP); rank
0 hands its handle to the others over the world group, gathers their reply
queues' handles and pids, and sends them here with its READY message.

non_block=True (EngineCore.step's execute_model) enqueues the call and returns
a FutureWrapper at once; its result() reads the reply. Replies come back in
call order, so a future first drains the ones enqueued before it (vLLM's
futures_queue). The caller's W3C trace context rides in the RPC envelope
(RPCRequest.trace_headers), not in the method's arguments.

Async scheduling: sample_tokens returns an AsyncModelRunnerOutput in the
worker; the busy loop waits for its tokens (get_output) and replies with the
ModelRunnerOutput. The engine still schedules step N+1 and enqueues it before
it reads step N's reply. Simplified: vLLM hands the wait to an async-output
thread, so its busy loop already prepares step N+1 while step N's tokens copy;
here the next call waits for that copy. No pipeline or data parallelism.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import traceback
import types
import typing
import weakref
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from vllm_anatomy.config import ParallelConfig, VllmConfig
from vllm_anatomy.core.outputs import AsyncModelRunnerOutput
from vllm_anatomy.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                     get_world_group)
from vllm_anatomy.engine.serial_utils import dec_hook, enc_hook
from vllm_anatomy.executor.abstract import Executor
from vllm_anatomy.executor.shm_broadcast import (Handle, MessageQueue, MessageQueueCancelled,
                                                 unlink_shm_segments)
from vllm_anatomy.tracing.factory import make_recorder
from vllm_anatomy.tracing.recorder import NullRecorder
from vllm_anatomy.utils.network_utils import (get_distributed_init_method, get_ip, get_loopback_ip,
                                              get_open_port)
from vllm_anatomy.utils.shutdown import shutdown
from vllm_anatomy.worker.worker import Worker

logger = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 1 << 20      # vLLM: VLLM_MQ_MAX_CHUNK_BYTES_MB = 16 MiB; our messages are small
WORKER_READY_TIMEOUT_S = 600.0
SHUTDOWN_GRACE_S = 5.0        # a worker's own exit once its death pipe closes
SIGTERM_WAIT_S = 1.0          # then SIGTERM, then SIGKILL


class RPCRequest(msgspec.Struct, array_like=True):
    method: str
    # NOTE: each argument is encoded on its own and decoded lazily (Raw) with
    # the type the worker method declares for it.
    args: list[msgspec.Raw]
    kwargs: dict[str, msgspec.Raw]
    output_rank: int | None          # only this rank replies; None = every rank
    # The caller's W3C context: the worker's spans join the engine's trace.
    trace_headers: dict[str, str] | None = None


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


def _raw(obj: Any) -> msgspec.Raw:
    return msgspec.Raw(_encoder.encode(obj))


@functools.cache
def _worker_method_types(method: str) -> tuple[list[Any], dict[str, Any], Any]:
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


class FutureWrapper(Future):
    """The reply of one RPC, read when asked for (vLLM's name).

    NOTE: the replies of a rank arrive in call order; result() first reads the
    replies of the calls made before this one (each into its own future).
    """

    def __init__(self, futures_queue: deque["FutureWrapper"], get_response: Callable[[], Any]) -> None:
        super().__init__()
        self.futures_queue = futures_queue
        self.get_response = get_response
        futures_queue.appendleft(self)

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            raise RuntimeError("timeout not implemented")
        while not self.done():
            self.futures_queue.pop()._wait_for_response()
        return super().result()

    def _wait_for_response(self) -> None:
        try:
            response = self.get_response()
            with contextlib.suppress(InvalidStateError):
                self.set_result(response)
        except Exception as e:
            with contextlib.suppress(InvalidStateError):
                self.set_exception(e)


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


class BackgroundResources:
    """What shutdown must release, kept apart from the executor (as vLLM's core_client
    does) so a weakref.finalize can reach it without keeping the executor alive."""

    def __init__(self, ipc_dir: str | None) -> None:
        # NOTE: every ipc socket file lives in one directory, and every segment
        # is named after it: both are found and removed even if a worker was
        # killed. A directory handed in belongs to the caller (the frontend
        # process): it removes it, even if this process is SIGKILLed.
        self.owns_ipc_dir = ipc_dir is None
        self.ipc_dir = ipc_dir or tempfile.mkdtemp(prefix="vllm_anatomy_ipc_")
        self.rpc_broadcast_mq: MessageQueue | None = None
        self.unready: list[UnreadyWorkerProcHandle] = []
        self.workers: list[WorkerProcHandle] = []
        self.remote_response_mqs: list[MessageQueue] = []     # reply queues of ranks on other nodes
        self.shutdown_event = threading.Event()
        self.shutting_down = False

    def __call__(self) -> None:
        """Stop the workers, then unlink every segment and socket."""
        self.shutting_down = True
        self.shutdown_event.set()        # NOTE: ends our own waits on the queues
        for conn in [u.death_writer for u in self.unready]:
            conn.close()                 # NOTE: EOF on the death pipe = "exit now" for the worker
        shutdown([u.proc for u in self.unready], exit_wait_s=SHUTDOWN_GRACE_S, terminate_wait_s=SIGTERM_WAIT_S)
        for mq in [w.worker_response_mq for w in self.workers] + self.remote_response_mqs:
            if mq is not None:
                mq.close()
        if self.rpc_broadcast_mq is not None:
            self.rpc_broadcast_mq.close()
        # NOTE: a killed worker could not unlink the segment it created.
        unlink_shm_segments(self.ipc_dir)
        if self.owns_ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


class MultiprocExecutor(Executor):

    def _init_executor(self) -> None:
        pc = self.vllm_config.parallel_config
        self.world_size, self.local_world_size = pc.world_size, pc.local_world_size
        # A node other than 0 runs ranks only: the engine and the queues are on node 0.
        self.is_headless = pc.node_rank > 0
        # NOTE: vLLM replies from world_size - tp_size * pcp_size (first TP rank of
        # the last pipeline stage); with every rank in one stage that is rank 0.
        self.output_rank = 0
        self.is_failed = False
        self.failure_message: str | None = None
        self.failure_callback: Callable[[], None] | None = None
        self.resources = res = BackgroundResources(self.ipc_dir_arg)
        self.ipc_dir, self.shutdown_event = res.ipc_dir, res.shutdown_event
        self.rpc_broadcast_mq: MessageQueue | None = None
        self.response_mqs: list[MessageQueue] = []          # one per rank, by rank
        self.futures_queue: deque[FutureWrapper] = deque()   # calls whose replies are not read yet
        # NOTE: runs at interpreter exit at the latest, or when the executor is collected.
        self._finalizer = weakref.finalize(self, res)
        try:
            self._start_workers(pc)
        except BaseException:
            self.shutdown()
            raise
        self._record_ranks()
        if not self.is_headless:
            self.start_worker_monitor()

    def _start_workers(self, pc: ParallelConfig) -> None:
        res = self.resources
        handle = None
        if not self.is_headless:
            # NOTE: readers 0 .. local_world_size - 1 (this host's ranks) read the
            # shared memory; the ranks of other nodes subscribe over TCP.
            connect_ip = get_ip(pc.master_addr) if pc.nnodes > 1 else None
            self.rpc_broadcast_mq = res.rpc_broadcast_mq = MessageQueue(
                self.world_size, MAX_CHUNK_BYTES, ipc_dir=self.ipc_dir,
                n_local_reader=self.local_world_size, connect_ip=connect_ip)
            handle = self.rpc_broadcast_mq.export_handle()
        run_path = getattr(self.recorder, "run_path", None)
        init_method = _distributed_init_method(pc)
        first_rank = self.local_world_size * pc.node_rank
        res.unready = [WorkerProc.make_worker_process(self.vllm_config, local_rank, first_rank + local_rank,
                                                      init_method, handle, self.ipc_dir, run_path)
                       for local_rank in range(self.local_world_size)]
        self.workers = res.workers = WorkerProc.wait_for_ready(res.unready, attach=not self.is_headless)
        if self.is_headless:
            return
        self.response_mqs = [w.worker_response_mq for w in self.workers] + self._attach_remote_response_mqs()
        self.rpc_broadcast_mq.wait_until_ready(timeout=WORKER_READY_TIMEOUT_S)
        for mq in self.response_mqs:
            mq.wait_until_ready(timeout=WORKER_READY_TIMEOUT_S)

    def _attach_remote_response_mqs(self) -> list[MessageQueue]:
        """The reply queues of the ranks on other nodes (rank 0 sent their handles)."""
        peers = sorted(self.workers[0].peers or [], key=lambda p: p.rank)
        remote = [MessageQueue.create_from_handle(p.response_handle, 0) for p in peers
                  if p.rank >= self.local_world_size]
        self.resources.remote_response_mqs = remote
        return remote

    def _record_ranks(self) -> None:
        """Every rank's pid and host in the run store's meta (docs/trace-format.md)."""
        host = socket.gethostname()
        ranks = {w.rank: {"rank": w.rank, "pid": w.proc.pid, "host": host,
                          "local_rank": w.rank - self.local_world_size * self.vllm_config.parallel_config.node_rank}
                 for w in self.workers}
        for peer in (self.workers[0].peers or []) if self.workers else []:
            ranks.setdefault(peer.rank, {"rank": peer.rank, "pid": peer.pid, "host": peer.host,
                                         "local_rank": peer.rank % self.local_world_size})
        self.rank_info = [ranks[r] for r in sorted(ranks)]
        self.recorder.set_run_meta("tensor_parallel_size", self.vllm_config.parallel_config.tensor_parallel_size)
        self.recorder.set_run_meta("ranks", self.rank_info)

    def start_worker_monitor(self, inline: bool = False) -> None:
        """A thread that waits on the workers' process sentinels (readable when a process ends).

        NOTE: this is what notices a worker that dies while the engine is idle:
        no RPC is waiting, so only the sentinel can tell. The failure callback
        (EngineCoreProc's) then wakes the engine's busy loop.
        inline (a headless node, vLLM's name): wait here instead, in the caller's
        thread, until a rank ends (the engine on node 0 shut down, or a rank died);
        then stop the others.
        """
        workers, self_ref, res = list(self.workers), weakref.ref(self), self.resources

        def monitor_workers() -> None:
            died = multiprocessing.connection.wait([w.proc.sentinel for w in workers])
            executor = self_ref()
            if executor is None or res.shutting_down:
                return
            dead = next(w for w in workers if w.proc.sentinel in died)
            if inline and dead.proc.exitcode == 0:
                # A headless node: the engine closed the queue; the others end on their own.
                shutdown([w.proc for w in workers], exit_wait_s=SHUTDOWN_GRACE_S, terminate_wait_s=SIGTERM_WAIT_S)
                return
            executor._fail(dead)
            # NOTE: as in vLLM, one dead worker takes the executor down: the others
            # are stopped (and reaped) now; shared memory is reclaimed by shutdown().
            for w in workers:
                if w.proc.is_alive():
                    w.proc.terminate()
            shutdown([w.proc for w in workers], exit_wait_s=SHUTDOWN_GRACE_S, terminate_wait_s=SIGTERM_WAIT_S)

        if inline:
            monitor_workers()
            return
        threading.Thread(target=monitor_workers, daemon=True, name="MultiprocWorkerMonitor").start()

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """`callback()` is called once, from the monitor thread, when a worker dies
        (at once if one already has). EngineCoreProc registers one that wakes its busy loop."""
        if self.is_failed:
            callback()
        else:
            self.failure_callback = callback

    def _fail(self, dead: WorkerProcHandle) -> None:
        if self.is_failed:
            return
        dead.proc.join(1.0)
        self.failure_message = (f"Worker proc {dead.proc.name} (rank {dead.rank}, pid {dead.proc.pid}) died "
                                f"unexpectedly with exit code {dead.proc.exitcode}; the executor cannot continue.")
        self.is_failed = True
        self.shutdown_event.set()     # NOTE: wakes every wait on a queue (cancel)
        if self.failure_callback is not None:
            self.failure_callback()

    def _check_alive(self) -> None:
        if not self.is_failed and not self.resources.shutting_down:
            # NOTE: also polled here, so a death just before this call cannot race the monitor.
            dead = next((w for w in self.workers if w.proc.exitcode is not None), None)
            if dead is not None:
                self._fail(dead)
        if self.is_failed or self.resources.shutting_down:
            raise RuntimeError(self.failure_message or "MultiprocExecutor has been shut down.")

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, timeout: float | None = None,
                       non_block: bool = False) -> Any:
        """Broadcast (method, args) once; a list of replies, one per rank, or only
        `unique_reply_rank`'s reply (not a list), as in vLLM. non_block: a
        Future of that, returned once the call is enqueued."""
        if not isinstance(method, str):
            raise TypeError("collective_rpc takes a Worker method name (vLLM also takes a "
                            "cloudpickled function; we never pickle).")
        self._check_alive()
        request = RPCRequest(method, [_raw(a) for a in args],
                             {k: _raw(v) for k, v in (kwargs or {}).items()}, unique_reply_rank,
                             self.recorder.inject_trace_headers() or None)
        with self._queue_errors(method):
            self.rpc_broadcast_mq.enqueue(request, timeout=timeout, cancel=self.shutdown_event)
        ranks = [unique_reply_rank] if unique_reply_rank is not None else list(range(self.world_size))
        future = FutureWrapper(self.futures_queue, functools.partial(
            self._get_response, method, ranks, timeout, unique_reply_rank is not None))
        return future if non_block else future.result()

    def _get_response(self, method: str, ranks: list[int], timeout: float | None, single: bool) -> Any:
        """Read one call's replies (one per rank in `ranks`) and decode them (single: the one reply)."""
        with self._queue_errors(method):
            # NOTE: read every reply before raising any error: one left in a queue
            # would be taken as the answer to the next call.
            responses = [self.response_mqs[r].dequeue(timeout, self.shutdown_event, decoder=_response_decoder)
                         for r in ranks]
        for rank, response in zip(ranks, responses):
            if response.status != "SUCCESS":
                raise RuntimeError(f"Worker (rank {rank}) failed in {method}. "
                                   f"Worker traceback:\n{response.error}")
        return_type = _worker_method_types(method)[2]
        results = [msgspec.msgpack.decode(r.result, type=return_type, dec_hook=dec_hook) for r in responses]
        return results[0] if single else results

    @contextlib.contextmanager
    def _queue_errors(self, method: str):
        """A cancelled or timed-out wait on a queue -> the executor's failure."""
        try:
            yield
        except MessageQueueCancelled as e:
            if self.failure_message is None and not self.resources.shutting_down:
                # NOTE: not the monitor (it sees local processes only): the
                # reply queue of a rank on another node lost its connection.
                self.is_failed = True
                self.failure_message = f"A rank on another node is gone ({e}); the executor cannot continue."
            raise RuntimeError(self.failure_message or "MultiprocExecutor has been shut down.") from None
        except TimeoutError:
            # NOTE: a late reply would be read as the answer to the next call.
            self.is_failed = True
            self.failure_message = f"RPC call to {method} timed out; the executor cannot continue."
            raise TimeoutError(self.failure_message) from None

    def _rpc_output_rank(self, method: str, args: tuple, non_block: bool = False) -> Any:
        return self.collective_rpc(method, args, unique_reply_rank=self.output_rank, non_block=non_block)

    def shutdown(self) -> None:
        """Stop the workers, unlink all shared memory. Idempotent (a finalizer runs once)."""
        self._finalizer()


def _distributed_init_method(pc: ParallelConfig) -> str:
    """Where the ranks meet: a free local port on one host; node 0's master_addr:master_port
    (the same on every node, given on each command line) with several."""
    if pc.nnodes == 1:
        return get_distributed_init_method(get_loopback_ip(), get_open_port())
    return get_distributed_init_method(pc.master_addr, pc.master_port)


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


_response_decoder = msgspec.msgpack.Decoder(RPCResponse)
_request_decoder = msgspec.msgpack.Decoder(RPCRequest)


class WorkerProc:
    """One worker process: a Worker plus the two queues (mirrors vLLM's WorkerProc)."""

    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str,
                 input_shm_handle: Handle | None, ipc_dir: str, run_path: str | None = None) -> None:
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
        self.worker.init_device()
        self.worker.load_model()
        self.peers: list[PeerInfo] | None = None
        # NOTE: after init_device: with several nodes the queues are set up over the world group.
        self._init_message_queues(pc, input_shm_handle, ipc_dir)

    def _init_message_queues(self, pc: ParallelConfig, input_shm_handle: Handle | None, ipc_dir: str) -> None:
        if pc.nnodes == 1:
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
        remote = dict(n_local_reader=0, connect_ip=get_ip(pc.master_addr)) if pc.node_rank > 0 else {}
        self.worker_response_mq = MessageQueue(1, MAX_CHUNK_BYTES, ipc_dir=ipc_dir, **remote)
        me = PeerInfo(self.rank, os.getpid(), socket.gethostname(), self.worker_response_mq.export_handle())
        peers = [msgspec.msgpack.decode(b, type=PeerInfo) for b in world.all_gather_bytes(_encoder.encode(me))]
        self.peers = peers if self.rank == 0 else None

    @staticmethod
    def make_worker_process(vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str,
                            input_shm_handle: Handle | None, ipc_dir: str,
                            run_path: str | None = None) -> UnreadyWorkerProcHandle:
        context = multiprocessing.get_context("spawn")     # NOTE: never fork a process holding threads
        ready_reader, ready_writer = context.Pipe(duplex=False)
        death_reader, death_writer = context.Pipe(duplex=False)
        proc = context.Process(target=WorkerProc.worker_main, name=f"VllmWorker-{rank}", daemon=True,
                               args=(vllm_config, local_rank, rank, distributed_init_method,
                                     _encoder.encode(input_shm_handle), ipc_dir, ready_writer, death_reader,
                                     run_path))
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
            for conn in conns:
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
                mq = MessageQueue.create_from_handle(msg.response_handle, 0) if attach else None
                ready[u.rank] = WorkerProcHandle(u.proc, u.rank, mq, u.death_writer, msg.peers)
        return [ready[rank] for rank in sorted(ready)]

    @staticmethod
    def worker_main(vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str,
                    handle_bytes: bytes, ipc_dir: str, ready_pipe, death_pipe, run_path: str | None = None) -> None:
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
                              msgspec.msgpack.decode(handle_bytes, type=Handle | None), ipc_dir, run_path)
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
                arg_types, kwarg_types, _ = _worker_method_types(request.method)
                args = [msgspec.msgpack.decode(a, type=arg_types[i] if i < len(arg_types) else Any,
                                               dec_hook=dec_hook)
                        for i, a in enumerate(request.args)]
                kwargs = {k: msgspec.msgpack.decode(v, type=kwarg_types.get(k, Any), dec_hook=dec_hook)
                          for k, v in request.kwargs.items()}
                with self.worker.remote_trace_context(request.trace_headers):
                    output = getattr(self.worker, request.method)(*args, **kwargs)
                if isinstance(output, AsyncModelRunnerOutput):
                    # NOTE: every rank, so each one's copy of the tokens is filled in.
                    output = output.get_output()
                response = RPCResponse("SUCCESS", _raw(output))
            except Exception:
                # NOTE: vLLM sends str(e); the whole traceback is more useful to a reader.
                response = RPCResponse("FAILURE", _raw(None), traceback.format_exc())
            if replies:
                self.worker_response_mq.enqueue(response, cancel=cancel)
            elif response.status != "SUCCESS":
                # NOTE: vLLM only logs a non-replying rank's error. Here the rank
                # also exits: its peers already ran the step, and would wait in
                # the next collective for a rank that skipped it; the executor's
                # monitor sees the exit and fails the engine with this rank's name.
                logger.error("Worker rank %d failed in %s:\n%s", self.rank, request.method, response.error)
                raise SystemExit(1)
