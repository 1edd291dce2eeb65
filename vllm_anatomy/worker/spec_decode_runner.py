"""What speculative decoding adds to the model runner: drafts in, verified tokens and new drafts out.

Mirrors the spec-decode paths of vllm/v1/worker/gpu_model_runner.py
(_calc_spec_decode_metadata, the rejection sampler in _sample, the
multi-token branch of _bookkeeping_sync, propose_draft_token_ids,
take_draft_token_ids) and InputBatch.update_req_spec_token_ids. A mixin of
GPUModelRunner, like worker/async_output.py, so that gpu_model_runner.py reads
as plain decoding with one hook per stage:

    _update_states      the scheduled drafts go into token_ids_cpu after each
                        request's known tokens, so _prepare_inputs reads them as
                        input ids like any other token
    _prepare_inputs     SpecDecodeMetadata: logits at every draft position and
                        one after the last (_calc_spec_decode_metadata)
    sample_tokens       RejectionSampler instead of the Sampler (_sample_with_drafts);
                        1 to k + 1 tokens per request come back (_bookkeeping_sync_spec)
    after bookkeeping   the drafter proposes the next step's drafts
                        (propose_draft_token_ids); EngineCore collects them with
                        take_draft_token_ids for Scheduler.update_draft_token_ids

Nothing is rolled back here: the scheduler sends each request's corrected
num_computed_tokens next step, and the rejected drafts' KV is overwritten
then. Without speculative_config none of this runs (drafter None).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from vllm_anatomy.core.outputs import DraftTokenIds, LogprobsLists, LogprobsTensors, ModelRunnerOutput
from vllm_anatomy.model_executor.rejection_sampler import RejectionSampler
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata
from vllm_anatomy.spec_decode.metadata import SpecDecodeMetadata

if TYPE_CHECKING:
    from vllm_anatomy.attention.backends.abstract import AttentionMetadata
    from vllm_anatomy.config import CompilationConfig, VllmConfig
    from vllm_anatomy.core.sched.output import SchedulerOutput
    from vllm_anatomy.model_executor.sampler import Sampler, SamplerOutput
    from vllm_anatomy.spec_decode.draft_model import DraftModelProposer
    from vllm_anatomy.spec_decode.ngram_proposer import NgramProposer
    from vllm_anatomy.tracing.runner_tracer import RunnerTracer
    from vllm_anatomy.worker.cpu_gpu_buffer import CpuGpuBuffer
    from vllm_anatomy.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm_anatomy.worker.gpu_model_runner import ExecuteModelState


class SpecDecodeRunnerMixin:
    # The runner's state these methods read (made by GPUModelRunner.__init__).
    vllm_config: VllmConfig
    device: torch.device
    attn_backend_name: str
    input_batch: InputBatch
    requests: dict[str, CachedRequestState]
    sampler: Sampler
    tracer: RunnerTracer
    arange_np: np.ndarray
    max_model_len: int
    max_num_reqs: int
    pin_memory: bool
    transfer_event: torch.cuda.Event | None
    input_ids: CpuGpuBuffer
    use_async_spec_decode: bool
    _get_cumsum_and_arange: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    _dummy_step_inputs: Callable[[int, int], int]
    _dummy_attn_metadata: Callable[[int, int, int], AttentionMetadata]

    def _init_spec_decode(self) -> None:
        spec = self.vllm_config.speculative_config
        self.speculative_config = spec
        self.drafter: NgramProposer | DraftModelProposer | None = None
        self.rejection_sampler: RejectionSampler | None = None
        self.num_spec_tokens = spec.num_speculative_tokens if spec else 0
        # The drafts proposed after the last step, by row, until take_draft_token_ids.
        # (async scheduling: a device tensor [R, K], worker/async_spec_decode.py)
        self._draft_token_ids: list[list[int]] | torch.Tensor | None = None
        self._draft_token_req_ids: list[str] | None = None
        if spec is None:
            return
        if spec.use_ngram():
            from vllm_anatomy.spec_decode.ngram_proposer import NgramProposer
            self.drafter = NgramProposer(self.vllm_config)
        else:
            from vllm_anatomy.spec_decode.draft_model import DraftModelProposer
            # (its forwards and kernels are timed as the target's: the tracer's kernel timer, null below full)
            self.drafter = DraftModelProposer(self.vllm_config, self.device, self.attn_backend_name,
                                              kernel_timer=self.tracer.kernel_timer)
        self.rejection_sampler = RejectionSampler(self.sampler)
        # Pinned host rows for the [R, k + 1] verified tokens (the step's one wait).
        self.spec_output_pinned_cpu = torch.zeros(self.max_num_reqs * (self.num_spec_tokens + 1),
                                                  dtype=torch.int32, pin_memory=self.pin_memory)

    def _warm_up_rejection_sampler(self) -> None:
        """Compile the rejection sampler's Triton kernels at start-up, not in the first
        request's step: an all-greedy batch (is_greedy None) and a mixed one (vLLM's
        dummy sampler run does the same with spec-decode metadata)."""
        if self.rejection_sampler is None:
            return
        k, vocab = self.num_spec_tokens, self.input_batch.vocab_size
        metadata = SpecDecodeMetadata.make_dummy([[0] * k, [1] * k], self.device)
        logits = torch.zeros(2 * (k + 1), vocab, device=self.device)
        for temperature in (None, torch.tensor([0.0, 1.0], device=self.device)):
            sampling_metadata = SamplingMetadata(temperature=temperature, all_greedy=temperature is None,
                                                 all_random=False, top_p=None, top_k=None, min_p=None,
                                                 generators={}, max_num_logprobs=None)
            self.rejection_sampler(metadata, None, logits, sampling_metadata)

    def _init_drafter_cudagraphs(self, compilation_config: CompilationConfig) -> None:
        """The draft model's own dispatcher, over the target's resolved capture sizes."""
        drafter = self.spec_decode_kv_cache()
        if drafter is not None:
            drafter.initialize_cudagraph_keys(compilation_config)

    def _capture_drafter_model(self) -> None:
        """Capture the draft model's piecewise graphs, after the target's (vLLM: the drafter's
        dummy_run inside capture_model). Each size's dummy metadata is the target's dummy
        step (slot -1 everywhere: nothing is written) over the drafter's own slot buffer."""
        drafter = self.spec_decode_kv_cache()
        if drafter is None:
            return

        def dummy_metadata(size: int) -> AttentionMetadata:
            query_len = min(size, self.max_model_len)
            num_reqs = self._dummy_step_inputs(size, query_len)
            return self._dummy_attn_metadata(num_reqs, size, query_len)
        drafter.capture_model(dummy_metadata)

    # -- _update_states ----------------------------------------------------------------
    def _update_spec_token_ids(self, scheduler_output: SchedulerOutput) -> None:
        """Each scheduled draft into token_ids_cpu, after the request's known tokens, and
        into input_batch.spec_token_ids, per row (vLLM: InputBatch.update_req_spec_token_ids;
        the rejection sampler's penalties and bad words read them). NOTE: after
        condense(), so the rows are final; num_tokens_no_spec does not move: they are
        not tokens yet."""
        batch = self.input_batch
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        if not scheduled_spec:
            batch.spec_token_ids = None
            return
        spec_token_ids_by_row: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        for req_id, spec_token_ids in scheduled_spec.items():
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                continue                    # failed to join the batch
            start = int(batch.num_tokens_no_spec[row])
            batch.token_ids_cpu[row, start:start + len(spec_token_ids)] = spec_token_ids
            spec_token_ids_by_row[row] = spec_token_ids
        batch.spec_token_ids = spec_token_ids_by_row

    # -- _prepare_inputs ---------------------------------------------------------------
    def _calc_spec_decode_metadata(self, scheduler_output: SchedulerOutput,
                                   cu_num_scheduled_tokens: np.ndarray) -> SpecDecodeMetadata | None:
        """Which flat tokens get logits (every draft position and the one after), and
        where each request's drafts sit. None when no request has drafts this step.

            cu_num_scheduled_tokens  [  4, 104, 107, 207, 209]
            num_draft_tokens         [  3,   0,   2,   0,   1]
            logits_indices           [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
            target_logits_indices    [0, 1, 2, 5, 6, 9]     bonus_logits_indices [3, 4, 7, 8, 10]
        """
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        if not scheduled_spec:
            return None
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_draft_tokens = np.zeros(num_reqs, dtype=np.int32)
        for req_id, draft_token_ids in scheduled_spec.items():
            row = batch.req_id_to_index.get(req_id)
            if row is not None:
                num_draft_tokens[row] = len(draft_token_ids)
        num_sampled_tokens = num_draft_tokens + 1                                       # [R]
        # Each request's last num_sampled tokens get logits: [0, 1, 2, 3, 103, 104, ...].
        cu_num_sampled_tokens, sampled_arange = self._get_cumsum_and_arange(num_sampled_tokens)
        logits_indices = np.repeat(cu_num_scheduled_tokens - num_sampled_tokens, num_sampled_tokens) + sampled_arange
        # Rows of logits[logits_indices]: each request's last row is its bonus row,
        # the rows before it verify its drafts.
        bonus_logits_indices = cu_num_sampled_tokens - 1
        cu_num_draft_tokens, draft_arange = self._get_cumsum_and_arange(num_draft_tokens)
        target_logits_indices = np.repeat(cu_num_sampled_tokens - num_sampled_tokens, num_draft_tokens) + draft_arange
        # The drafts themselves: the input token right after each verifying row's token.
        draft_indices = logits_indices[target_logits_indices] + 1

        def to_device(a: np.ndarray, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype, non_blocking=True)

        if self.use_async_spec_decode:
            # (async scheduling: the host has -1s there; the drafts are on the device)
            drafts = self.input_ids.gpu[to_device(draft_indices, torch.int64)].int()
        else:
            drafts = to_device(self.input_ids.np[draft_indices])
        return SpecDecodeMetadata(
            draft_token_ids=drafts, num_draft_tokens=num_draft_tokens.tolist(),
            cu_num_draft_tokens=to_device(cu_num_draft_tokens), cu_num_sampled_tokens=to_device(cu_num_sampled_tokens),
            target_logits_indices=to_device(target_logits_indices), bonus_logits_indices=to_device(bonus_logits_indices),
            logits_indices=to_device(logits_indices, torch.int64))

    @staticmethod
    def record_spec_decode_inputs(prepare_inputs: dict | None, metadata: SpecDecodeMetadata) -> None:
        """The step snapshot's logits_indices are every sampled position, and it says how many drafts each row has."""
        if prepare_inputs is not None:
            prepare_inputs["logits_indices"] = metadata.logits_indices.tolist()
            prepare_inputs["num_draft_tokens"] = list(metadata.num_draft_tokens)

    # -- sample_tokens -----------------------------------------------------------------
    def _sample_with_drafts(self, logits: torch.Tensor, metadata: SpecDecodeMetadata) -> SamplerOutput:
        """The RejectionSampler over the step's logits (one row per draft, one bonus row per request)."""
        assert self.rejection_sampler is not None
        sampling_metadata = self.input_batch.sampling_metadata
        assert sampling_metadata is not None
        if self.use_async_spec_decode and (not sampling_metadata.no_penalties or sampling_metadata.bad_words_token_ids):
            # NOTE: async scheduling: the host holds -1s for the drafts; penalties and bad
            # words read their values: wait for them here, in the batches that need them
            # (the trade of AsyncSchedulingMixin.update_async_output_token_ids).
            flat = metadata.draft_token_ids.tolist()
            cu = np.cumsum([0, *metadata.num_draft_tokens]).tolist()
            sampling_metadata.spec_token_ids = [flat[cu[i]:cu[i + 1]] for i in range(len(metadata.num_draft_tokens))]
        return self.rejection_sampler(metadata, None, logits, sampling_metadata,
                                      min_tokens_remaining=self._min_tokens_remaining())

    def _min_tokens_remaining(self) -> dict[int, tuple[int, list[int]]]:
        """row -> (outputs still to come before a stop token may, its stop ids), for rows below min_tokens."""
        batch = self.input_batch
        out = {}
        for req_id, (min_tokens, stop_ids) in batch.min_tokens.items():
            row = batch.req_id_to_index[req_id]
            remaining = min_tokens - int(batch.num_tokens_no_spec[row] - batch.num_prompt_tokens[row])
            if remaining > 0:
                out[row] = (remaining, stop_ids)
        return out

    def _bookkeeping_sync_spec(self, state: ExecuteModelState, sampler_output: SamplerOutput) -> ModelRunnerOutput:
        """_bookkeeping_sync with 1 to k + 1 tokens per row: the verified tokens on the host
        (the step's one wait), appended to the runner's token copies; then the next drafts."""
        logprobs_tensors = sampler_output.logprobs_tensors
        self.tracer.device_mark("d2h")
        host_logprobs = logprobs_tensors.to_cpu_nonblocking() if logprobs_tensors is not None else None
        output = sampler_output.sampled_token_ids                                      # [R, k + 1]
        rows = self._spec_to_list(output)
        discard = state.discard_request_indices.tolist()
        valid, keep = RejectionSampler.parse_output(rows, self.input_batch.vocab_size, discard)
        req_ids = list(self.input_batch.req_ids)
        self.cache_sampled_token_lists(req_ids, valid)
        logprobs = self._spec_logprobs(keep, host_logprobs) if host_logprobs is not None else None
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index=dict(zip(req_ids, range(len(req_ids)))),
                                 sampled_token_ids=valid, logprobs=logprobs, error_req_ids=state.error_req_ids)

    def _spec_to_list(self, output_token_ids: torch.Tensor) -> list[list[int]]:
        """[R, W] on the host, through pinned memory and an event (as GPUModelRunner._to_list)."""
        if self.transfer_event is None:
            return output_token_ids.tolist()
        pinned = self.spec_output_pinned_cpu[:output_token_ids.numel()].view(output_token_ids.shape)
        pinned.copy_(output_token_ids, non_blocking=True)
        self.tracer.device_mark("end")
        self.transfer_event.record()
        self.tracer.wait(self.transfer_event)
        return pinned.tolist()

    def cache_sampled_token_lists(self, req_ids: list[str], valid: list[list[int]]) -> None:
        """Append each row's verified tokens to the runner's own token copies (cache_sampled_tokens, several per row)."""
        batch = self.input_batch
        for row, tokens in enumerate(valid):
            if not tokens:
                continue
            start = int(batch.num_tokens_no_spec[row])
            end = start + len(tokens)
            assert end <= self.max_model_len, "past max_model_len"
            batch.token_ids_cpu[row, start:end] = tokens
            batch.num_tokens_no_spec[row] = end
            self.requests[req_ids[row]].output_token_ids.extend(tokens)

    def _spec_logprobs(self, keep: list[list[bool]], host_logprobs: LogprobsTensors) -> LogprobsLists:
        """The step's logprobs as v0.27.1 carries them: one batched LogprobsLists whose rows
        are the kept positions of [R, k + 1] (row-major; the rejection sampler computed one for
        every position), request i's rows starting at cu_num_generated_tokens[i]."""
        width = len(keep[0]) if keep else 0
        flat = [i * width + j for i, row in enumerate(keep) for j, kept in enumerate(row) if kept]
        cu_num_generated_tokens = [0]
        for row in keep:
            cu_num_generated_tokens.append(cu_num_generated_tokens[-1] + sum(row))
        lists = host_logprobs.tolists()                   # (host tensors: the copy has landed by now)
        return LogprobsLists(lists.logprob_token_ids[flat], lists.logprobs[flat], lists.sampled_token_ranks[flat],
                             cu_num_generated_tokens[:-1])

    # -- after bookkeeping: the next drafts ----------------------------------------------
    def propose_draft_token_ids(self, scheduler_output: SchedulerOutput, sampled_token_ids: list[list[int]],
                                spec_decode_metadata: SpecDecodeMetadata | None) -> None:
        """The drafter's proposals for the next step, kept until take_draft_token_ids.

        NOTE: both drafters read the tokens on the host, after bookkeeping
        (token_ids_cpu then holds the accepted tokens): ngram searches them,
        the draft model feeds them to its first pass."""
        if self.drafter is None:
            return
        batch = self.input_batch
        num_reqs = batch.num_reqs
        attrs = {"vllm_anatomy.spec_decode_method": self.speculative_config.method}    # type: ignore[union-attr]
        from vllm_anatomy.spec_decode.ngram_proposer import NgramProposer
        if isinstance(self.drafter, NgramProposer):             # (on the host: no device work)
            with self.tracer.span("GPUModelRunner.propose_draft_token_ids", **attrs):
                drafts = self.drafter.propose(self.num_spec_tokens, sampled_token_ids, batch.num_tokens_no_spec,
                                              batch.token_ids_cpu)
        else:
            # (the device phase after the step's sampling; the step waits for it: the drafts are read on the host)
            with self.tracer.propose_draft_token_ids(scheduler_output.step_id, nothing_waits=False, **attrs) as span:
                scheduled = scheduler_output.num_scheduled_tokens
                num_scheduled = np.array([scheduled[r] for r in batch.req_ids], dtype=np.int64)
                num_draft = np.array(spec_decode_metadata.num_draft_tokens if spec_decode_metadata
                                     else [0] * num_reqs, dtype=np.int64)
                drafts = self.drafter.propose(sampled_token_ids, num_scheduled, num_draft, batch)
                forwards = self.drafter.last_forwards
                span.set_attribute("vllm_anatomy.num_draft_forwards", len(forwards))
                span.set_attribute("vllm_anatomy.num_draft_model_tokens", sum(n for _, n, _ in forwards))
                span.set_attribute("vllm_anatomy.draft_cudagraph_modes",
                                   [f"{mode.name} {n}->{padded}" for mode, n, padded in forwards])
        self._draft_token_ids = drafts
        self._draft_token_req_ids = list(batch.req_ids)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The last step's drafts, once (EngineCore.post_step hands them to the scheduler).

        Async scheduling: the drafts stay on the device (the scheduler sent -1
        placeholders); EngineCore asks for a host copy only for a step with
        structured-output requests, to check them against the grammars before
        the bitmask (v0.27.1: _copy_draft_token_ids_to_cpu). They stay there for
        the step that splices them in (already launched by then).
        NOTE (simplified): v0.27.1 copies them on a side stream right after the
        drafter and waits on that copy's event; here .tolist() waits for the device."""
        if isinstance(self._draft_token_ids, torch.Tensor) and self._draft_token_req_ids is not None:
            num_reqs = len(self._draft_token_req_ids)
            return DraftTokenIds(list(self._draft_token_req_ids), self._draft_token_ids[:num_reqs].tolist())
        if not isinstance(self._draft_token_ids, list) or self._draft_token_req_ids is None:
            return None     # none
        drafts = DraftTokenIds(self._draft_token_req_ids, self._draft_token_ids)
        self._draft_token_ids = self._draft_token_req_ids = None
        return drafts

    def spec_decode_kv_cache(self) -> Any:
        """The draft model proposer, if it keeps a KV cache (None for ngram / no spec decode)."""
        from vllm_anatomy.spec_decode.draft_model import DraftModelProposer
        return self.drafter if isinstance(self.drafter, DraftModelProposer) else None
