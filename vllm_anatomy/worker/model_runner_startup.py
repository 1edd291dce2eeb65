"""What GPUModelRunner does once, before the first step: load, size the KV cache, warm up, capture graphs.

Mirrors the start-up half of vllm/v1/worker/gpu_model_runner.py (load_model,
profile_run / _dummy_run / _dummy_sampler_run, initialize_kv_cache,
capture_model). vLLM keeps them in the one 7,000-line class; here they are a
mixin, ModelRunnerStartupMixin, that GPUModelRunner inherits, so that
gpu_model_runner.py reads as the step alone (the translation layer) while
start-up keeps the same `self`: these methods use the runner's model, its
persistent input buffers and its CUDA-graph runner (worker/cudagraph.py),
and are called on the runner by the Worker, in this order:
    load_model -> determine_num_available_blocks -> initialize_kv_cache
    -> warm_up -> capture_model
Nothing here runs during a step.
"""
from __future__ import annotations

import gc
import logging
import math
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from vllm_anatomy.attention.backends.abstract import AttentionMetadata
from vllm_anatomy.model_executor.loader import get_model
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata
from vllm_anatomy.worker.cudagraph import CUDAGraphMode

if TYPE_CHECKING:
    from vllm_anatomy.attention.backends.decode_order import DecodeSeqOrder
    from vllm_anatomy.config import CacheConfig, ModelConfig, VllmConfig
    from vllm_anatomy.model_executor.models.llama import LlamaForCausalLM
    from vllm_anatomy.model_executor.sampler import Sampler
    from vllm_anatomy.tracing.runner_tracer import RunnerTracer
    from vllm_anatomy.worker.cpu_gpu_buffer import CpuGpuBuffer
    from vllm_anatomy.worker.cudagraph import CudagraphDispatcher, CUDAGraphRunner
    from vllm_anatomy.worker.gpu_input_batch import InputBatch

logger = logging.getLogger(__name__)


def loaded_weight_bytes(*models: torch.nn.Module | None) -> int:
    """Bytes of the parameters these models hold on this rank (each counted once: tied weights too).

    NOTE: vLLM's load_model measures the same thing as device memory (DeviceMemoryProfiler around
    loading the model and the drafter: `model_memory_usage`, logged as "Model loading took X GiB");
    with tensor parallelism each rank loads its own slice, so the figure is one rank's. Here the
    parameters are counted instead of the allocator read, so that a CPU run has the number too
    (buffers such as RoPE's cos/sin cache are left out: a few KB)."""
    params = {id(p): p for m in models if m is not None for p in m.parameters()}
    return sum(p.nbytes for p in params.values())


