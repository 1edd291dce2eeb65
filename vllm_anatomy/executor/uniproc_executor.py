"""UniProcExecutor: one worker, in this process, called directly.

Mirrors vllm/v1/executor/uniproc_executor.py — the article's single-GPU case:
`collective_rpc` is just `getattr(worker, method)(*args)`.
"""
from __future__ import annotations

from typing import Any

from vllm_anatomy.executor.abstract import Executor
from vllm_anatomy.worker.worker import Worker


class UniProcExecutor(Executor):

    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.vllm_config, device=self.vllm_config.model_config.device,
                                    recorder=self.recorder)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
