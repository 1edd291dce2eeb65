"""Executor interface: how EngineCore reaches the workers.

Mirrors vllm/v1/executor/abstract.py. EngineCore never calls a Worker
directly: it calls the executor, which forwards a method name + arguments to
every worker (`collective_rpc`) — a plain call in the same process
(UniProcExecutor) or a message over shared memory (MultiprocExecutor).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Literal, overload

from vllm_anatomy.config import VllmConfig
from vllm_anatomy.core.outputs import DraftTokenIds, ModelRunnerOutput
from vllm_anatomy.core.sched.output import GrammarOutput, SchedulerOutput
from vllm_anatomy.tracing.recorder import NullRecorder, Recorder


class Executor:

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type["Executor"]:
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend == "mp":
            from vllm_anatomy.executor.multiproc_executor import MultiprocExecutor
            return MultiprocExecutor
        from vllm_anatomy.executor.uniproc_executor import UniProcExecutor
        return UniProcExecutor

    def __init__(self, vllm_config: VllmConfig, recorder: Recorder | None = None, *,
                 ipc_dir: str | None = None) -> None:
        """`ipc_dir`: a directory owned by a parent process (the frontend's, handed
        down by EngineCoreProc) where a multi-process executor puts its sockets
        and after which it names its shared memory, so that parent can remove
        them even if this process is SIGKILLed. None: the executor makes its own."""
        self.vllm_config = vllm_config
        self.recorder = recorder or NullRecorder()
        self.ipc_dir_arg = ipc_dir
        self._init_executor()

    def _init_executor(self) -> None:
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        raise NotImplementedError

    def determine_num_available_blocks(self) -> int:
        # NOTE: with several workers each reports what fits on its device;
        # the scheduler must plan for the smallest.
        # NOTE: one block table for all ranks (vLLM: one KVCacheConfig for every
        # worker). With tensor parallelism each rank's cache holds only its own
        # KV heads, but block b holds the same tokens on every rank: the
        # scheduler's block accounting, the slot_mapping and the block table
        # are computed once and broadcast, exactly as with one rank.
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_from_config(self, num_gpu_blocks: int) -> None:
        self.collective_rpc("initialize_from_config", (num_gpu_blocks,))
        # NOTE: after the KV cache exists: graphs capture its addresses.
        self.collective_rpc("compile_or_warm_up_model")

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: Literal[False] = False) -> ModelRunnerOutput | None: ...
    @overload
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: Literal[True]) -> Future[ModelRunnerOutput | None]: ...
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        """Enqueue the step's forward. None: call sample_tokens next; a
        ModelRunnerOutput: nothing to sample (no token scheduled).
        non_block: a Future of that, returned before the worker answers."""
        return self._traced_call("Executor.execute_model", "execute_model", (scheduler_output,), non_block)

    @overload
    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: Literal[False] = False) -> ModelRunnerOutput: ...
    @overload
    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: Literal[True]) -> Future[ModelRunnerOutput]: ...
    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool = False
                      ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Sample the step's tokens (under grammar_output's bitmask, if any).
        non_block: a Future whose result() waits for the tokens (async scheduling)."""
        return self._traced_call("Executor.sample_tokens", "sample_tokens", (grammar_output,), non_block)

    def _traced_call(self, span_name: str, method: str, args: tuple, non_block: bool) -> Any:
        """_rpc_output_rank under a span that lasts until the reply is in: with non_block, until
        the Future is done (a worker's span for the call then lies within it, as Jaeger expects
        of a child; the grammar bitmask the host builds meanwhile runs beside it)."""
        span = self.recorder.start_span(span_name)
        try:
            with self.recorder.use_span(span):
                result = self._rpc_output_rank(method, args, non_block)
        except BaseException:
            span.end()
            raise
        if non_block and isinstance(result, Future) and self.recorder.enabled:
            result.add_done_callback(lambda _future: span.end())
        else:
            span.end()
        return result

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Speculative decoding: the drafts the workers proposed after the last step
        (every rank proposes the same; the output rank's answer is kept)."""
        return self._rpc_output_rank("take_draft_token_ids", ())

    def _rpc_output_rank(self, method: str, args: tuple, non_block: bool = False) -> Any:
        """Call every worker; only the output rank's reply matters (vLLM: unique_reply_rank)."""
        raise NotImplementedError

    def snapshot(self) -> dict:
        return self.collective_rpc("snapshot")[0]

    def register_failure_callback(self, callback) -> None:
        """`callback()` is called when a worker dies. One in-process worker cannot die alone: no-op."""

    def shutdown(self) -> None:
        pass