class ModelRunnerStartupMixin:
    # The runner's state these methods read and set (made by GPUModelRunner.__init__).
    model: LlamaForCausalLM                         # set by load_model
    model_memory_usage: int                         # set by load_model: bytes of the weights it loaded
    vllm_config: VllmConfig
    model_config: ModelConfig
    cache_config: CacheConfig
    device: torch.device
    tracer: RunnerTracer
    attn_backend_name: str
    block_size: int
    max_model_len: int
    max_num_tokens: int
    max_num_reqs: int
    uniform_decode_query_len: int
    input_ids: CpuGpuBuffer
    positions: CpuGpuBuffer
    query_start_loc: CpuGpuBuffer
    seq_lens: CpuGpuBuffer
    decode_seq_order: DecodeSeqOrder | None
    input_batch: InputBatch
    sampler: Sampler
    kv_caches: list[torch.Tensor]
    cudagraph_dispatcher: CudagraphDispatcher
    cudagraph_runner: CUDAGraphRunner
    _model_forward: Callable[[int, AttentionMetadata], torch.Tensor]
    drafter: Any                                    # spec decode's proposer, or None (worker/spec_decode_runner.py)
    spec_decode_kv_cache: Callable[[], Any]
    _warm_up_rejection_sampler: Callable[[], None]
    _capture_drafter_model: Callable[[], None]

    def load_model(self) -> None:
        with self.tracer.span("GPUModelRunner.load_model"):
            self.model = get_model(self.model_config, backend=self.attn_backend_name,
                                   load_config=self.vllm_config.load_config).to(self.device)
            self.tracer.device_timer.watch_layers(self.model.model.layers)
            if self.decode_seq_order is not None:       # the 3D path's batches need no order
                from vllm_anatomy.attention.backends.triton_attn import decode_seq_threshold_3D
                self.decode_seq_order.seq_threshold_3D = decode_seq_threshold_3D(self.model.num_kv_heads)
            if self.drafter is not None:
                self.drafter.load_model(self.model)     # a draft model (ngram: nothing to load)
            self.model_memory_usage = loaded_weight_bytes(self.model, getattr(self.drafter, "model", None))
        logger.info("Model loading took %.4f GiB", self.model_memory_usage / 2 ** 30)

    def get_kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes summed over all layers (K and V)."""
        model = self.model
        shape = model.attn_backend.get_kv_cache_shape(1, self.block_size, model.num_kv_heads, model.head_dim)
        itemsize = next(model.parameters()).element_size()
        # NOTE: a draft model keeps its own K and V in every block (spec_decode/draft_model.py).
        draft = self.spec_decode_kv_cache()
        draft_bytes = draft.get_kv_cache_bytes_per_block() if draft is not None else 0
        return math.prod(shape) * itemsize * model.num_layers + draft_bytes

    @torch.inference_mode()
    def determine_num_available_blocks(self) -> int:
        with self.tracer.span("GPUModelRunner.determine_num_available_blocks"):
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
        self._dummy_sampler_run(hidden[:min(self.max_num_reqs, num_tokens)])

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        with self.tracer.span("GPUModelRunner.initialize_kv_cache", num_blocks=num_blocks):
            model = self.model
            shape = model.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, model.num_kv_heads,
                                                          model.head_dim)
            dtype = next(model.parameters()).dtype
            self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                              for _ in range(model.num_layers)]
            if (draft := self.spec_decode_kv_cache()) is not None:
                draft.initialize_kv_cache(num_blocks)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the kernels before the first request, so their JIT compilation is
        not billed to a user's first token (Triton compiles a kernel variant on
        its first launch)."""
        # NOTE: with either attention backend: on CUDA the norms, RoPE and
        # SiLU*mul are Triton kernels too (the torch backend reads the dummy
        # metadata's device tensors where it has no host copies).
        if self.device.type != "cuda":
            return
        with self.tracer.span("GPUModelRunner.warm_up"):
            self._warm_up_shapes()
            self._warm_up_rejection_sampler()      # speculative decoding only
            torch.cuda.synchronize(self.device)

    # NOTE: Triton compiles one variant per specialization of its integer
    # arguments: == 1, a multiple of 16, or anything else (num_seqs, num_tokens).
    # Prefill-like and decode-like batches also pick different block shapes
    # (unified_attention.pick_config). These (requests, query_len) shapes hit
    # each combination once; CUDA-graph capture then covers the decode sizes.
    WARM_UP_SHAPES = ((1, 64), (3, 21), (2, 32), (1, 1), (3, 1), (16, 1))

    def _warm_up_shapes(self) -> None:
        shapes: tuple[tuple[int, int], ...] = self.WARM_UP_SHAPES
        if self.attn_backend_name == "triton":
            # The prefill split takes only fresh prefills of at least its threshold: one of that length.
            # NOTE: imported here, as the backend itself is (selector.py): prefill_split imports the
            # Triton kernels, whose decorators must not run before a test sets TRITON_INTERPRET.
            from vllm_anatomy.attention.backends.prefill_split import warm_up_prefill_len
            long_len = warm_up_prefill_len(self.max_num_tokens, self.max_model_len)
            shapes += ((1, long_len),) if long_len is not None else ()
        hidden: torch.Tensor | None = None
        for num_reqs, query_len in shapes:
            num_reqs = min(num_reqs, self.max_num_reqs)
            query_len = min(query_len, self.max_num_tokens // num_reqs, self.max_model_len)
            num_tokens = num_reqs * query_len
            num_reqs = self._dummy_step_inputs(num_tokens, query_len=query_len)
            self._warm_up_slot_mapping(num_reqs, num_tokens)
            metadata = self._dummy_attn_metadata(num_reqs, num_tokens, query_len)
            # NOTE: host copies, as a real step's metadata has them: the Triton
            # backend's prefill split (attention/backends/prefill_split.py) needs them,
            # so with it switched on these fresh dummy prefills compile the prefill
            # kernel here. (Captured graphs get none: they never split.)
            qsl = torch.arange(num_reqs + 1, dtype=torch.int32).mul_(query_len).clamp_(max=num_tokens)
            metadata.query_start_loc_cpu = qsl
            metadata._seq_lens_cpu = metadata.seq_lens_cpu_upper_bound = qsl[1:] - qsl[:-1]
            hidden = self._model_forward(num_tokens, metadata)
            self._dummy_sampler_run(hidden[:num_reqs])
        assert hidden is not None               # WARM_UP_SHAPES is not empty: the loop ran
        self._warm_up_logits(hidden.shape[-1], hidden.dtype)

    def _warm_up_logits(self, hidden_size: int, dtype: torch.dtype) -> None:
        """compute_logits on 1, 2, 4, ... rows, up to max_num_reqs.

        NOTE: the logits matmul runs outside every CUDA graph, on however many rows
        the step samples (1 to max_num_reqs), and the kernel behind it may compile a
        variant per size: on Hopper the lm_head's gemm is the skinny split-K kernel
        with one config per power-of-two bucket of rows (kernels/skinny_gemm.py,
        TUNED_CONFIGS). Without this, the first step of each new bucket compiled one
        in the middle of serving: on a cold Triton cache (a fresh machine) three
        compiles landed inside the first nano-vllm workload on an H100, -5 % tok/s."""
        rows = torch.zeros(self.max_num_reqs, hidden_size, dtype=dtype, device=self.device)
        num_rows = 1
        while True:
            self.model.compute_logits(rows[:num_rows])                     # [R, V], discarded
            if num_rows >= self.max_num_reqs:
                return
            num_rows = min(2 * num_rows, self.max_num_reqs)

    def _warm_up_slot_mapping(self, num_reqs: int, num_tokens: int) -> None:
        """Launch _prepare_inputs' slot-mapping kernel on this dummy step, then restore slot -1.

        NOTE: the dummy steps set their slots to -1 directly, so without this the
        first real step compiled compute_slot_mapping (~0.3 s on a cold Triton
        cache, billed to the first request's first token). Its slots here point
        into the null block (every dummy row is block 0); -1 is written back
        before the forward, so warm-up still writes nothing into the KV cache.
        Not part of a capture: a graph replays the forward only, after
        _prepare_inputs has run outside it. The first shape's launch compiles the
        kernel (its sizes are not specialized); the others cost a few microseconds."""
        block_table = self.input_batch.block_table
        block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[:num_reqs + 1],
                                         self.positions.gpu[:num_tokens])
        block_table.slot_mapping[:num_tokens].fill_(-1)

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture the graphs the dispatcher may ask for, largest first (vLLM: capture_model):
        piecewise captures for every size (FULL_AND_PIECEWISE), then full graphs for uniform decodes."""
        if not self.cudagraph_dispatcher.enabled:
            return
        dispatcher = self.cudagraph_dispatcher
        t0, free0 = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
        device_timer = self.tracer.device_timer
        with self.tracer.span("GPUModelRunner.capture_model", **{
                "vllm_anatomy.cudagraph_mode": dispatcher.cudagraph_mode.name,
                "vllm_anatomy.num_capture_sizes": len(dispatcher.capture_sizes)}) as span:
            device_timer.capturing = True     # no events may be recorded into a graph
            try:
                with self._freeze_gc():
                    self._capture_sizes(CUDAGraphMode.PIECEWISE, dispatcher.piecewise_sizes)
                    self._capture_sizes(CUDAGraphMode.FULL, dispatcher.decode_sizes)
                    self._capture_drafter_model()      # speculative decoding's draft model only
            finally:
                device_timer.capturing = False
            torch.cuda.synchronize(self.device)
            used = free0 - torch.cuda.mem_get_info(self.device)[0]
            span.set_attribute("vllm_anatomy.cudagraph_memory_bytes", used)
        logger.info("captured %d piecewise and %d full CUDA graphs in %.1f s, %.2f GiB",
                    len(dispatcher.piecewise_sizes), len(dispatcher.decode_sizes), time.perf_counter() - t0,
                    used / 2**30)

    @staticmethod
    @contextmanager
    def _freeze_gc() -> Iterator[None]:
        """Collect once, then keep the cyclic GC off the objects that exist while graphs
        are captured (vLLM: GPUModelRunner._freeze_gc).

        NOTE: why. A capture is a stream in capture mode, and a garbage collection
        can start at any allocation inside one. If it frees an earlier engine's
        objects there (an LLM of the same process that is gone but still in a
        reference cycle), a pinned host buffer among them goes back to torch's
        host allocator, which queries the CUDA events of its last copies:
        a query is not permitted while a stream captures, so the capture is
        invalidated ("operation failed due to a previous error during capture")
        and every graph of this engine fails with it. torch.cuda.graph collects
        before it begins; a raw capture_begin does not (v0.27.1's breakable
        capture calls gc.collect() before each size for this reason), so the
        whole capture runs inside this."""
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            gc.collect()

    def _capture_sizes(self, mode: CUDAGraphMode, sizes: list[int]) -> None:
        """A full graph captures a uniform decode of `size` tokens (`size` requests of one
        token; with K drafts size / (1 + K) requests of 1 + K); a piecewise capture one
        request of `size` tokens (its attention runs eager anyway)."""
        if not sizes:
            return
        kind = "decode, FULL" if mode is CUDAGraphMode.FULL else "mixed, PIECEWISE"
        for size in _progress(sorted(sizes, reverse=True), f"Capturing CUDA graphs ({kind})"):
            with self.tracer.span("CUDAGraph.capture", **{"vllm_anatomy.cudagraph_size": size,
                                                           "vllm_anatomy.cudagraph_mode": mode.name}):
                query_len = self.uniform_decode_query_len if mode is CUDAGraphMode.FULL \
                    else min(size, self.max_model_len)
                num_reqs = self._dummy_step_inputs(size, query_len)
                metadata = self._dummy_attn_metadata(num_reqs, size, query_len)
                self.cudagraph_runner.capture(mode, size, lambda: self._model_forward(size, metadata))

    def _dummy_step_inputs(self, num_tokens: int, query_len: int) -> int:
        """Harmless values in the static input buffers: requests of query_len
        tokens (the last one shorter if query_len does not divide num_tokens) at
        positions 0.., every row pointing at block 0 (the null block), and slot
        -1 everywhere (nothing is written). Returns the number of requests."""
        num_reqs = -(-num_tokens // query_len)
        starts = torch.arange(num_reqs + 1, device=self.device, dtype=torch.int32) * query_len
        self.input_ids.gpu[:num_tokens].zero_()
        self.positions.gpu[:num_tokens].copy_(torch.arange(num_tokens, device=self.device) % query_len)
        self.query_start_loc.gpu[:num_reqs + 1].copy_(starts.clamp_(max=num_tokens))
        self.seq_lens.gpu[:num_reqs].copy_(self.query_start_loc.gpu[1:num_reqs + 1]
                                           - self.query_start_loc.gpu[:num_reqs])
        self.input_batch.block_table.block_table[:num_reqs].zero_()
        self.input_batch.block_table.slot_mapping[:num_tokens].fill_(-1)
        return num_reqs

    def _dummy_attn_metadata(self, num_reqs: int, num_tokens: int,
                             query_len: int) -> AttentionMetadata:
        """Metadata over the static buffers (views: a graph reads them at replay)."""
        block_table = self.input_batch.block_table
        decode_order = self.decode_seq_order
        return AttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=num_reqs, max_query_len=query_len,
            max_seq_len=query_len, query_start_loc=self.query_start_loc.gpu[:num_reqs + 1],
            seq_lens=self.seq_lens.gpu[:num_reqs], block_table=block_table.get_device_tensor(num_reqs),
            slot_mapping=block_table.slot_mapping[:num_tokens],
            decode_seq_order=decode_order.for_capture(num_reqs, query_len) if decode_order is not None else None)

    def _dummy_sampler_run(self, hidden_rows: torch.Tensor) -> None:
        logits = self.model.compute_logits(hidden_rows)                        # [R, V]
        n = logits.shape[0]
        full = lambda v, dt: torch.full((n,), v, dtype=dt, device=self.device)  # noqa: E731
        self.sampler(logits, SamplingMetadata(full(1.0, torch.float32), False, True,
                                              full(0.9, torch.float32), full(20, torch.int32),
                                              None, {}, 20))
        # Temperature alone: on CUDA the fused sampling kernel's batch (sampler.py),
        # compiled here rather than in the first step that samples that way.
        self.sampler(logits, SamplingMetadata(full(1.0, torch.float32), False, True,
                                              None, None, None, {}, None))


def _progress(items: list, desc: str):
    """A progress bar on stderr for start-up work (vLLM shows the same for graph capture)."""
    from tqdm import tqdm
    return tqdm(items, desc=desc, mininterval=1.0, leave=False)
