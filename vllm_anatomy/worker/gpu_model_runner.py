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

CUDA graphs (worker/cudagraph.py): a batch of pure decodes is padded to the
next captured size and replays that size's graph instead of launching the
forward kernel by kernel; anything with a prefill chunk runs eager.

Async scheduling (`async_scheduling`): sample_tokens does not wait. It
returns an AsyncGPUModelRunnerOutput (worker/async_output.py) whose
get_output() the engine calls one step later, keeps the sampled ids on the
device (`input_batch.prev_sampled_token_ids`), and the next step's
_prepare_inputs splices them into input_ids there: the host only ever holds -1
placeholders for them until the output arrives.

A request that fails while joining the batch (building its CachedRequestState,
its generator, its InputBatch row and sampling state) fails alone: it leaves
the batch, the step runs for the others, and ModelRunnerOutput.error_req_ids
tells EngineCore to finish it with FINISHED_ERROR (see _update_states). What
runs for the whole batch at once (prepare_inputs, the forward, the sampler)
cannot say which request broke it: an error there is the engine's.

Simplified here: no spec decode, LoRA, multimodal, pooling, pipeline
parallelism or piecewise graphs.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import NamedTuple

import numpy as np
import torch

from vllm_anatomy.attention.backends.abstract import AttentionMetadata
from vllm_anatomy.config import VllmConfig
from vllm_anatomy.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput
from vllm_anatomy.core.sched.output import GrammarOutput, SchedulerOutput
from vllm_anatomy.engine.protocol import LogprobsLists
from vllm_anatomy.model_executor.loader import get_model, load_hf_config
from vllm_anatomy.model_executor.sampler import Sampler, SamplerOutput
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata
from vllm_anatomy.structured_output.utils import apply_grammar_bitmask
from vllm_anatomy.tracing.recorder import NullRecorder, Recorder, paused_gc
from vllm_anatomy.worker.async_output import AsyncGPUModelRunnerOutput, Placeholder
from vllm_anatomy.worker.cudagraph import CUDAGraphMode, CUDAGraphRunner, CudagraphDecision, CudagraphDispatcher
from vllm_anatomy.worker.device_timer import DeviceTimer
from vllm_anatomy.worker.gpu_input_batch import CachedRequestState, InputBatch

logger = logging.getLogger(__name__)


class ExecuteModelState(NamedTuple):
    """What execute_model leaves for sample_tokens."""
    scheduler_output: SchedulerOutput
    logits: torch.Tensor | None          # [R, V] float32; None for a step with no tokens
    discard_request_indices: np.ndarray  # rows whose sampled token is thrown away
    error_req_ids: list[str] | None = None  # requests that failed to join the batch this step


