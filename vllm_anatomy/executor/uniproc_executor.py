"""UniProcExecutor: one worker, in this process, called directly.

Mirrors vllm/v1/executor/uniproc_executor.py — the article's single-GPU case:
`collective_rpc` is just `getattr(worker, method)(*args)`.

non_block=True (what EngineCore.step asks for) returns a Future that is
already done: the call itself only enqueued device work, so there is nothing
to wait for on the host. With async scheduling sample_tokens' Future wraps
the AsyncModelRunnerOutput, and result() is its get_output(): the sync point.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from vllm_anatomy.core.outputs import AsyncModelRunnerOutput
from vllm_anatomy.executor.abstract import Executor
from vllm_anatomy.worker.worker import Worker


class AsyncOutputFuture(Future):
    """A Future over an AsyncModelRunnerOutput: result() waits for the device (vLLM's name)."""

    def __init__(self, async_output: AsyncModelRunnerOutput) -> None:
        super().__init__()
        self.async_output = async_output

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            raise RuntimeError("timeout not implemented")
        if not self.done():
            try:
                self.set_result(self.async_output.get_output())
            except Exception as e:
                self.set_exception(e)
        return super().result()


class UniProcExecutor(Executor):

    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.vllm_config, device=self.vllm_config.model_config.device,
                                    recorder=self.recorder)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        result = getattr(self.driver_worker, method)(*args, **(kwargs or {}))
        if isinstance(result, AsyncModelRunnerOutput):
            result = result.get_output()
        return [result]

    def _rpc_output_rank(self, method: str, args: tuple, non_block: bool = False) -> Any:
        if not non_block:
            return self.collective_rpc(method, args)[0]
        # NOTE: an exception is raised here, at the call, not kept in the
        # Future: the call ran to its end already (vLLM re-raises it at once
        # for execute_model too).
        result = getattr(self.driver_worker, method)(*args)
        if isinstance(result, AsyncModelRunnerOutput):
            return AsyncOutputFuture(result)
        future: Future = Future()
        future.set_result(result)
        return future

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
