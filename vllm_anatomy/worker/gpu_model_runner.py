"""GPUModelRunner: one SchedulerOutput in, one forward pass and one sampled token per request out.

Mirrors vllm/v1/worker/gpu_model_runner.py — the "V1" runner with the
persistent InputBatch that the article follows. A step is two calls:

    execute_model(scheduler_output) -> None   (EMPTY_MODEL_RUNNER_OUTPUT if nothing is scheduled)
        _update_states   mirror the scheduler's decisions into CachedRequestState / InputBatch
        _prepare_inputs  flatten the batch: input_ids, positions, query_start_loc,
                         seq_lens, slot_mapping (the "translation layer" of the article)
        _model_forward   the model on the flat batch, writing K/V into the paged cache
        compute_logits   only at logits_indices (the last scheduled token of each request)
    sample_tokens(grammar_output) -> ModelRunnerOutput
        apply_grammar_bitmask (structured output), Sampler, then _bookkeeping_sync:
        the step's one CPU-waits-for-device point.

NOTE: execute_model returns None. On a GPU everything it did was only
*enqueued*; returning lets the caller (EngineCore) do CPU work — the
structured-output grammar bitmask — while the device runs the forward pass.

CUDA graphs (worker/cudagraph.py): a batch of pure decodes (with speculative
decoding: every request verifying its K drafts, 1 + K tokens each) is padded to
the next captured size and replays that size's full graph instead of launching
the forward kernel by kernel; any other batch up to the largest size replays
graph pieces with attention run eager in between (FULL_AND_PIECEWISE); larger
ones run eager.

Async scheduling (`async_scheduling`): sample_tokens does not wait. It
returns an AsyncGPUModelRunnerOutput whose get_output() the engine calls one
step later, keeps the sampled ids on the device
(`input_batch.prev_sampled_token_ids`), and the next step's _prepare_inputs
splices them into input_ids there: the host only ever holds -1 placeholders
for them until the output arrives. What async scheduling adds to the runner
(_bookkeeping_async, _splice_prev_sampled, synchronize_input_prep) is
worker/async_output.py, another mixin of this class.

Start-up (load, KV-cache sizing, warm-up, graph capture) is
worker/model_runner_startup.py, a mixin of this class. What the runner
reports to the trace goes through one object, `self.tracer`
(tracing/runner_tracer.py): the runner computes the same things at every
trace level.

A request that fails while joining the batch (building its CachedRequestState,
its generator, its InputBatch row and sampling state) fails alone: it leaves
the batch, the step runs for the others, and ModelRunnerOutput.error_req_ids
tells EngineCore to finish it with FINISHED_ERROR (see _update_states). What
runs for the whole batch at once (prepare_inputs, the forward, the sampler)
cannot say which request broke it: an error there is the engine's.

Speculative decoding (worker/spec_decode_runner.py, a mixin as well): the
scheduled drafts join the input ids, logits come for every draft position,
the RejectionSampler replaces the Sampler, 1 to k + 1 tokens per request come
back, and the drafter proposes the next drafts after the bookkeeping.

Simplified here: no LoRA, multimodal, pooling or pipeline parallelism.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from vllm_anatomy import envs
from vllm_anatomy.attention.backends.abstract import AttentionMetadata
from vllm_anatomy.attention.backends.decode_order import DecodeSeqOrder
from vllm_anatomy.config import VllmConfig
from vllm_anatomy.core.outputs import (EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, LogprobsTensors,
                                      ModelRunnerOutput)
from vllm_anatomy.core.sched.output import CachedRequestData, GrammarOutput, SchedulerOutput
from vllm_anatomy.model_executor.loader import load_hf_config
from vllm_anatomy.model_executor.sampler import Sampler, SamplerOutput
from vllm_anatomy.structured_output.utils import apply_grammar_bitmask
from vllm_anatomy.tracing.recorder import NullRecorder, Recorder
from vllm_anatomy.tracing.runner_tracer import RunnerTracer
from vllm_anatomy.worker.async_output import AsyncSchedulingMixin
from vllm_anatomy.worker.async_spec_decode import AsyncSpecDecodeMixin
from vllm_anatomy.worker.cpu_gpu_buffer import CpuGpuBuffer
from vllm_anatomy.worker.cudagraph import (BatchDescriptor, CUDAGraphMode, CUDAGraphRunner, CudagraphDecision,
                                           CudagraphDispatcher, is_uniform_decode)
from vllm_anatomy.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm_anatomy.worker.model_runner_startup import ModelRunnerStartupMixin
from vllm_anatomy.worker.prompt_logprobs import PromptLogprobsMixin
from vllm_anatomy.worker.runner_output import make_model_runner_output
from vllm_anatomy.worker.spec_decode_runner import SpecDecodeRunnerMixin
from vllm_anatomy.spec_decode.metadata import SpecDecodeMetadata

logger = logging.getLogger(__name__)


class ExecuteModelState(NamedTuple):
    """What execute_model leaves for sample_tokens."""
    scheduler_output: SchedulerOutput
    logits: torch.Tensor | None          # [R, V] in the model's dtype (the Sampler upcasts); None: no tokens
    discard_request_indices: np.ndarray  # rows whose sampled token is thrown away
    error_req_ids: list[str] | None = None  # requests that failed to join the batch this step
    spec_decode_metadata: SpecDecodeMetadata | None = None   # the step's drafts (spec decode)
    # Prompt logprobs of the requests whose prompt completed this step (prompt_logprobs).
    prompt_logprobs_dict: dict[str, LogprobsTensors | None] | None = None


class GPUModelRunner(ModelRunnerStartupMixin, AsyncSchedulingMixin, SpecDecodeRunnerMixin, AsyncSpecDecodeMixin,
                     PromptLogprobsMixin):

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str,
                 recorder: Recorder = NullRecorder(), attn_backend: str | None = None) -> None:
        self.vllm_config = vllm_config
        self.model_config = model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.scheduler_config = scheduler_config = vllm_config.scheduler_config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        on_cuda = self.device.type == "cuda"
        self.attn_backend_name = attn_backend or model_config.attention_backend
        self.pin_memory = on_cuda
        self.max_model_len = model_config.max_model_len
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.block_size = self.cache_config.block_size
        if not model_config.hf_config:
            model_config.hf_config = load_hf_config(model_config.model)
        self.tracer = RunnerTracer(recorder, self.device)

        self.requests: dict[str, CachedRequestState] = {}
        # Requests that failed in this runner -> why; kept until the scheduler
        # lists them as finished (with async scheduling it may schedule them
        # once more before it hears of the failure).
        self.failed_req_ids: dict[str, str] = {}
        self._step_error_req_ids: list[str] = []
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_num_tokens,
                                      self.device, self.pin_memory, model_config.hf_config["vocab_size"],
                                      self.block_size)
        self.sampler = Sampler()
        self._init_spec_decode()         # drafter and rejection sampler, with speculative_config
        # self.model: made by load_model (worker/model_runner_startup.py)
        self.kv_caches: list[torch.Tensor] = []
        self.execute_model_state: ExecuteModelState | None = None
        # What _prepare_inputs computed, for the step's snapshot (None below trace level full).
        self.last_prepare_inputs: dict | None = None
        self.discard_request_indices = np.empty(0, dtype=np.int64)
        self.use_async_scheduling = scheduler_config.async_scheduling
        self._init_prompt_logprobs()
        self._init_step_buffers(on_cuda)
        self._init_async_spec_decode(self._make_buffer)     # async scheduling + a draft model only
        self._init_cudagraphs(vllm_config.compilation_config, on_cuda)

    def _init_step_buffers(self, on_cuda: bool) -> None:
        """Persistent buffers, reused every step (a CUDA graph replays on their addresses)."""
        self.input_ids = self._make_buffer(self.max_num_tokens, dtype=torch.int64)
        self.positions = self._make_buffer(self.max_num_tokens, dtype=torch.int64)
        self.query_start_loc = self._make_buffer(self.max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = self._make_buffer(self.max_num_reqs, dtype=torch.int32)
        self.arange_np = np.arange(max(self.max_num_reqs + 1, self.max_model_len, self.max_num_tokens),
                                   dtype=np.int64)
        # [R, 1]: one sampled token per request (vLLM: [R, 1 + drafts] with spec decode).
        self.sampled_token_ids_pinned_cpu = torch.zeros((self.max_num_reqs, 1), dtype=torch.int64,
                                                        pin_memory=self.pin_memory)
        self.transfer_event = torch.cuda.Event() if on_cuda else None
        # Async scheduling: (destination in input_ids, source row of
        # prev_sampled_token_ids) for the splice, the event that says this
        # step's host-to-device copies are done (see synchronize_input_prep),
        # and the stream the sampled ids go to the host on (worker/async_output.py).
        self.splice_indices = self._make_buffer(2 * self.max_num_reqs, dtype=torch.int64)
        self.prepare_inputs_event = torch.cuda.Event() if on_cuda else None
        # The Triton backend's decode order (attention/backends/decode_order.py), behind
        # VLLM_ANATOMY_DECODE_LPT (read here, once); None: batch order.
        self.decode_seq_order = DecodeSeqOrder(self.max_num_reqs, self.device, self.pin_memory) \
            if self.attn_backend_name == "triton" and envs.VLLM_ANATOMY_DECODE_LPT else None
        self.async_output_copy_stream = torch.cuda.Stream(self.device) \
            if on_cuda and self.use_async_scheduling else None

    def _init_cudagraphs(self, compilation_config, on_cuda: bool) -> None:
        # NOTE: only on a GPU, and only with kernels that read nothing on the
        # host (the torch reference backend loops over requests in Python).
        if not on_cuda or self.attn_backend_name != "triton":
            compilation_config = type(compilation_config)("NONE", [], 0)
        # A decode step is uniform when every request has 1 + K tokens (K drafts: a verify step).
        self.uniform_decode_query_len = 1 + self.num_spec_tokens
        compilation_config.adjust_cudagraph_sizes_for_spec_decode(self.uniform_decode_query_len)
        self.cudagraph_dispatcher = CudagraphDispatcher(compilation_config, self.max_num_reqs,
                                                        self.uniform_decode_query_len)
        self._init_drafter_cudagraphs(compilation_config)      # speculative decoding's draft model only
        if self.attn_backend_name == "triton":
            # vLLM's TritonAttentionMetadataBuilder snaps the split-KV threshold to a
            # capture size, so a padded decode graph replays the path its batch would take.
            from vllm_anatomy.attention.backends import triton_attn
            triton_attn.set_cudagraph_capture_sizes(
                compilation_config.cudagraph_capture_sizes if self.cudagraph_dispatcher.decode_sizes else [])
        self.cudagraph_runner = CUDAGraphRunner()       # empty unless capture_model fills it
        self.cudagraph_decision: CudagraphDecision | None = None

    def _make_buffer(self, n: int, dtype: torch.dtype) -> CpuGpuBuffer:
        return CpuGpuBuffer(n, dtype=dtype, device=self.device, pin_memory=self.pin_memory)

    # -- one step: execute_model -------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.execute_model_state is not None:
            raise RuntimeError("execute_model called again before sample_tokens consumed the previous step")
        tracer = self.tracer
        num_tokens = scheduler_output.total_num_scheduled_tokens
        self.last_prepare_inputs = None
        with tracer.execute_model(scheduler_output):
            with self.synchronize_input_prep():
                with tracer.span("GPUModelRunner._update_states"):
                    self._update_states(scheduler_output)
                error_req_ids = self._take_step_errors()
                if not num_tokens:
                    # Nothing scheduled (e.g. every request finished): no forward, nothing
                    # to sample. As in vLLM, the engine then skips sample_tokens.
                    return self._empty_output(scheduler_output.step_id, error_req_ids)
                if not self.input_batch.num_reqs:
                    # Every scheduled request failed to join the batch: sample_tokens reports them.
                    self.execute_model_state = ExecuteModelState(scheduler_output, None, np.empty(0, np.int64),
                                                                 error_req_ids)
                    return None
                # (device phase: the host-to-device copies of the step's inputs)
                with tracer.phase("GPUModelRunner._prepare_inputs", "prepare_inputs"):
                    num_reqs = self.input_batch.num_reqs
                    num_scheduled_tokens_np = self._num_scheduled_tokens(scheduler_output)         # [R]
                    max_num_scheduled_tokens = int(num_scheduled_tokens_np.max())
                    logits_indices, spec_decode_metadata = self._prepare_inputs(scheduler_output,
                                                                                num_scheduled_tokens_np)
                    num_tokens_unpadded = int(num_scheduled_tokens_np.sum())
                    cudagraph_mode, batch_desc, _, _, _ = self._determine_batch_execution_and_padding(
                        num_tokens_unpadded, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                        use_cascade_attn=False)
                    attn_metadata = self._attn_metadata(num_reqs, num_tokens_unpadded, max_num_scheduled_tokens)
            decision = self.cudagraph_decision
            assert decision is not None              # made by _determine_batch_execution_and_padding
            with tracer.model_forward(decision):
                if cudagraph_mode is CUDAGraphMode.FULL:
                    hidden_states = self.cudagraph_runner.replay(batch_desc.num_tokens)               # [N, H]
                elif cudagraph_mode is CUDAGraphMode.PIECEWISE:
                    hidden_states = self.cudagraph_runner.replay_piecewise(batch_desc.num_tokens,
                                                                           attn_metadata)             # [N, H]
                else:
                    hidden_states = self._model_forward(num_tokens_unpadded, attn_metadata)             # [T, H]
            # Prompt logprobs (requests that asked for them): from every prompt position's hidden state.
            prompt_logprobs_dict = self._get_prompt_logprobs_dict(hidden_states[:num_tokens_unpadded],
                                                                  scheduler_output.num_scheduled_tokens)
            with tracer.phase("GPUModelRunner.compute_logits", "compute_logits"):
                logits = self.model.compute_logits(hidden_states[logits_indices])  # [R, V]
            self.execute_model_state = ExecuteModelState(scheduler_output, logits,
                                                         self.discard_request_indices, error_req_ids,
                                                         spec_decode_metadata, prompt_logprobs_dict)
        return None

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Mirror the scheduler's decisions into the CachedRequestStates and the InputBatch.

        NOTE: each request's own work runs through _per_request: if it raises,
        that request alone leaves the batch and is reported in
        ModelRunnerOutput.error_req_ids; the step goes on for the others.
        """
        batch = self.input_batch
        # 1. Finished requests: forget them entirely.
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.failed_req_ids.pop(req_id, None)
            self._remove_prompt_logprobs_request(req_id)
            batch.remove_request(req_id)
        # 2. Rows not scheduled this step (preempted, or skipped for lack of
        # budget) leave the batch, but their CachedRequestState stays: they
        # will be scheduled again and come back as cached requests.
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in [r for r in batch.req_id_to_index if r not in scheduled]:
            batch.remove_request(req_id)
        # 3. New requests.
        reqs_to_add: list[CachedRequestState] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._per_request(new_req.req_id, self._new_request_state, new_req)
            if state is not None:
                self.requests[new_req.req_id] = state
                reqs_to_add.append(state)
        # 4. Requests we already know: a diff (a decode's, in bulk first; the rest one by one).
        cached = scheduler_output.scheduled_cached_reqs
        for i in self._update_cached_decodes(cached):
            req_id = cached.req_ids[i]
            if req_id in self.failed_req_ids:
                continue                         # failed in an earlier step; not finished yet
            state = self.requests[req_id]
            if self._per_request(req_id, self._update_cached_request, state, cached, i):
                reqs_to_add.append(state)        # was evicted from the batch: re-add whole
        if self.use_async_spec_decode:
            self.correct_spec_decode_token_counts(cached)       # last step's drafts were counted as accepted
        # 5. Fill the holes (lowest first), close the rest, refresh sampling tensors.
        for state in reqs_to_add:
            self._per_request(state.req_id, batch.add_request, state)
        batch.condense()
        if self.drafter is not None:
            self._update_spec_token_ids(scheduler_output)        # the step's drafts, by row
        batch.refresh_metadata()

    def _new_request_state(self, new_req) -> CachedRequestState:
        sampling_params = new_req.sampling_params
        generator = None
        if sampling_params.seed is not None and not sampling_params.sampling_type_greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling_params.seed)
        self._add_prompt_logprobs_request(new_req.req_id, sampling_params.prompt_logprobs)
        # NOTE: copy the block-id lists: we extend them in place later, and
        # in-process (UniProcExecutor) they may be the scheduler's own lists.
        return CachedRequestState(new_req.req_id, new_req.prompt_token_ids, sampling_params, generator,
                                  tuple(list(ids) for ids in new_req.block_ids),
                                  new_req.num_computed_tokens)

    def _update_cached_request(self, state: CachedRequestState, cached, i: int) -> bool:
        """Apply the scheduler's diff for one known request; True if it must be re-added to the batch."""
        batch = self.input_batch
        req_id = state.req_id
        state.num_computed_tokens = cached.num_computed_tokens[i]
        new_block_ids = cached.new_block_ids[i]
        resumed = req_id in cached.resumed_req_ids
        if resumed:
            # NOTE: preemption freed all its blocks; the new ones *replace* them.
            state.block_ids = tuple(list(ids) for ids in new_block_ids)
        elif new_block_ids is not None:
            for ids, new_ids in zip(state.block_ids, new_block_ids):
                ids.extend(new_ids)
        if resumed:
            # NOTE: only a resumed request takes its outputs from all_token_ids:
            # its readmission waited for its in-flight tokens, so the scheduler's
            # list is complete. A request merely left out last step keeps ours:
            # with async scheduling it may still hold -1 placeholders the
            # scheduler's list has no entry for yet.
            state.output_token_ids = cached.all_token_ids[req_id][state.num_prompt_tokens:]
        row = batch.req_id_to_index.get(req_id)
        if row is None:
            return True
        batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
        if resumed:
            batch.block_table.add_row(state.block_ids[0], row)
            batch.req_output_token_ids[row] = state.output_token_ids    # the list was replaced above
        elif new_block_ids is not None:
            batch.block_table.append_row(new_block_ids[0], row)
        return False

    def _update_cached_decodes(self, cached: CachedRequestData) -> list[int]:
        """_update_cached_request for the common case, in bulk: a request in its
        row, not resumed, with no new block (a decode, most steps), whose diff
        is only its num_computed_tokens. Returns the indices into cached.req_ids
        left for _update_cached_request.

        NOTE: the same writes as _update_cached_request, without its per-request
        call and _per_request wrapper (at batch 256 about a third of
        _update_states on a CPU, bench/step_overhead.py --cpu): nothing here can
        fail for one request alone, and the batch's column is written once.
        """
        requests, failed_req_ids = self.requests, self.failed_req_ids
        req_id_to_index, resumed_req_ids = self.input_batch.req_id_to_index, cached.resumed_req_ids
        rest: list[int] = []
        rows: list[int] = []
        values: list[int] = []
        for i, (req_id, new_block_ids, num_computed_tokens) in enumerate(
                zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)):
            row = req_id_to_index.get(req_id)
            if row is None or new_block_ids is not None or req_id in resumed_req_ids or req_id in failed_req_ids:
                rest.append(i)
                continue
            requests[req_id].num_computed_tokens = num_computed_tokens
            rows.append(row)
            values.append(num_computed_tokens)
        if rows:
            self.input_batch.num_computed_tokens_cpu[rows] = values
        return rest

    def _per_request(self, req_id: str, fn, *args):
        """fn(*args), one request's own work; if it raises, that request fails alone.

        NOTE: this is what makes a per-request error attributable: the request
        leaves the batch (its row, generator and sampling state with it) and is
        reported to the scheduler, which finishes it with FINISHED_ERROR and
        frees its blocks. vLLM validates at the edge and lets any error in the
        worker take the engine down; the edge here validates the same things,
        this is the last line behind it. Every TP rank runs the same checks on
        the same inputs, so all ranks drop the same requests.
        """
        try:
            return fn(*args)
        except Exception as e:
            logger.exception("Request %s failed while joining the batch; it alone is finished "
                             "with FINISHED_ERROR.", req_id)
            self.requests.pop(req_id, None)
            self.input_batch.remove_request(req_id)
            self.failed_req_ids[req_id] = f"{type(e).__name__}: {e}"
            self._step_error_req_ids.append(req_id)
            return None

    def _take_step_errors(self) -> list[str] | None:
        errors, self._step_error_req_ids = self._step_error_req_ids, []
        return errors or None

    def _get_cumsum_and_arange(self, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[2, 5, 3] -> cu_num_tokens [2, 7, 10], arange [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]."""
        cu_num_tokens = np.cumsum(num_tokens)                                  # [R]
        starts = np.repeat(cu_num_tokens - num_tokens, num_tokens)            # [T] each token's request start
        return cu_num_tokens, self.arange_np[:cu_num_tokens[-1]] - starts     # [R], [T]

    def _prepare_inputs(self, scheduler_output: SchedulerOutput,
                        num_scheduled_tokens: np.ndarray) -> tuple[torch.Tensor, SpecDecodeMetadata | None]:
        """Flatten the batch into the model's inputs: input_ids, positions,
        query_start_loc, seq_lens and slot_mapping, written into the persistent
        buffers (and copied to the device).

        num_scheduled_tokens: [R] tokens of each batch row this step (drafts included).
        Returns (logits_indices, spec_decode_metadata): the rows that need logits, and
        speculative decoding's (which rows verify drafts; None without draft tokens).
        Positions are computed on the host and copied. (v0.27.1 computes
        positions_np the same way, then recomputes the device copy from
        num_computed_tokens on the device: under async speculative decoding
        the device knows how many drafts were accepted before the host does.)
        """
        batch = self.input_batch
        num_reqs = batch.num_reqs
        # NOTE: first, so this host-to-device copy overlaps the numpy work below.
        batch.block_table.commit_block_table(num_reqs)
        total = int(num_scheduled_tokens.sum())
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)     # [T] row of each token
        cu_num_tokens, arange = self._get_cumsum_and_arange(num_scheduled_tokens)   # [R], [T]
        positions_np = self.positions.np[:total]
        np.add(batch.num_computed_tokens_cpu[req_indices], arange, out=positions_np)   # [T]
        # token_ids_cpu is [max_num_reqs, max_model_len]; flattened, (row, pos) is row * max_model_len + pos.
        token_indices = positions_np + req_indices * self.max_model_len       # [T]
        self.input_ids.np[:total] = batch.token_ids_cpu.ravel()[token_indices]
        self._fill_query_start_loc_and_seq_lens(num_reqs, cu_num_tokens, num_scheduled_tokens, total)
        self.input_ids.copy_to_gpu(total)
        self.positions.copy_to_gpu(total)
        # NOTE: the whole buffers: past the real requests query_start_loc stays
        # at `total` and seq_lens at 0, which is what a padded full-graph batch
        # reads for its padding requests (query_len 0, seq_len 0).
        self.query_start_loc.copy_to_gpu()
        self.seq_lens.copy_to_gpu()
        if batch.prev_sampled_token_ids is not None:
            self._splice_prev_sampled(cu_num_tokens)
        if self.use_async_spec_decode:
            self._prepare_draft_input_ids(scheduler_output, cu_num_tokens)    # the drafts, still on the device
        # NOTE: from the block table and positions already on the device: on a
        # GPU a Triton kernel, as in vLLM (worker/block_table.py). Every slot
        # past the real tokens is -1, whatever padding the step is given later.
        with self.tracer.compute_slot_mapping(num_reqs, total):
            batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[:num_reqs + 1],
                                                   self.positions.gpu[:total])
        # NOTE: a partial prefill chunk ends before the request's last token, so
        # its "next token" would be a guess in the middle of the prompt. It is
        # sampled anyway (simpler, batched) and discarded in _bookkeeping_sync.
        self.discard_request_indices = np.nonzero(
            self.seq_lens.np[:num_reqs] < batch.num_tokens_no_spec[:num_reqs])[0]
        self.last_prepare_inputs = self.tracer.snapshots.prepare_inputs(
            self, num_scheduled_tokens, req_indices, cu_num_tokens, arange, token_indices)
        # The last scheduled token of each request: the only rows that need logits
        # (with drafts: every draft position too).
        spec_decode_metadata = self._calc_spec_decode_metadata(scheduler_output, cu_num_tokens)
        if spec_decode_metadata is None:
            logits_indices = self.query_start_loc.gpu[1:num_reqs + 1].long() - 1   # [R]
        else:
            logits_indices = spec_decode_metadata.logits_indices                    # [R + drafts]
            self.record_spec_decode_inputs(self.last_prepare_inputs, spec_decode_metadata)
        return logits_indices, spec_decode_metadata

    def _determine_batch_execution_and_padding(
            self, num_tokens: int, num_reqs: int, num_scheduled_tokens_np: np.ndarray,
            max_num_scheduled_tokens: int, use_cascade_attn: bool = False, allow_microbatching: bool = True,
            force_eager: bool = False) -> tuple[CUDAGraphMode, BatchDescriptor, bool, None, None]:
        """The step's CUDA-graph mode and padded batch (vLLM's method of this name).

        Returns (cudagraph_mode, batch_descriptor, should_ubatch,
        num_tokens_across_dp, cudagraph_stats). NOTE: the last three are for
        micro-batching (two overlapped halves of a batch), data parallelism
        (ranks pad to a common size) and CUDA-graph statistics; always False /
        None here. The decision, with its reason, is kept in
        `self.cudagraph_decision` for the trace.
        """
        uniform_decode = is_uniform_decode(max_num_scheduled_tokens, self.uniform_decode_query_len,
                                           num_tokens, num_reqs)
        cudagraph_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(
            num_tokens, uniform_decode=uniform_decode,
            valid_modes={CUDAGraphMode.NONE} if force_eager else None,
            invalid_modes={CUDAGraphMode.FULL} if use_cascade_attn else None)
        self.cudagraph_decision = self.cudagraph_dispatcher.describe(
            cudagraph_mode, batch_descriptor, num_tokens, max_num_scheduled_tokens, uniform_decode)
        if self.last_prepare_inputs is not None:
            self.last_prepare_inputs["cudagraph"] = self.cudagraph_decision.to_dict()
        return cudagraph_mode, batch_descriptor, False, None, None

    def _num_scheduled_tokens(self, scheduler_output: SchedulerOutput) -> np.ndarray:
        """Tokens scheduled for each batch row [R]."""
        scheduled = scheduler_output.num_scheduled_tokens
        num_scheduled = np.array([scheduled[r] for r in self.input_batch.req_ids], dtype=np.int32)
        # Requests that failed to join the batch are scheduled but not run.
        num_failed = sum(scheduled[r] for r in self.failed_req_ids if r in scheduled)
        assert int(num_scheduled.sum()) + num_failed == scheduler_output.total_num_scheduled_tokens, \
            "rows and num_scheduled_tokens disagree"
        return num_scheduled

    def _fill_query_start_loc_and_seq_lens(self, num_reqs: int, cu_num_tokens: np.ndarray,
                                           num_scheduled: np.ndarray, total: int) -> None:
        query_start_loc = self.query_start_loc.np
        query_start_loc[0] = 0
        query_start_loc[1:num_reqs + 1] = cu_num_tokens
        # NOTE: padded with the last value so the array stays non-decreasing.
        query_start_loc[num_reqs + 1:] = total
        self.seq_lens.np[:num_reqs] = self.input_batch.num_computed_tokens_cpu[:num_reqs] + num_scheduled
        self.seq_lens.np[num_reqs:] = 0

    def _attn_metadata(self, num_reqs: int, total: int, max_query_len: int) -> AttentionMetadata:
        block_table = self.input_batch.block_table
        decode_order = self.decode_seq_order
        return AttentionMetadata(
            num_actual_tokens=total, num_reqs=num_reqs,
            max_query_len=max_query_len, max_seq_len=int(self.seq_lens.np[:num_reqs].max()),
            query_start_loc=self.query_start_loc.gpu[:num_reqs + 1], seq_lens=self.seq_lens.gpu[:num_reqs],
            block_table=block_table.get_device_tensor(num_reqs), slot_mapping=block_table.slot_mapping[:total],
            query_start_loc_cpu=self.query_start_loc.cpu[:num_reqs + 1], _seq_lens_cpu=self.seq_lens.cpu[:num_reqs],
            seq_lens_cpu_upper_bound=self.seq_lens.cpu[:num_reqs], kernel_timer=self.tracer.kernel_timer,
            decode_seq_order=decode_order.prepare(self.seq_lens.np, num_reqs, max_query_len)
            if decode_order is not None else None)

    def _model_forward(self, num_tokens: int, attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids.gpu[:num_tokens], self.positions.gpu[:num_tokens],
                          self.kv_caches, attn_metadata)

    def _empty_output(self, step_id: int, error_req_ids: list[str] | None) -> ModelRunnerOutput:
        """The output of a step that sampled nothing.

        NOTE: a step with nothing to compute (with async scheduling: every
        running request's last token already in flight) still gets its
        snapshot, so that every step of a run has both halves."""
        self.tracer.snapshots.record(step_id, [], runner=self)
        if error_req_ids:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                     error_req_ids=error_req_ids)
        return EMPTY_MODEL_RUNNER_OUTPUT

    # -- one step: sample_tokens --------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        state, self.execute_model_state = self.execute_model_state, None
        if state is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model")
        step_id = state.scheduler_output.step_id
        if state.logits is None:
            return self._empty_output(step_id, state.error_req_ids)
        tracer = self.tracer
        with tracer.span("GPUModelRunner.sample_tokens"):
            if grammar_output is not None:
                # Structured output: forbidden tokens -> -inf, before any sampling rule.
                with tracer.apply_grammar_bitmask(grammar_output):
                    apply_grammar_bitmask(state.scheduler_output, grammar_output, self.input_batch, state.logits)
            sampler_output = self._sample(state.logits, state.discard_request_indices, state.spec_decode_metadata)
            if self.use_async_scheduling:
                with tracer.span("GPUModelRunner._bookkeeping_sync"):
                    if self.use_async_spec_decode:
                        return self._bookkeeping_async_spec(state, sampler_output)
                    return self._bookkeeping_async(state, sampler_output)
            with tracer.sync_point("GPUModelRunner._bookkeeping_sync", step_id):
                if state.spec_decode_metadata is None:
                    output = self._bookkeeping_sync(state, sampler_output)
                else:
                    output = self._bookkeeping_sync_spec(state, sampler_output)
            # Speculative decoding: the next step's drafts, from the tokens now on the host.
            self.propose_draft_token_ids(state.scheduler_output, output.sampled_token_ids,
                                         state.spec_decode_metadata)
        tracer.snapshots.record(step_id, output.sampled_token_ids, runner=self)
        return output

    def _sample(self, logits: torch.Tensor, discard_request_indices: np.ndarray,
                spec_decode_metadata: SpecDecodeMetadata | None = None) -> SamplerOutput:
        """The Sampler over every row (the RejectionSampler when the step has drafts);
        then a discarded row's seeded generator is rewound.

        NOTE: rewound as if it had not sampled: a seeded request then gets the
        same tokens however its prompt was chunked. (vLLM rewinds the CUDA
        Philox offset by 4.)"""
        sampling_metadata = self.input_batch.sampling_metadata
        assert sampling_metadata is not None         # made by _update_states' refresh_metadata
        if self.use_async_scheduling:
            self.update_async_output_token_ids()
        generators = sampling_metadata.generators
        saved_states = {i: generators[i].get_state() for i in discard_request_indices.tolist() if i in generators}
        with self.tracer.phase("GPUModelRunner._sample", "sample"):
            if spec_decode_metadata is None:
                sampler_output = self.sampler(logits, sampling_metadata)
            else:
                sampler_output = self._sample_with_drafts(logits, spec_decode_metadata)
        for i, generator_state in saved_states.items():
            self.input_batch.generators[i].set_state(generator_state)
        return sampler_output

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        """The sampled ids [R, 1] on the host, one list per request: the step's one
        wait for the device (vLLM's _to_list).

        NOTE: an event sync, not .tolist() on a device tensor: that is a
        stream-wide sync which would also block other streams' copies (vLLM
        issue #22754)."""
        if self.transfer_event is None:
            return sampled_token_ids.tolist()     # NOTE: on a CPU every op already ran
        pinned = self.sampled_token_ids_pinned_cpu[:sampled_token_ids.shape[0]]
        pinned.copy_(sampled_token_ids, non_blocking=True)
        self.tracer.device_mark("end")
        self.transfer_event.record()
        self.tracer.wait(self.transfer_event)
        return pinned.tolist()

    def _bookkeeping_sync(self, state: ExecuteModelState, sampler_output: SamplerOutput) -> ModelRunnerOutput:
        logprobs_tensors = sampler_output.logprobs_tensors
        self.tracer.device_mark("d2h")
        # NOTE: enqueued before _to_list's event, so its wait covers these copies too.
        host_logprobs = logprobs_tensors.to_cpu_nonblocking() if logprobs_tensors is not None else None
        valid_sampled_token_ids = self._to_list(sampler_output.sampled_token_ids.view(-1, 1))   # [R][1]
        req_ids = self.input_batch.req_ids
        rows = self.sampling_rows(len(req_ids), state.discard_request_indices)
        self.cache_sampled_tokens(req_ids, rows, [valid_sampled_token_ids[i][0] for i in rows.tolist()])
        return make_model_runner_output(req_ids, valid_sampled_token_ids, state.discard_request_indices.tolist(),
                                        host_logprobs.tolists() if host_logprobs is not None else None,
                                        state.prompt_logprobs_dict, state.error_req_ids)

    def sampling_rows(self, num_reqs: int, discard_request_indices: np.ndarray) -> np.ndarray:
        """Rows whose sampled token is kept (all but partial prefill chunks), ascending. Read only:
        with nothing discarded (a decode step) it is a view of arange_np."""
        rows = self.arange_np[:num_reqs]                                                   # [R]
        if not len(discard_request_indices):
            return rows
        keep = np.ones(num_reqs, dtype=bool)
        keep[discard_request_indices] = False
        return rows[keep]                                                                  # [V]

    def cache_sampled_tokens(self, req_ids: list[str], rows: np.ndarray, tokens: list[int]) -> list[int]:
        """Append one token per row to the runner's own copy of each request's
        tokens (the scheduler does not resend them): the sampled id, or a -1
        placeholder under async scheduling. Returns each token's output index.
        NOTE: vectorized on the token table: this runs for every row, every step."""
        batch = self.input_batch
        ends = batch.num_tokens_no_spec[rows]                                               # [V]
        assert not len(ends) or ends.max() < self.max_model_len, "past max_model_len"
        batch.token_ids_cpu[rows, ends] = tokens
        batch.num_tokens_no_spec[rows] = ends + 1
        requests = self.requests
        output_indices = []
        for i, token in zip(rows.tolist(), tokens):
            out = requests[req_ids[i]].output_token_ids
            output_indices.append(len(out))
            out.append(token)
        return output_indices

    def snapshot(self) -> dict:
        in_batch = self.input_batch.req_id_to_index
        return {
            "input_batch": self.input_batch.snapshot(),
            "prepare_inputs": self.last_prepare_inputs,
            "cached_requests": [{"req_id": r, "num_tokens": s.num_tokens,
                                 "num_computed_tokens": s.num_computed_tokens,
                                 "in_batch": r in in_batch}
                                for r, s in self.requests.items()],
            "kv_cache_shape": list(self.kv_caches[0].shape) if self.kv_caches else None,
            "num_kv_cache_layers": len(self.kv_caches),
        }