class GPUModelRunner:

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str,
                 recorder: Recorder = NullRecorder(), attn_backend: str | None = None) -> None:
        self.vllm_config = vllm_config
        self.model_config = mc = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.scheduler_config = sc = vllm_config.scheduler_config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.recorder = recorder
        self.attn_backend_name = attn_backend or self.model_config.attention_backend
        self.pin_memory = self.device.type == "cuda"
        self.max_model_len = mc.max_model_len
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_num_reqs = sc.max_num_seqs
        self.block_size = self.cache_config.block_size
        if not mc.hf_config:
            mc.hf_config = load_hf_config(mc.model)

        self.requests: dict[str, CachedRequestState] = {}
        # Requests that failed in this runner -> why; kept until the scheduler
        # lists them as finished (with async scheduling it may schedule them
        # once more before it hears of the failure).
        self.failed_req_ids: dict[str, str] = {}
        self._step_error_req_ids: list[str] = []
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_num_tokens,
                                      self.device, self.pin_memory, mc.hf_config["vocab_size"],
                                      self.block_size)
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.execute_model_state: ExecuteModelState | None = None
        self.last_prepare_inputs: dict | None = None
        self.discard_request_indices = np.empty(0, dtype=np.int64)

        # Persistent buffers, reused every step: CPU tensor + numpy view + device tensor.
        self.input_ids_cpu, self.input_ids_np, self.input_ids = self._buffer(self.max_num_tokens, torch.int64)
        self.positions_cpu, self.positions_np, self.positions = self._buffer(self.max_num_tokens, torch.int64)
        self.query_start_loc_cpu, self.query_start_loc_np, self.query_start_loc = \
            self._buffer(self.max_num_reqs + 1, torch.int32)
        self.seq_lens_cpu, self.seq_lens_np, self.seq_lens = self._buffer(self.max_num_reqs, torch.int32)
        self.arange_np = np.arange(max(self.max_num_reqs + 1, self.max_model_len, self.max_num_tokens),
                                   dtype=np.int64)
        self.sampled_token_ids_pinned_cpu = torch.zeros(self.max_num_reqs, dtype=torch.int64,
                                                        pin_memory=self.pin_memory)
        self.transfer_event = torch.cuda.Event() if self.device.type == "cuda" else None
        # Async scheduling: (destination in input_ids, source row of
        # prev_sampled_token_ids) for the splice, and the event that says this
        # step's host-to-device copies are done (see synchronize_input_prep).
        self.use_async_scheduling = sc.async_scheduling
        self.splice_cpu, self.splice_np, self.splice = self._buffer(2 * self.max_num_reqs, torch.int64)
        self.prepare_inputs_event = torch.cuda.Event() if self.device.type == "cuda" else None
        self.device_timer = DeviceTimer(self.device, recorder)

        # CUDA graphs: only on a GPU, and only with kernels that read nothing
        # on the host (the torch reference backend loops over requests in Python).
        cc = vllm_config.compilation_config
        if self.device.type != "cuda" or self.attn_backend_name != "triton":
            cc = type(cc)("NONE", [], 0)
        self.cudagraph_dispatcher = CudagraphDispatcher(cc)
        self.cudagraph_runner = CUDAGraphRunner() if self.cudagraph_dispatcher.enabled else None
        self.cudagraph_decision: CudagraphDecision | None = None

    def _buffer(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        cpu = torch.zeros(n, dtype=dtype, pin_memory=self.pin_memory)
        return cpu, cpu.numpy(), torch.zeros(n, dtype=dtype, device=self.device)

    # -- start-up -------------------------------------------------------------------
    def load_model(self) -> None:
        with self.recorder.span("GPUModelRunner.load_model"):
            self.model = get_model(self.model_config, backend=self.attn_backend_name).to(self.device)
            self.device_timer.watch_layers(self.model.model.layers)

    def get_kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes summed over all layers (K and V)."""
        m = self.model
        shape = m.attn_backend.get_kv_cache_shape(1, self.block_size, m.num_kv_heads, m.head_dim)
        itemsize = next(m.parameters()).element_size()
        return math.prod(shape) * itemsize * m.num_layers

    @torch.inference_mode()
    def determine_num_available_blocks(self) -> int:
        with self.recorder.span("GPUModelRunner.determine_num_available_blocks"):
            if self.cache_config.num_gpu_blocks_override is not None:
                return self.cache_config.num_gpu_blocks_override
            bytes_per_block = self.get_kv_cache_bytes_per_block()
            if self.device.type != "cuda":
                # NOTE: no device memory to measure on a CPU: a fixed byte budget.
                return self.cache_config.cpu_kv_cache_space_bytes // bytes_per_block
            return self._profile_num_gpu_blocks(bytes_per_block)

    def _profile_num_gpu_blocks(self, bytes_per_block: int) -> int:
        """KV blocks that fit in gpu_memory_utilization x total, after a worst-case dummy step.

        NOTE: the dummy step (max_num_batched_tokens tokens, max_num_seqs
        logits rows through the sampler) finds the activation peak; the KV cache
        gets what is left of the budget after weights, that peak, and memory the
        torch allocator does not see (CUDA context, other processes).
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_run(self.max_num_tokens)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        available = total * self.cache_config.gpu_memory_utilization - peak - non_torch
        num_blocks = int(available // bytes_per_block)
        if num_blocks <= 0:
            raise RuntimeError(f"no memory left for the KV cache (available {available / 2**30:.2f} GiB): "
                               "raise gpu_memory_utilization or lower max_num_batched_tokens")
        return num_blocks

    def _dummy_run(self, num_tokens: int) -> None:
        """A forward without KV cache (attention returns zeros) + a sampler pass, for profiling."""
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        hidden = self.model(input_ids, positions, [], None)                   # [T, H]
        self._dummy_run_sampler(hidden[:min(self.max_num_reqs, num_tokens)])

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        with self.recorder.span("GPUModelRunner.initialize_kv_cache", num_blocks=num_blocks):
            m = self.model
            shape = m.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
            dtype = next(m.parameters()).dtype
            self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                              for _ in range(m.num_layers)]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the kernels before the first request, so their JIT compilation is
        not billed to a user's first token (Triton compiles a kernel variant on
        its first launch: ~0.5 s each on an H200 host)."""
        # NOTE: with either attention backend: on CUDA the norms, RoPE and
        # SiLU*mul are Triton kernels too (the torch backend reads the dummy
        # metadata's device tensors where it has no host copies).
        if self.device.type != "cuda":
            return
        with self.recorder.span("GPUModelRunner.warm_up"):
            self._warm_up_shapes()
            torch.cuda.synchronize(self.device)

    # NOTE: Triton compiles one variant per specialization of its integer
    # arguments: == 1, a multiple of 16, or anything else (num_seqs, num_tokens).
    # Prefill-like and decode-like batches also pick different block shapes
    # (unified_attention.pick_config). These (requests, query_len) shapes hit
    # each combination once; CUDA-graph capture then covers the decode sizes.
    WARM_UP_SHAPES = ((1, 64), (3, 21), (2, 32), (1, 1), (3, 1), (16, 1))

    def _warm_up_shapes(self) -> None:
        for num_reqs, query_len in self.WARM_UP_SHAPES:
            num_reqs = min(num_reqs, self.max_num_reqs)
            query_len = min(query_len, self.max_num_tokens // num_reqs, self.max_model_len)
            num_tokens = num_reqs * query_len
            self._dummy_step_inputs(num_tokens, query_len=query_len)
            hidden = self._model_forward(num_tokens, self._dummy_attn_metadata(num_reqs, num_tokens, query_len))
            self._dummy_run_sampler(hidden[:num_reqs])

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture one CUDA graph per capture size (largest first), for pure-decode batches."""
        if self.cudagraph_runner is None:
            return
        sizes = sorted(self.cudagraph_dispatcher.capture_sizes, reverse=True)
        t0, free0 = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
        with self.recorder.span("GPUModelRunner.capture_model", **{
                "vllm_anatomy.cudagraph_mode": self.cudagraph_dispatcher.cudagraph_mode.name,
                "vllm_anatomy.num_capture_sizes": len(sizes)}) as span:
            # Decode-shaped dummy inputs in the static buffers, for the largest size.
            self._dummy_step_inputs(sizes[0], query_len=1)
            self.device_timer.capturing = True     # no events may be recorded into a graph
            try:
                for size in _progress(sizes, "Capturing CUDA graphs (decode, FULL)"):
                    with self.recorder.span("CUDAGraph.capture", **{"vllm_anatomy.cudagraph_size": size}):
                        metadata = self._dummy_attn_metadata(size, size, 1)
                        self.cudagraph_runner.capture(size, lambda: self._model_forward(size, metadata))
            finally:
                self.device_timer.capturing = False
            torch.cuda.synchronize(self.device)
            used = free0 - torch.cuda.mem_get_info(self.device)[0]
            span.set_attribute("vllm_anatomy.cudagraph_memory_bytes", used)
        logger.info("captured %d CUDA graphs (sizes %d..%d) in %.1f s, %.2f GiB",
                    len(sizes), sizes[-1], sizes[0], time.perf_counter() - t0, used / 2**30)

    def _dummy_step_inputs(self, num_tokens: int, query_len: int) -> None:
        """Harmless values in the static input buffers: num_tokens // query_len
        requests of query_len tokens at positions 0.., every row pointing at
        block 0 (the null block), and slot -1 everywhere (nothing is written)."""
        num_reqs = num_tokens // query_len
        self.input_ids[:num_tokens].zero_()
        self.positions[:num_tokens].copy_(torch.arange(num_tokens, device=self.device) % query_len)
        self.query_start_loc[:num_reqs + 1].copy_(
            torch.arange(num_reqs + 1, device=self.device, dtype=torch.int32) * query_len)
        self.seq_lens[:num_reqs].fill_(query_len)
        self.input_batch.block_table.block_table[:num_reqs].zero_()
        self.input_batch.block_table.slot_mapping[:num_tokens].fill_(-1)

    def _dummy_attn_metadata(self, num_reqs: int, num_tokens: int, query_len: int) -> AttentionMetadata:
        """Metadata over the static buffers (views: a graph reads them at replay)."""
        bt = self.input_batch.block_table
        return AttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=num_reqs, max_query_len=query_len,
            max_seq_len=query_len, query_start_loc=self.query_start_loc[:num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs], block_table=bt.get_device_tensor(num_reqs),
            slot_mapping=bt.slot_mapping[:num_tokens])

    def _dummy_run_sampler(self, hidden_rows: torch.Tensor) -> None:
        logits = self.model.compute_logits(hidden_rows)                        # [R, V]
        n = logits.shape[0]
        full = lambda v, dt: torch.full((n,), v, dtype=dt, device=self.device)  # noqa: E731
        self.sampler(logits, SamplingMetadata(full(1.0, torch.float32), False, True,
                                              full(0.9, torch.float32), full(20, torch.int32),
                                              None, {}, 20))

    # -- one step: execute_model -------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.execute_model_state is not None:
            raise RuntimeError("execute_model called again before sample_tokens consumed the previous step")
        num_tokens = scheduler_output.total_num_scheduled_tokens
        with self.recorder.span("GPUModelRunner.execute_model", **{
                "vllm_anatomy.step_id": scheduler_output.step_id,
                "vllm_anatomy.num_scheduled_tokens": num_tokens}):
            with self.synchronize_input_prep():
                with self.recorder.span("GPUModelRunner._update_states"):
                    self._update_states(scheduler_output)
                error_req_ids = self._take_step_errors()
                if not num_tokens:
                    # Nothing scheduled (e.g. every request finished): no forward, nothing
                    # to sample. As in vLLM, the engine then skips sample_tokens.
                    return self._empty_output(scheduler_output.step_id, error_req_ids)
                if not self.input_batch.num_reqs:
                    # Every scheduled request failed to join the batch: sample_tokens reports them.
                    self.last_prepare_inputs = None
                    self.execute_model_state = ExecuteModelState(scheduler_output, None, np.empty(0, np.int64),
                                                                 error_req_ids)
                    return None
                timer = self.device_timer
                timer.mark("prepare_inputs")       # the H2D copies of the step's inputs
                with self.recorder.span("GPUModelRunner._prepare_inputs"):
                    attn_metadata, logits_indices = self._prepare_inputs(scheduler_output)
            decision = self.cudagraph_decision
            timer.mark("model_forward", **{"vllm_anatomy.cudagraph_mode": decision.mode.name,
                                           "vllm_anatomy.num_padded_tokens": decision.num_padded_tokens})
            with self.recorder.span("GPUModelRunner._model_forward", **{
                    "vllm_anatomy.cudagraph_mode": decision.mode.name,
                    "vllm_anatomy.num_padded_tokens": decision.num_padded_tokens,
                    "vllm_anatomy.cudagraph_reason": decision.reason,
                    "vllm_anatomy.cudagraph_reason_code": decision.reason_code.value}):
                if decision.mode is CUDAGraphMode.FULL:
                    hidden_states = self.cudagraph_runner.replay(decision.num_padded_tokens)  # [N, H]
                else:
                    hidden_states = self._model_forward(attn_metadata.num_actual_tokens, attn_metadata)  # [T, H]
            timer.mark("compute_logits")
            with self.recorder.span("GPUModelRunner.compute_logits"):
                logits = self.model.compute_logits(hidden_states[logits_indices])  # [R, V]
            self.execute_model_state = ExecuteModelState(scheduler_output, logits,
                                                         self.discard_request_indices, error_req_ids)
        return None

    @contextlib.contextmanager
    def synchronize_input_prep(self):
        """Wait until the previous step's host-to-device copies have run, then
        let this step rewrite the pinned host buffers they read.

        NOTE: the copies are non_blocking from persistent pinned buffers
        (input_ids_cpu, block_table, sampling parameters, ...). Synchronously,
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
            batch.remove_request(req_id)
        # 3. Rows not scheduled this step (preempted, or skipped for lack of
        # budget) leave the batch, but their CachedRequestState stays: they
        # will be scheduled again and come back as cached requests.
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in [r for r in batch.req_id_to_index if r not in scheduled]:
            batch.remove_request(req_id)
        # 4. New requests.
        reqs_to_add: list[CachedRequestState] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._per_request(new_req.req_id, self._new_request_state, new_req)
            if state is not None:
                self.requests[new_req.req_id] = state
                reqs_to_add.append(state)
        # 5. Requests we already know: a diff.
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self.failed_req_ids:
                continue                         # failed in an earlier step; not finished yet
            state = self.requests[req_id]
            if self._per_request(req_id, self._update_cached_request, state, cached, i):
                reqs_to_add.append(state)        # was evicted from the batch: re-add whole
        # 6. Fill the holes (lowest first), close the rest, refresh sampling tensors.
        for state in reqs_to_add:
            self._per_request(state.req_id, batch.add_request, state)
        batch.condense()
        batch.refresh_metadata()

    def _new_request_state(self, new_req) -> CachedRequestState:
        sp = new_req.sampling_params
        generator = None
        if sp.seed is not None and not sp.sampling_type_greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sp.seed)
        # NOTE: copy the block-id lists: we extend them in place later, and
        # in-process (UniProcExecutor) they may be the scheduler's own lists.
        return CachedRequestState(new_req.req_id, new_req.prompt_token_ids, sp, generator,
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
            token_ids = cached.resumed_req_token_ids[i]
            if token_ids is not None:
                state.output_token_ids = list(token_ids[state.num_prompt_tokens:])
        elif new_block_ids is not None:
            for ids, new_ids in zip(state.block_ids, new_block_ids):
                ids.extend(new_ids)
        row = batch.req_id_to_index.get(req_id)
        if row is None:
            return True
        batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
        if resumed:
            batch.block_table.add_row(state.block_ids[0], row)
        elif new_block_ids is not None:
            batch.block_table.append_row(new_block_ids[0], row)
        return False

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

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> tuple[AttentionMetadata, torch.Tensor]:
        """Flatten the batch into the model's inputs; return (attn_metadata, logits_indices)."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        # NOTE: first, so this host-to-device copy overlaps the numpy work below.
        batch.block_table.commit_block_table(num_reqs)

        scheduled = scheduler_output.num_scheduled_tokens
        num_scheduled = np.array([scheduled[r] for r in batch.req_ids], dtype=np.int32)   # [R]
        total = int(num_scheduled.sum())
        # Requests that failed to join the batch are scheduled but not run.
        num_failed = sum(scheduled[r] for r in self.failed_req_ids if r in scheduled)
        assert total + num_failed == scheduler_output.total_num_scheduled_tokens, \
            "rows and num_scheduled_tokens disagree"
        max_query_len = int(num_scheduled.max())
        # The CUDA-graph decision comes first: a graph step pads the batch, and
        # the padding must be written into the static buffers below.
        self.cudagraph_decision = decision = self.cudagraph_dispatcher.dispatch(total, num_reqs, max_query_len)
        padded = decision.num_padded_tokens
        # NOTE: padding requests (one token each) have query_len 0 and seq_len
        # 0: query_start_loc is padded with `total` and seq_lens with 0 below.
        num_padded_reqs = num_reqs + (padded - total)
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled)     # [T] row of each token
        cu_num_tokens, arange = self._get_cumsum_and_arange(num_scheduled)    # [R], [T]
        positions_np = self.positions_np[:total]
        np.add(batch.num_computed_tokens_cpu[req_indices], arange, out=positions_np)   # [T]
        # token_ids_cpu is [max_num_reqs, max_model_len]; flattened, (row, pos) is row * max_model_len + pos.
        token_indices = positions_np + req_indices * self.max_model_len       # [T]
        self.input_ids_np[:total] = batch.token_ids_cpu.ravel()[token_indices]

        self.query_start_loc_np[0] = 0
        self.query_start_loc_np[1:num_reqs + 1] = cu_num_tokens
        # NOTE: padded with the last value so the array stays non-decreasing.
        self.query_start_loc_np[num_reqs + 1:] = total
        self.seq_lens_np[:num_reqs] = batch.num_computed_tokens_cpu[:num_reqs] + num_scheduled
        self.seq_lens_np[num_reqs:] = 0
        # NOTE: on a GPU the slot mapping is computed there, by a Triton kernel
        # reading the block table and positions already copied over (vLLM does
        # the same); on a CPU numpy computes the same formula. A full trace on a
        # GPU also computes it in numpy, only for the snapshot (the values the
        # kernel writes are never read back: that would be a sync).
        slot_mapping_on_device = self.device.type == "cuda"
        if not slot_mapping_on_device or self.recorder.wants_snapshots:
            batch.block_table.compute_slot_mapping(req_indices, positions_np)
        if not slot_mapping_on_device:
            batch.block_table.commit_slot_mapping(padded)

        for cpu, dev, n in ((self.input_ids_cpu, self.input_ids, total),
                            (self.positions_cpu, self.positions, total),
                            (self.query_start_loc_cpu, self.query_start_loc, num_padded_reqs + 1),
                            (self.seq_lens_cpu, self.seq_lens, num_padded_reqs)):
            dev[:n].copy_(cpu[:n], non_blocking=True)
        if batch.prev_sampled_token_ids is not None:
            self._splice_prev_sampled(cu_num_tokens)
        if slot_mapping_on_device:
            with self.device_timer.kernel("compute_slot_mapping", **{
                    "vllm_anatomy.grid": [num_reqs + 1], "vllm_anatomy.num_tokens": total,
                    "vllm_anatomy.bytes": total * 20 + num_reqs * 8}):
                batch.block_table.compute_slot_mapping_device(num_reqs, self.query_start_loc,
                                                              self.positions, padded)

        # NOTE: a partial prefill chunk ends before the request's last token, so
        # its "next token" would be a guess in the middle of the prompt. It is
        # sampled anyway (simpler, batched) and discarded in _bookkeeping_sync.
        self.discard_request_indices = np.nonzero(
            self.seq_lens_np[:num_reqs] < batch.num_tokens_no_spec[:num_reqs])[0]
        attn_metadata = AttentionMetadata(
            num_actual_tokens=total, num_reqs=num_reqs,
            max_query_len=max_query_len, max_seq_len=int(self.seq_lens_np[:num_reqs].max()),
            query_start_loc=self.query_start_loc[:num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
            block_table=batch.block_table.get_device_tensor(num_reqs),
            slot_mapping=batch.block_table.slot_mapping[:total],
            query_start_loc_cpu=self.query_start_loc_cpu[:num_reqs + 1],
            seq_lens_cpu=self.seq_lens_cpu[:num_reqs],
            kernel_timer=self.device_timer if self.device_timer.times_kernels else None)
        # The last scheduled token of each request: the only rows that need logits.
        logits_indices = self.query_start_loc[1:num_reqs + 1].long() - 1       # [R]
        if self.recorder.wants_snapshots:
            self.last_prepare_inputs = {
                "req_ids": list(batch.req_ids), "num_scheduled_tokens": num_scheduled.tolist(),
                "req_indices": req_indices.tolist(), "cu_num_tokens": cu_num_tokens.tolist(),
                "arange": arange.tolist(), "positions": positions_np.tolist(),
                "token_indices": token_indices.tolist(), "input_ids": self.input_ids_np[:total].tolist(),
                "query_start_loc": self.query_start_loc_np[:num_reqs + 1].tolist(),
                "seq_lens": self.seq_lens_np[:num_reqs].tolist(),
                "slot_mapping": batch.block_table.slot_mapping_np[:total].tolist(),
                "logits_indices": (cu_num_tokens - 1).tolist(),
                "discard_request_indices": self.discard_request_indices.tolist(),
                "cudagraph": decision.to_dict()}
        return attn_metadata, logits_indices

    def _splice_prev_sampled(self, cu_num_tokens: np.ndarray) -> None:
        """Async scheduling: put last step's sampled ids, still on the device,
        where the host only had -1 placeholders (a continuing request's last
        input token). vLLM: _prepare_input_ids."""
        batch = self.input_batch
        last = cu_num_tokens - 1                                               # [R] each request's last token
        rows = np.nonzero(self.input_ids_np[last] == -1)[0]                   # [P] rows waiting on a token
        if len(rows) == 0:
            return
        req_ids = batch.req_ids
        n = len(rows)
        # NOTE: only a request that sampled in the previous step can have a -1
        # here (the output of any earlier step has been written over it).
        self.splice_np[:n] = last[rows]
        if n == len(req_ids) and req_ids == batch.prev_req_ids:
            # Steady decoding: same requests in the same rows as last step.
            self.splice_np[n:2 * n] = rows
        else:
            prev = batch.prev_req_id_to_index
            self.splice_np[n:2 * n] = [prev[req_ids[i]] for i in rows]
        idx = self.splice[:2 * n]
        idx.copy_(self.splice_cpu[:2 * n], non_blocking=True)
        self.input_ids.index_copy_(0, idx[:n], batch.prev_sampled_token_ids.index_select(0, idx[n:]))

    def _model_forward(self, num_tokens: int, attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens],
                          self.kv_caches, attn_metadata)

    def _empty_output(self, step_id: int, error_req_ids: list[str] | None) -> ModelRunnerOutput:
        """The output of a step that sampled nothing.

        NOTE: a step with nothing to compute (with async scheduling: every
        running request's last token already in flight) still gets its
        snapshot, so that every step of a run has both halves."""
        self.last_prepare_inputs = None
        self._record_snapshot(step_id, [])
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
        if state.logits is None:
            return self._empty_output(state.scheduler_output.step_id, state.error_req_ids)
        with self.recorder.span("GPUModelRunner.sample_tokens"):
            if grammar_output is not None:
                # Structured output: forbidden tokens -> -inf, before any sampling rule.
                with self.recorder.span("GPUModelRunner.apply_grammar_bitmask", **{
                        "vllm_anatomy.num_structured_output_reqs":
                            len(grammar_output.structured_output_request_ids)}):
                    apply_grammar_bitmask(state.scheduler_output, grammar_output, self.input_batch, state.logits)
            md = self.input_batch.sampling_metadata
            # Generator states of rows whose sample will be discarded, to roll back.
            saved = {i: md.generators[i].get_state()
                     for i in state.discard_request_indices.tolist() if i in md.generators}
            self.device_timer.mark("sample")
            with self.recorder.span("GPUModelRunner._sample"):
                sampler_output = self.sampler(state.logits, md)
            with self.recorder.span("GPUModelRunner._bookkeeping_sync") as span:
                self._rewind_generators(saved)
                if self.use_async_scheduling:
                    return self._bookkeeping_async(state, sampler_output)
                output = self._bookkeeping_sync(state, sampler_output, span)
        self._record_snapshot(state.scheduler_output.step_id, output.sampled_token_ids)
        return output

    def _record_snapshot(self, step_id: int, sampled_token_ids: list[list[int]], snap: dict | None = None) -> None:
        """The worker's half of a step's snapshots (`snap`: taken earlier, e.g. at
        launch under async scheduling; else now)."""
        if self.recorder.wants_snapshots:
            with paused_gc():
                snap = snap if snap is not None else self.snapshot()
                # What this step sampled, per batch row ([] for a partial prefill chunk).
                snap["sampled_token_ids"] = sampled_token_ids
                self.recorder.snapshot("model_runner", snap, step_id=step_id)

    def _rewind_generators(self, saved_generator_states: dict[int, torch.Tensor]) -> None:
        # NOTE: rewind the seeded generator of a row whose sample is discarded,
        # as if it had not sampled: a seeded request then gets the same tokens
        # however its prompt was chunked. (vLLM rewinds the CUDA Philox offset by 4.)
        for i, generator_state in saved_generator_states.items():
            self.input_batch.generators[i].set_state(generator_state)

    def _to_cpu(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        """Bring sampled ids (and logprobs) to the host; return them and the seconds waited."""
        if self.transfer_event is None:
            # NOTE: on a CPU every op ran synchronously: the "wait" already happened.
            return tensors, 0.0
        n = tensors[0].shape[0]
        pinned = self.sampled_token_ids_pinned_cpu[:n]
        self.device_timer.mark("d2h")
        pinned.copy_(tensors[0], non_blocking=True)
        host = [pinned] + [t.to("cpu", non_blocking=True) for t in tensors[1:]]
        self.device_timer.mark("end")
        # NOTE: an event sync, not .tolist() on a device tensor (a stream-wide
        # sync that would also block other streams' copies, vLLM issue #22754).
        self.transfer_event.record()
        t0 = time.perf_counter()
        self.transfer_event.synchronize()
        return host, time.perf_counter() - t0

    def _bookkeeping_sync(self, state: ExecuteModelState, sampler_output: SamplerOutput,
                          span) -> ModelRunnerOutput:
        lp = sampler_output.logprobs_tensors
        host, wait_s = self._to_cpu([sampler_output.sampled_token_ids, *(lp or ())])
        self.device_timer.resolve(state.scheduler_output.step_id, self.device_timer.take(), wait_s)
        span.set_attribute("vllm_anatomy.sync_wait_ms", wait_s * 1e3)
        span.set_attribute("vllm_anatomy.device", self.device.type)
        sampled = host[0].tolist()
        req_ids = self.input_batch.req_ids
        rows = self._sampling_rows(len(req_ids), state.discard_request_indices)
        self._cache_sampled_tokens(req_ids, rows, [sampled[i] for i in rows.tolist()])
        return self.make_model_runner_output(req_ids, sampled, state.discard_request_indices.tolist(),
                                             self.input_batch.num_logprobs,
                                             [t.tolist() for t in host[1:]] if lp is not None else None,
                                             state.error_req_ids)

    def _bookkeeping_async(self, state: ExecuteModelState,
                           sampler_output: SamplerOutput) -> AsyncGPUModelRunnerOutput:
        """No sync: keep the ids on the device for the next step, -1 placeholders on the host."""
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        invalid = state.discard_request_indices.tolist()
        invalid_set = set(invalid)
        batch.prev_sampled_token_ids = sampler_output.sampled_token_ids          # [R] on the device
        batch.prev_req_id_to_index = {r: i for i, r in enumerate(req_ids) if i not in invalid_set}
        batch.prev_req_ids = req_ids if not invalid else None
        rows = self._sampling_rows(len(req_ids), state.discard_request_indices)
        output_indices = self._cache_sampled_tokens(req_ids, rows, [-1] * len(rows))
        placeholders: list[Placeholder | None] = [None] * len(req_ids)
        for i, output_index in zip(rows.tolist(), output_indices):
            placeholders[i] = Placeholder(req_ids[i], output_index)
        snapshot = None
        if self.recorder.wants_snapshots:
            with paused_gc():
                snapshot = self.snapshot()
        return AsyncGPUModelRunnerOutput(
            self, state.scheduler_output.step_id, req_ids, sampler_output.sampled_token_ids,
            sampler_output.logprobs_tensors, invalid, placeholders, dict(batch.num_logprobs), snapshot,
            state.error_req_ids)

    def _sampling_rows(self, num_reqs: int, discard_request_indices: np.ndarray) -> np.ndarray:
        """Rows whose sampled token is kept (all but partial prefill chunks)."""
        return np.setdiff1d(self.arange_np[:num_reqs], discard_request_indices)          # [V]

    def _cache_sampled_tokens(self, req_ids: list[str], rows: np.ndarray, tokens: list[int]) -> list[int]:
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

    def fill_placeholders(self, placeholders: list[Placeholder | None], sampled: list[int]) -> None:
        """Async scheduling: the real ids have arrived; write them over the -1s.

        NOTE: by now the next step has run _update_states, so rows may have
        moved (condense) or left the batch: look each request up afresh. A
        request finished meanwhile is gone; one resumed after preemption got
        its real tokens from the scheduler (no -1 left to replace).
        """
        batch = self.input_batch
        requests, index = self.requests, batch.req_id_to_index
        rows, cols, tokens = [], [], []
        for ph, token in zip(placeholders, sampled):
            if ph is None or (state := requests.get(ph.req_id)) is None:
                continue
            out = state.output_token_ids
            if ph.output_index >= len(out) or out[ph.output_index] != -1:
                continue
            out[ph.output_index] = token
            row = index.get(ph.req_id)
            if row is not None:
                rows.append(row)
                cols.append(state.num_prompt_tokens + ph.output_index)
                tokens.append(token)
        batch.token_ids_cpu[rows, cols] = tokens

    @staticmethod
    def make_model_runner_output(req_ids: list[str], sampled: list[int], invalid_req_indices: list[int],
                                 num_logprobs: dict[str, int], host_logprobs: list[list] | None,
                                 error_req_ids: list[str] | None = None) -> ModelRunnerOutput:
        """One token per row ([] for a discarded row) and, for rows that asked,
        the sampled token's logprob and the top-n."""
        valid = [[t] for t in sampled]
        for i in invalid_req_indices:
            valid[i] = []
        logprobs = None
        if host_logprobs is not None:
            ids_l, lps_l, ranks_l = host_logprobs
            logprobs = []
            for i, req_id in enumerate(req_ids):
                n = num_logprobs.get(req_id)
                ok = n is not None and valid[i]
                logprobs.append(LogprobsLists([ids_l[i][:n + 1]], [lps_l[i][:n + 1]], [ranks_l[i]])
                                if ok else None)
        return ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=valid, logprobs=logprobs, error_req_ids=error_req_ids)

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


def _progress(items: list, desc: str):
    """A progress bar on stderr for start-up work (vLLM shows the same for graph capture)."""
    from tqdm import tqdm
    return tqdm(items, desc=desc, mininterval=1.0, leave=False)
