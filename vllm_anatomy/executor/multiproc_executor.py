"""MultiprocExecutor: workers in their own processes, reached through shared memory.

Mirrors vllm/v1/executor/multiproc_executor.py (MultiprocExecutor, WorkerProc).
vLLM keeps both sides in that one file; we split it for reading: this file is
the executor's side (start the ranks, broadcast each call, read the replies,
watch for a dead rank, shut down), worker_proc.py the worker process' side
(the RPC messages, start-up, worker_busy_loop).

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
import multiprocessing
import multiprocessing.connection
import shutil
import socket
import tempfile
import threading
import weakref
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

import msgspec

from vllm_anatomy.config import ParallelConfig
from vllm_anatomy.engine.serial_utils import dec_hook, ext_hook
from vllm_anatomy.executor.abstract import Executor
from vllm_anatomy.executor.shm_broadcast import MessageQueue, MessageQueueCancelled, unlink_shm_segments
from vllm_anatomy.executor.worker_proc import (MAX_CHUNK_BYTES, WORKER_READY_TIMEOUT_S, RPCRequest,
                                               UnreadyWorkerProcHandle, WorkerProc, WorkerProcHandle,
                                               encode_raw, response_decoder, worker_method_types)
from vllm_anatomy.utils.network_utils import get_distributed_init_method, get_ip, get_loopback_ip, get_open_port
from vllm_anatomy.utils.shutdown import shutdown

SHUTDOWN_GRACE_S = 5.0        # a worker's own exit once its death pipe closes
SIGTERM_WAIT_S = 1.0          # then SIGTERM, then SIGKILL
PEER_DEATH_WAIT_S = 0.25      # an error reply may be the echo of another rank's death: wait this long to see


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
        rpc_broadcast_mq = None
        if not self.is_headless:
            # NOTE: readers 0 .. local_world_size - 1 (this host's ranks) read the
            # shared memory; the ranks of other nodes subscribe over TCP.
            connect_ip = get_ip(pc.master_addr) if pc.nnodes > 1 else None
            self.rpc_broadcast_mq = res.rpc_broadcast_mq = rpc_broadcast_mq = MessageQueue(
                self.world_size, MAX_CHUNK_BYTES, ipc_dir=self.ipc_dir,
                n_local_reader=self.local_world_size, connect_ip=connect_ip)
            handle = rpc_broadcast_mq.export_handle()
        run_path = getattr(self.recorder, "run_path", None)
        init_method = _distributed_init_method(pc)
        first_rank = self.local_world_size * pc.node_rank
        # (the workers' start-up spans join the caller's, EngineCore.__init__: the start-up trace)
        trace_headers = self.recorder.inject_trace_headers() or None
        res.unready = [WorkerProc.make_worker_process(self.vllm_config, local_rank, first_rank + local_rank,
                                                      init_method, handle, self.ipc_dir, run_path, trace_headers)
                       for local_rank in range(self.local_world_size)]
        self.workers = res.workers = WorkerProc.wait_for_ready(res.unready, attach=not self.is_headless)
        if rpc_broadcast_mq is None:          # a headless node: node 0's executor drives these workers
            return
        # NOTE: attached (wait_for_ready(attach=True)): every local worker has its reply queue.
        self.response_mqs = [mq for w in self.workers if (mq := w.worker_response_mq) is not None]
        assert len(self.response_mqs) == len(self.workers)
        self.response_mqs += self._attach_remote_response_mqs()
        rpc_broadcast_mq.wait_until_ready(timeout=WORKER_READY_TIMEOUT_S)
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
        # The caller's span and the engine step it works for (the workers' spans join them).
        trace_headers, step_trace_headers = self.recorder.rpc_trace_headers()
        request = RPCRequest(method, [encode_raw(a) for a in args],
                             {k: encode_raw(v) for k, v in (kwargs or {}).items()}, unique_reply_rank,
                             trace_headers, step_trace_headers)
        assert self.rpc_broadcast_mq is not None, "a headless node's executor sends no RPCs"
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
            responses = [self.response_mqs[r].dequeue(timeout, self.shutdown_event, decoder=response_decoder)
                         for r in ranks]
        for rank, response in zip(ranks, responses):
            if response.status != "SUCCESS":
                self._check_peer_death()
                raise RuntimeError(f"Worker (rank {rank}) failed in {method}. "
                                   f"Worker traceback:\n{response.error}")
        return_type = worker_method_types(method)[2]
        results = [msgspec.msgpack.decode(r.result, type=return_type, dec_hook=dec_hook, ext_hook=ext_hook)
                   for r in responses]
        return results[0] if single else results

    def _check_peer_death(self) -> None:
        """Before a rank's error reply is raised: if a local worker has ended, raise its death instead.

        NOTE: when a worker dies mid-step, the rank that replies may get there first: its
        collective (gloo's all-reduce) loses the peer and fails, and that error reaches us
        before the monitor thread has seen the dead process's sentinel. The death is the
        cause, and the error the user should read; its sentinel is readable by then or
        within moments (the peer's sockets and its sentinel both close at its exit), so a
        short wait, on error replies only, tells the two apart."""
        sentinels = [w.proc.sentinel for w in self.workers]
        if sentinels and multiprocessing.connection.wait(sentinels, timeout=PEER_DEATH_WAIT_S):
            self._check_alive()

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
