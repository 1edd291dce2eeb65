"""EngineCore: the inner loop — schedule, execute, update.

Mirrors vllm/v1/engine/core.py (EngineCore; EngineCoreProc, the same loop in
its own process, comes with the process-boundary work). One `step()`:

    Scheduler.schedule()            -> SchedulerOutput        (CPU, pure Python)
    Executor.execute_model(out)     -> None                   (enqueues the forward)
    Executor.sample_tokens()        -> ModelRunnerOutput      (sampling + the one sync)
    Scheduler.update_from_output()  -> EngineCoreOutputs      (append tokens, stop, free)

NOTE: execute_model returns None on purpose (as in vLLM): the forward is only
enqueued on the device, and the CPU is free to do other work (in vLLM: the
structured-output grammar bitmask) until sample_tokens needs the logits.
"""
from __future__ import annotations

import time

import msgspec

from vllm_anatomy.config import VllmConfig
from vllm_anatomy.core.kv_cache_utils import get_request_block_hasher, init_none_hash, sha256
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from vllm_anatomy.executor.abstract import Executor
from vllm_anatomy.tracing.recorder import NullRecorder, Recorder


class EngineCore:

    def __init__(self, vllm_config: VllmConfig, recorder: Recorder | None = None,
                 executor_class: type[Executor] | None = None) -> None:
        self.vllm_config = vllm_config
        self.recorder = recorder or NullRecorder()
        cache_config = vllm_config.cache_config
        with self.recorder.span("EngineCore.__init__"):
            executor_class = executor_class or Executor.get_class(vllm_config)
            self.model_executor = executor_class(vllm_config, self.recorder)
            with self.recorder.span("EngineCore._initialize_kv_caches"):
                num_gpu_blocks = self.model_executor.determine_num_available_blocks()
                cache_config.num_gpu_blocks = num_gpu_blocks
                self.model_executor.initialize_from_config(num_gpu_blocks)
            # Block-pool events (allocate / free / hit / evict) are kept only when
            # snapshots are recorded: someone must drain them every step.
            self.scheduler = Scheduler(vllm_config, num_gpu_blocks,
                                       enable_kv_cache_events=self.recorder.wants_snapshots)
        # NOTE: the request computes its own block hashes (on arrival and on
        # every appended token); the hasher is created once, here, so every
        # request chains from the same NONE_HASH seed.
        self.request_block_hasher = None
        if cache_config.enable_prefix_caching:
            init_none_hash(sha256)
            self.request_block_hasher = get_request_block_hasher(cache_config.block_size, sha256)

    # -- requests ---------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        with self.recorder.span("EngineCore.add_request", **{"vllm_anatomy.request_id": request.request_id}):
            req = Request.from_engine_core_request(request, self.request_block_hasher)
            self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests; unknown or already finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    # -- the step -----------------------------------------------------------------
    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """One schedule -> execute -> update round.

        Returns (outputs per client index, whether the model ran this step)."""
        if not self.scheduler.has_requests():
            return {}, False
        rec = self.recorder
        with rec.span("EngineCore.step") as span:
            with rec.span("Scheduler.schedule"):
                scheduler_output = self.scheduler.schedule()
            span.set_attribute("vllm_anatomy.step_id", scheduler_output.step_id)
            self.model_executor.execute_model(scheduler_output)
            model_output = self.model_executor.sample_tokens()
            with rec.span("Scheduler.update_from_output"):
                outputs = self.scheduler.update_from_output(scheduler_output, model_output)
            span.set_attribute("vllm_anatomy.num_scheduled_tokens", scheduler_output.total_num_scheduled_tokens)
            span.set_attribute("vllm_anatomy.num_reqs", len(scheduler_output.num_scheduled_tokens))
            if rec.wants_snapshots:
                self._record_snapshot(scheduler_output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def _record_snapshot(self, scheduler_output) -> None:
        step_id = scheduler_output.step_id
        self.recorder.snapshot("step", {
            "step_id": step_id,
            "time": time.time(),
            "scheduler_output": msgspec.to_builtins(scheduler_output),
            "scheduler": self.scheduler.snapshot(),
            "block_pool_events": msgspec.to_builtins(self.scheduler.kv_cache_manager.take_events()),
        }, step_id=step_id)
        # NOTE: the worker records its own half ("model_runner") where it runs:
        # in another process it could not be fetched without an extra round trip.

    def shutdown(self) -> None:
        self.model_executor.shutdown()
