"""AsyncGPUModelRunnerOutput: a step's sampled tokens, on their way to the host.

Mirrors AsyncGPUModelRunnerOutput in vllm/v1/worker/gpu_model_runner.py.
With async scheduling, sample_tokens must not wait for the device: the engine
wants to schedule and launch the next step first. So the runner enqueues the
device-to-host copy of the sampled ids (and logprobs), records an event behind
it, and returns this handle. get_output() — called by the engine one step
later — waits on that event: the step's sync point, moved. By then the device
usually has the next step queued, so the wait keeps it busy instead of idle.

Meanwhile the runner's own copy of the tokens holds -1 placeholders (the next
step reads the real ids straight from the device tensor, see
GPUModelRunner._splice_prev_sampled); get_output() writes the real ids over
the placeholders, so a request that skips a step and comes back still has
them. Simplified: vLLM copies on a side stream from a separate thread in
multiprocess workers; we copy on the compute stream, in-process only.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from vllm_anatomy.core.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

if TYPE_CHECKING:
    from vllm_anatomy.worker.device_timer import StepEvents
    from vllm_anatomy.worker.gpu_model_runner import GPUModelRunner


class Placeholder(NamedTuple):
    """Where a -1 stands for a sampled token: the request and its output index."""
    req_id: str
    output_index: int


class AsyncGPUModelRunnerOutput(AsyncModelRunnerOutput):

    def __init__(self, runner: GPUModelRunner, step_id: int, req_ids: list[str],
                 sampled_token_ids: torch.Tensor, logprobs_tensors: tuple | None,
                 invalid_req_indices: list[int], placeholders: list[Placeholder | None],
                 num_logprobs: dict[str, int], snapshot: dict | None,
                 error_req_ids: list[str] | None = None) -> None:
        self._runner = runner
        self._error_req_ids = error_req_ids
        self._step_id = step_id
        self._req_ids = req_ids
        self._invalid_req_indices = invalid_req_indices
        self._placeholders = placeholders
        self._num_logprobs = num_logprobs
        self._snapshot = snapshot
        # NOTE: enqueued behind the sampler on the same stream, so they copy
        # this step's values; non_blocking into pinned memory: no host wait.
        runner.device_timer.mark("d2h")
        self._host = [t.to("cpu", non_blocking=True)
                      for t in (sampled_token_ids, *(logprobs_tensors or ()))]
        self._has_logprobs = logprobs_tensors is not None
        self._ready = None
        if sampled_token_ids.is_cuda:
            runner.device_timer.mark("end")
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._timer_events: StepEvents | None = runner.device_timer.take()
        self._output: ModelRunnerOutput | None = None
        self.sync_wait_s = 0.0

    def get_output(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        runner = self._runner
        with runner.recorder.span("AsyncGPUModelRunnerOutput.get_output",
                                  **{"vllm_anatomy.step_id": self._step_id}) as span:
            t0 = time.perf_counter()
            if self._ready is not None:
                self._ready.synchronize()
            wait_s = self.sync_wait_s = time.perf_counter() - t0
            runner.device_timer.resolve(self._step_id, self._timer_events, wait_s)
            span.set_attribute("vllm_anatomy.sync_wait_ms", wait_s * 1e3)
            span.set_attribute("vllm_anatomy.device", runner.device.type)
            sampled = self._host[0].tolist()
            runner.fill_placeholders(self._placeholders, sampled)
            self._output = runner.make_model_runner_output(
                self._req_ids, sampled, self._invalid_req_indices, self._num_logprobs,
                [t.tolist() for t in self._host[1:]] if self._has_logprobs else None,
                self._error_req_ids)
        if self._snapshot is not None:
            runner._record_snapshot(self._step_id, self._output.sampled_token_ids, self._snapshot)
        return self._output
