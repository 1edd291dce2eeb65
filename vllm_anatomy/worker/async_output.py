"""What async scheduling adds to the model runner: the sampled tokens stay on the device, their copy travels.

Mirrors AsyncGPUModelRunnerOutput in vllm/v1/worker/gpu_model_runner.py and
the parts of GPUModelRunner that serve it (synchronize_input_prep,
_prepare_input_ids, the async branch of _bookkeeping_sync). With async
scheduling, sample_tokens must not wait for the device: the engine wants to
schedule and launch the next step first. So, in AsyncSchedulingMixin (a mixin
of GPUModelRunner, like worker/model_runner_startup.py):
- _bookkeeping_async keeps the sampled ids on the device
  (`input_batch.prev_sampled_token_ids`), appends -1 placeholders to the
  runner's own copy of each request's tokens, and returns an
  AsyncGPUModelRunnerOutput;
- the next step's _prepare_inputs calls _splice_prev_sampled, which puts those
  ids into input_ids on the device, where the host only had the -1s;
- synchronize_input_prep keeps the host from rewriting the pinned input
  buffers before the device has read the previous step's.
AsyncGPUModelRunnerOutput enqueues the device-to-host copy of the ids (and
logprobs) on its own CUDA stream and records an event behind it. get_output(),
called by the engine one step later, waits on that event (the step's sync
point, moved: by then the device usually has the next step queued, so the
wait keeps it busy instead of idle) and writes the real ids over the
placeholders (PlaceholderFill), so a request that skips a step and comes
back has them.

Simplified: vLLM's multiprocess workers call get_output from a separate
thread; ours call it on the worker's own loop (executor/worker_proc.py).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, cast

import numpy as np
import torch

from vllm_anatomy.core.outputs import AsyncModelRunnerOutput, LogprobsTensors, ModelRunnerOutput
from vllm_anatomy.worker.runner_output import make_model_runner_output

if TYPE_CHECKING:
    from vllm_anatomy.model_executor.sampler import SamplerOutput
    from vllm_anatomy.tracing.runner_tracer import RunnerTracer
    from vllm_anatomy.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm_anatomy.worker.cpu_gpu_buffer import CpuGpuBuffer
    from vllm_anatomy.worker.gpu_model_runner import ExecuteModelState, GPUModelRunner


class AsyncSchedulingMixin:
    # The runner's state these methods read (made by GPUModelRunner.__init__).
    input_batch: InputBatch
    requests: dict[str, CachedRequestState]
    tracer: RunnerTracer
    input_ids: CpuGpuBuffer
    splice_indices: CpuGpuBuffer
    use_async_scheduling: bool
    prepare_inputs_event: torch.cuda.Event | None
    async_output_copy_stream: torch.cuda.Stream | None
    sampling_rows: Callable[[int, np.ndarray], np.ndarray]
    cache_sampled_tokens: Callable[[list[str], np.ndarray, list[int]], list[int]]
    # The last step's output (its -1 placeholders may still wait for their copy).
    prev_async_output: AsyncGPUModelRunnerOutput | None = None

    def _bookkeeping_async(self, state: ExecuteModelState,
                           sampler_output: SamplerOutput) -> AsyncGPUModelRunnerOutput:
        """No sync: keep the ids on the device for the next step, -1 placeholders on the host."""
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        invalid = state.discard_request_indices.tolist()
        invalid_set = set(invalid)
        batch.prev_sampled_token_ids = sampler_output.sampled_token_ids          # [R] on the device
        # (every row sampled, most steps: {r: i for i, r in enumerate(req_ids)} as one C-level pass)
        batch.prev_req_id_to_index = ({r: i for i, r in enumerate(req_ids) if i not in invalid_set} if invalid
                                      else dict(zip(req_ids, range(len(req_ids)))))
        batch.prev_req_ids = req_ids if not invalid else None
        rows = self.sampling_rows(len(req_ids), state.discard_request_indices)
        output_indices: list[int | None] = list(self.cache_sampled_tokens(req_ids, rows, [-1] * len(rows)))
        if invalid:
            # A discarded row (a partial prefill chunk) has no placeholder: None at its index.
            by_row: list[int | None] = [None] * len(req_ids)
            for i, output_index in zip(rows.tolist(), output_indices):
                by_row[i] = output_index
            output_indices = by_row
        output = AsyncGPUModelRunnerOutput(
            self.tracer, state.scheduler_output.step_id, req_ids, sampler_output, invalid,
            PlaceholderFill(self.requests, batch, req_ids, output_indices),
            self.async_output_copy_stream, self.tracer.snapshots.take(cast("GPUModelRunner", self)),
            state.error_req_ids, state.prompt_logprobs_dict)
        self.prev_async_output = output
        return output

    def update_async_output_token_ids(self) -> None:
        """Before sampling: if this batch reads its output tokens (penalties, bad
        words) and last step's ids are still -1 placeholders, wait for them now.

        NOTE: vLLM's InputBatch.update_async_output_token_ids, the same trade:
        a request with penalties needs the token it sampled last step, which
        only its copy to the host brings; the wait is for that copy alone (it
        was enqueued a step ago) and happens only in batches that need it.
        """
        prev = self.prev_async_output
        md = self.input_batch.sampling_metadata
        if prev is None or md is None or not md.output_token_ids:
            return
        if any(ids and ids[-1] == -1 for ids in md.output_token_ids):
            prev.fill_placeholders()

    def _splice_prev_sampled(self, cu_num_tokens: np.ndarray) -> None:
        """Async scheduling: put last step's sampled ids, still on the device,
        where the host only had -1 placeholders (a continuing request's last
        input token). vLLM: _prepare_input_ids."""
        batch = self.input_batch
        prev_ids, prev = batch.prev_sampled_token_ids, batch.prev_req_id_to_index
        assert prev_ids is not None and prev is not None      # the caller checked: last step sampled
        last = cu_num_tokens - 1                                               # [R] each request's last token
        rows = np.nonzero(self.input_ids.np[last] == -1)[0]                   # [P] rows waiting on a token
        if len(rows) == 0:
            return
        req_ids = batch.req_ids
        n = len(rows)
        splice = self.splice_indices.np
        # NOTE: only a request that sampled in the previous step can have a -1
        # here (the output of any earlier step has been written over it).
        splice[:n] = last[rows]
        if n == len(req_ids) and req_ids == batch.prev_req_ids:
            # Steady decoding: same requests in the same rows as last step.
            splice[n:2 * n] = rows
        else:
            splice[n:2 * n] = [prev[req_ids[i]] for i in rows]
        indices = self.splice_indices.copy_to_gpu(2 * n)
        self.input_ids.gpu.index_copy_(0, indices[:n], prev_ids.index_select(0, indices[n:]))

    @contextlib.contextmanager
    def synchronize_input_prep(self) -> Iterator[None]:
        """Wait until the previous step's host-to-device copies have run, then
        let this step rewrite the pinned host buffers they read.

        NOTE: the copies are non_blocking from persistent pinned buffers
        (input_ids.cpu, block_table, sampling parameters, ...). Synchronously,
        the step's sync point came long after them. With async scheduling the
        host prepares step N+1 while step N's copies may still wait in the
        stream behind step N-1: overwriting the buffers then would hand step
        N the inputs of N+1. The wait is short: step N-1's output was already
        awaited, and its copies run right after it.
        """
        if self.prepare_inputs_event is None or not self.use_async_scheduling:
            yield
            return
        self.prepare_inputs_event.synchronize()
        try:
            yield
        finally:
            self.prepare_inputs_event.record()


class PlaceholderFill:
    """The -1s one step left in the runner's token copies, and how to replace them.

    Per batch row of that step: its request (req_ids) and the index in the
    request's output_token_ids where its -1 stands (output_indices; None for
    a row that sampled nothing kept)."""

    def __init__(self, requests: dict[str, CachedRequestState], input_batch: InputBatch,
                 req_ids: list[str], output_indices: list[int | None]) -> None:
        self.requests = requests
        self.input_batch = input_batch
        self.req_ids = req_ids
        self.output_indices = output_indices

    def fill(self, sampled: list[list[int]]) -> None:
        """The real ids have arrived; write them over the -1s.

        NOTE: by now the next step has run _update_states, so rows may have
        moved (condense) or left the batch: look each request up afresh. A
        request finished meanwhile is gone; one resumed after preemption got
        its real tokens from the scheduler (no -1 left to replace).
        """
        batch = self.input_batch
        requests, index = self.requests, batch.req_id_to_index
        rows, cols, tokens = [], [], []
        for req_id, output_index, row_tokens in zip(self.req_ids, self.output_indices, sampled):
            if output_index is None or (state := requests.get(req_id)) is None:
                continue
            token = row_tokens[0]
            out = state.output_token_ids
            if output_index >= len(out) or out[output_index] != -1:
                continue
            out[output_index] = token
            row = index.get(req_id)
            if row is not None:
                rows.append(row)
                cols.append(state.num_prompt_tokens + output_index)
                tokens.append(token)
        batch.token_ids_cpu[rows, cols] = tokens


class AsyncGPUModelRunnerOutput(AsyncModelRunnerOutput):

    def __init__(self, tracer: RunnerTracer, step_id: int, req_ids: list[str], sampler_output: SamplerOutput,
                 invalid_req_indices: list[int], placeholders: PlaceholderFill,
                 copy_stream: torch.cuda.Stream | None, snapshot: dict | None,
                 error_req_ids: list[str] | None = None,
                 prompt_logprobs_dict: dict[str, LogprobsTensors | None] | None = None) -> None:
        self._tracer = tracer
        self._step_id = step_id
        self._req_ids = req_ids
        self._invalid_req_indices = invalid_req_indices
        self._placeholders = placeholders
        self._snapshot = snapshot
        self._error_req_ids = error_req_ids
        self._prompt_logprobs_dict = prompt_logprobs_dict
        device_tensors = self._tensors_to_copy(sampler_output)
        self._has_logprobs = sampler_output.logprobs_tensors is not None
        tracer.device_mark("d2h")
        self._ready: torch.cuda.Event | None = None
        if copy_stream is None:
            # NOTE: on a CPU every op ran synchronously: the values are there.
            self._host = list(device_tensors)
        else:
            self._host = self._copy_on_stream(device_tensors, copy_stream)
        self._timer_events = tracer.take_device_events()
        self._output: ModelRunnerOutput | None = None
        self.sync_wait_s = 0.0

    def _tensors_to_copy(self, sampler_output: SamplerOutput) -> tuple[torch.Tensor, ...]:
        """[R, 1] sampled ids, then (with logprobs) the three logprob tensors."""
        return (sampler_output.sampled_token_ids.view(-1, 1), *(sampler_output.logprobs_tensors or ())[:3])

    def _copy_on_stream(self, device_tensors: tuple[torch.Tensor, ...],
                        copy_stream: torch.cuda.Stream) -> list[torch.Tensor]:
        """Enqueue the device-to-host copies on `copy_stream`, behind the sampler; no host wait.

        NOTE: the copy stream first waits for the compute stream (wait_stream),
        so it copies this step's values, and the compute stream does not wait
        for the copy: the next step's kernels queue behind the sampler, not
        behind the transfer. non_blocking into pinned memory; the event recorded
        on the copy stream is what get_output waits on. The device tensors
        are kept referenced until then: they were allocated on the compute
        stream, whose allocator could otherwise hand their memory to the next
        step while the copy still reads it.
        """
        self._device_tensors = device_tensors
        # NOTE: the compute stream must be read *before* entering the copy
        # stream's context: inside it, current_stream() is the copy stream, and
        # a stream waiting on itself orders nothing (the copy then races the
        # sampler and reads memory the sampler has not written yet).
        compute_stream = torch.cuda.current_stream(device_tensors[0].device)
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(compute_stream)
            host = [t.to("cpu", non_blocking=True) for t in device_tensors]
            self._tracer.device_mark("end")
            # Blocking (sleep) event, as vLLM: the host waits without busy-polling the driver.
            self._ready = torch.cuda.Event(blocking=True)
            self._ready.record(copy_stream)
        return host

    def fill_placeholders(self) -> None:
        """Wait for the copy, write the real ids over this step's -1s (ahead of get_output;
        PlaceholderFill.fill is idempotent, so get_output's own fill then changes nothing)."""
        if self._ready is not None:
            self._ready.synchronize()
        self._placeholders.fill(self._host[0].tolist())

    def get_output(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        tracer = self._tracer
        with tracer.sync_point("AsyncGPUModelRunnerOutput.get_output", self._step_id, self._timer_events,
                               **{"vllm_anatomy.step_id": self._step_id}):
            if self._ready is not None:
                tracer.wait(self._ready)
                self._device_tensors = ()          # copied: the device memory may go
            self.sync_wait_s = tracer.wait_s
            valid_sampled_token_ids = self._host[0].tolist()            # [R][1]
            self._placeholders.fill(valid_sampled_token_ids)
            self._output = make_model_runner_output(
                self._req_ids, valid_sampled_token_ids, self._invalid_req_indices,
                LogprobsTensors(*self._host[1:4]).tolists()  # type: ignore[arg-type]
                if self._has_logprobs else None,
                self._prompt_logprobs_dict, self._error_req_ids)
        tracer.snapshots.record(self._step_id, self._output.sampled_token_ids, snapshot=self._snapshot)
        return self._output
