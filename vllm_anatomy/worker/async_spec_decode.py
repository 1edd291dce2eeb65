"""Async scheduling with speculative decoding (method draft_model): the drafts never leave the device.

Mirrors the async spec-decode paths of vllm/v1/worker/gpu_model_runner.py
(GPUModelRunner._prepare_input_ids, GPUModelRunner._update_states: the
padded drafter batch in sample_tokens, the drafts kept as a device tensor,
their scatter into the input ids, and the correction of the computed counts). A mixin of GPUModelRunner, beside worker/async_output.py
(plain async scheduling) and worker/spec_decode_runner.py (speculative decoding).

The scheduler (core/sched/async_scheduler.py) plans step N+1 before step N's
output is known: it schedules K -1 placeholder drafts per request and
counts step N's drafts as accepted. Here:

  sample_tokens N     the rejection sampler's [R, 1 + K] output stays on the
                      device; its copy to the host is enqueued (AsyncGPUSpecDecodeOutput),
                      then the draft model proposes step N+1's drafts from it
                      without a host wait (DraftModelProposer.propose_padded):
                      `_draft_token_ids` [R, K] on the device.
  _update_states N+1  correct_spec_decode_token_counts: step N's tokens join
                      the runner's token copies, and each request's optimistic
                      num_computed_tokens is corrected by its rejected drafts
                      (prev_num_draft_len - accepted).
  _prepare_inputs N+1 _prepare_draft_input_ids: the -1s the scheduler sent
                      for the drafts are replaced in input_ids on the device by
                      `_draft_token_ids`; the rejection sampler reads the drafts there too.

NOTE (simplified): v0.27.1 corrects the positions on the device
(update_num_computed_tokens_for_batch_change) and waits for the accepted
counts only after launching step N+1's forward; here the host waits for step
N's sampled tokens (a copy enqueued right behind the rejection sampler,
before the drafter's forwards) at the start of step N+1's _update_states. The
host's schedule / update_from_output still overlap step N, and step N+1's
input preparation overlaps step N's drafter; the sampled token itself is then
on the host, so only the drafts are spliced on the device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_anatomy.core.outputs import LogprobsTensors, ModelRunnerOutput
from vllm_anatomy.model_executor.rejection_sampler import RejectionSampler
from vllm_anatomy.worker.async_output import AsyncGPUModelRunnerOutput

if TYPE_CHECKING:
    from vllm_anatomy.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm_anatomy.model_executor.sampler import SamplerOutput
    from vllm_anatomy.spec_decode.draft_model import DraftModelProposer
    from vllm_anatomy.tracing.runner_tracer import RunnerTracer
    from vllm_anatomy.worker.cpu_gpu_buffer import CpuGpuBuffer
    from vllm_anatomy.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm_anatomy.worker.gpu_model_runner import ExecuteModelState


class AsyncSpecDecodeMixin:
    # The runner's state these methods read (made by GPUModelRunner.__init__ and the other mixins).
    input_batch: InputBatch
    requests: dict[str, CachedRequestState]
    tracer: RunnerTracer
    input_ids: CpuGpuBuffer
    max_num_reqs: int
    max_model_len: int
    num_spec_tokens: int
    use_async_scheduling: bool
    async_output_copy_stream: torch.cuda.Stream | None
    prev_async_output: AsyncGPUModelRunnerOutput | None
    _draft_token_ids: list[list[int]] | torch.Tensor | None
    _draft_token_req_ids: list[str] | None

    def _init_async_spec_decode(self, make_buffer) -> None:
        spec = self.speculative_config          # type: ignore[attr-defined]
        self.use_async_spec_decode = bool(self.use_async_scheduling and spec is not None
                                          and spec.uses_draft_model())
        # (destination in input_ids, source in _draft_token_ids) of each draft, for the scatter.
        self.draft_scatter_indices: CpuGpuBuffer | None = \
            make_buffer(2 * self.max_num_reqs * self.num_spec_tokens, torch.int64) if self.use_async_spec_decode \
            else None

    # -- sample_tokens N ---------------------------------------------------------------
    def _bookkeeping_async_spec(self, state: ExecuteModelState,
                                sampler_output: SamplerOutput) -> AsyncGPUSpecDecodeOutput:
        """Enqueue the output's copy, then the next drafts, all without a host wait."""
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        num_reqs = len(req_ids)
        metadata = state.spec_decode_metadata
        output_token_ids = sampler_output.sampled_token_ids            # [R, 1 + K] (-1: rejected) or [R]
        if output_token_ids.dim() == 1:
            output_token_ids = output_token_ids.view(-1, 1)            # a step without drafts
        num_draft_tokens = list(metadata.num_draft_tokens) if metadata is not None else [0] * num_reqs
        output = AsyncGPUSpecDecodeOutput(
            self.tracer, state.scheduler_output.step_id, req_ids, sampler_output, output_token_ids,
            state.discard_request_indices.tolist(), num_draft_tokens,
            metadata.draft_token_ids if metadata is not None else None, self,
            self.async_output_copy_stream, self.tracer.snapshots.take(self),   # type: ignore[arg-type]
            state.error_req_ids, state.prompt_logprobs_dict)
        self.prev_async_output = output
        batch.prev_req_id_to_index = dict(zip(req_ids, range(num_reqs)))
        self._propose_draft_token_ids_padded(state.scheduler_output, output_token_ids,
                                             state.discard_request_indices, num_draft_tokens)
        return output

    def _propose_draft_token_ids_padded(self, scheduler_output: SchedulerOutput, output_token_ids: torch.Tensor,
                                        discard_request_indices: np.ndarray, num_draft_tokens: list[int]) -> None:
        """The draft model over the step's tokens, rejected ones as padding (DraftModelProposer.propose_padded)."""
        batch = self.input_batch
        drafter: DraftModelProposer = self.drafter      # type: ignore[attr-defined]
        num_reqs = batch.num_reqs
        scheduled = scheduler_output.num_scheduled_tokens
        num_scheduled = np.array([scheduled[r] for r in batch.req_ids], dtype=np.int64)
        discard = np.zeros(num_reqs, dtype=bool)
        discard[discard_request_indices] = True
        # (the device phase after the step's sampling; nothing in the step waits for it: the drafts stay on the device)
        with self.tracer.propose_draft_token_ids(scheduler_output.step_id, nothing_waits=True, **{
                "vllm_anatomy.spec_decode_method": "draft_model", "vllm_anatomy.padded_drafter_batch": True}) as span:
            self._draft_token_ids = drafter.propose_padded(
                self.input_ids.gpu, num_scheduled, np.array(num_draft_tokens, dtype=np.int64),
                batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64), output_token_ids, discard, batch)
            forwards = drafter.last_forwards
            span.set_attribute("vllm_anatomy.num_draft_forwards", len(forwards))
            span.set_attribute("vllm_anatomy.num_draft_model_tokens", sum(n for _, n, _ in forwards))
        self._draft_token_req_ids = list(batch.req_ids)

    # -- _update_states N+1 ------------------------------------------------------------
    def correct_spec_decode_token_counts(self, req_data: CachedRequestData) -> None:
        """Step N's tokens into the runner's copies; the requests scheduled again
        (not resumed) get num_computed_tokens less their rejected drafts.

        NOTE: the scheduler sent num_computed_tokens counting step N's drafts as
        accepted (it had not seen step N's output); rows already hold the
        optimistic value (GPUModelRunner._update_cached_request)."""
        prev = self.prev_async_output
        if not isinstance(prev, AsyncGPUSpecDecodeOutput):
            return
        num_rejected = prev.fill_placeholders()
        if not num_rejected:
            return
        batch = self.input_batch
        for req_id in req_data.req_ids:
            correction = num_rejected.get(req_id, 0)
            if not correction or req_id in req_data.resumed_req_ids:
                continue
            state = self.requests.get(req_id)
            if state is None:
                continue
            state.num_computed_tokens -= correction
            row = batch.req_id_to_index.get(req_id)
            if row is not None:
                batch.num_computed_tokens_cpu[row] -= correction
        num_rejected.clear()            # applied once

    # -- _prepare_inputs N+1 -----------------------------------------------------------
    def _prepare_draft_input_ids(self, scheduler_output: SchedulerOutput, cu_num_tokens: np.ndarray) -> None:
        """The -1s of the scheduled drafts -> the drafts proposed after the last step, on the device
        (vLLM: the draft scatter at the end of _prepare_input_ids)."""
        drafts = self._draft_token_ids
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        if not isinstance(drafts, torch.Tensor) or not scheduled_spec:
            return
        batch = self.input_batch
        prev = batch.prev_req_id_to_index or {}
        k = drafts.shape[1]
        dst: list[int] = []
        src: list[int] = []
        for row, req_id in enumerate(batch.req_ids):
            n = len(scheduled_spec.get(req_id, ()))
            prev_index = prev.get(req_id)
            if not n or prev_index is None:
                continue
            end = int(cu_num_tokens[row])
            dst.extend(range(end - n, end))
            src.extend(range(prev_index * k, prev_index * k + n))
        # NOTE: AsyncScheduler gives drafts only to requests of the previous step,
        # which the drafter has just proposed for; a -1 left would be an embedding error.
        assert len(dst) == sum(len(s) for r, s in scheduled_spec.items() if r in batch.req_id_to_index), \
            "a scheduled draft has no proposal on the device"
        if not dst:
            return
        buf = self.draft_scatter_indices
        assert buf is not None
        n = len(dst)
        buf.np[:n] = dst
        buf.np[n:2 * n] = src
        indices = buf.copy_to_gpu(2 * n)
        self.input_ids.gpu.index_copy_(0, indices[:n], drafts.reshape(-1).index_select(0, indices[n:]).long())


class AsyncGPUSpecDecodeOutput(AsyncGPUModelRunnerOutput):
    """An async step's output with drafts: [R, 1 + K] verified tokens (and the drafts they
    verified) copied to the host on the copy stream; parsed once, by whichever comes first:
    the next step's _update_states (fill_placeholders) or the engine (get_output)."""

    def __init__(self, tracer: RunnerTracer, step_id: int, req_ids: list[str], sampler_output: SamplerOutput,
                 output_token_ids: torch.Tensor, invalid_req_indices: list[int], num_draft_tokens: list[int],
                 draft_token_ids: torch.Tensor | None, runner: AsyncSpecDecodeMixin,
                 copy_stream: torch.cuda.Stream | None, snapshot: dict | None,
                 error_req_ids: list[str] | None = None,
                 prompt_logprobs_dict: dict[str, LogprobsTensors | None] | None = None) -> None:
        self._output_token_ids = output_token_ids
        self._draft_token_ids_flat = draft_token_ids
        self._num_draft_tokens = num_draft_tokens
        self._runner = runner
        self._vocab_size = runner.input_batch.vocab_size
        self._parsed: tuple[list[list[int]], list[list[bool]]] | None = None
        self._num_rejected: dict[str, int] | None = None
        super().__init__(tracer, step_id, req_ids, sampler_output, invalid_req_indices,
                         None, copy_stream, snapshot, error_req_ids, prompt_logprobs_dict)  # type: ignore[arg-type]

    def _tensors_to_copy(self, sampler_output: SamplerOutput) -> tuple[torch.Tensor, ...]:
        """[R, 1 + K] tokens, the flat drafts verified (or an empty tensor), the logprob tensors."""
        drafts = self._draft_token_ids_flat
        if drafts is None:
            drafts = self._output_token_ids.new_empty(0)
        return (self._output_token_ids, drafts, *(sampler_output.logprobs_tensors or ())[:3])

    def _parse(self) -> tuple[list[list[int]], list[list[bool]]]:
        """The host copy, parsed once. NOTE: a plain wait, not the tracer's: the
        next step's _update_states (fill_placeholders) usually comes first, outside
        this step's sync point; get_output's tracer.wait resolves the step's device
        spans (as AsyncGPUModelRunnerOutput's, after its own fill_placeholders)."""
        if self._parsed is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._parsed = RejectionSampler.parse_output(self._host[0].tolist(), self._vocab_size,
                                                         self._invalid_req_indices)
        return self._parsed

    def fill_placeholders(self) -> dict[str, int]:   # type: ignore[override]
        """Wait for the copy; append each row's tokens to the runner's copies (once).
        Returns req_id -> drafts rejected (the next step's correction)."""
        if self._num_rejected is not None:
            return self._num_rejected
        valid, _ = self._parse()
        runner = self._runner
        batch, requests, index = runner.input_batch, runner.requests, runner.input_batch.req_id_to_index
        self._num_rejected = {}
        for req_id, tokens, n in zip(self._req_ids, valid, self._num_draft_tokens):
            state = requests.get(req_id)
            if state is None or not tokens:
                continue                   # finished meanwhile, or a partial prefill chunk
            state.output_token_ids.extend(tokens)
            row = index.get(req_id)
            if row is not None:
                start = int(batch.num_tokens_no_spec[row])
                end = min(start + len(tokens), runner.max_model_len)
                batch.token_ids_cpu[row, start:end] = tokens[:end - start]
                batch.num_tokens_no_spec[row] = end
            if n:
                self._num_rejected[req_id] = n - (len(tokens) - 1)
        return self._num_rejected

    def get_output(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        tracer = self._tracer
        with tracer.sync_point("AsyncGPUModelRunnerOutput.get_output", self._step_id, self._timer_events,
                               **{"vllm_anatomy.step_id": self._step_id}):
            if self._ready is not None:
                tracer.wait(self._ready)            # (after fill_placeholders' wait: returns at once)
            valid, keep = self._parse()
            self._device_tensors = ()          # copied: the device memory may go
            self.sync_wait_s = tracer.wait_s
            logprobs = None
            if self._has_logprobs:
                logprobs = self._runner._spec_logprobs(  # type: ignore[attr-defined]
                    keep, LogprobsTensors(*self._host[2:5]))  # type: ignore[arg-type]
            verified = None
            if self._draft_token_ids_flat is not None:
                flat = self._host[1].tolist()
                cu = np.cumsum([0, *self._num_draft_tokens]).tolist()
                verified = [flat[cu[i]:cu[i + 1]] for i in range(len(self._req_ids))]
            req_ids = self._req_ids
            self._output = ModelRunnerOutput(
                req_ids=list(req_ids), req_id_to_index=dict(zip(req_ids, range(len(req_ids)))),
                sampled_token_ids=[list(t) for t in valid], logprobs=logprobs,
                prompt_logprobs_dict=self._prompt_logprobs_dict or {}, error_req_ids=self._error_req_ids,
                verified_draft_token_ids=verified)
        tracer.snapshots.record(self._step_id, self._output.sampled_token_ids, snapshot=self._snapshot)
        return self._output
