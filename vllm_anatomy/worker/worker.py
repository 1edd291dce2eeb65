"""Worker: one device, one GPUModelRunner; the object an executor calls by method name.

Mirrors vllm/v1/worker/gpu_worker.py (Worker). The executor drives a worker
only through method names and plain arguments — UniProcExecutor calls them
directly, MultiprocExecutor sends (method name, args) through a shared-memory
queue to a worker process — so every public method here is a thin, picklable-
argument entry point that delegates to the runner.

Start-up order (EngineCore._initialize_kv_caches in vLLM):
    init_device -> load_model -> determine_num_available_blocks
    -> (the engine picks num_blocks, tells the scheduler) -> initialize_from_config(num_blocks)
    -> compile_or_warm_up_model (JIT-compile the kernels, capture the CUDA graphs)
Then every step: execute_model(scheduler_output) -> None, sample_tokens(grammar_output)
-> ModelRunnerOutput (async scheduling: an AsyncModelRunnerOutput, resolved later by the engine).

Tensor parallelism: with N ranks each worker process runs one Worker, and
init_device joins the ranks' torch.distributed world first
(init_worker_distributed_environment: nccl on CUDA, gloo on CPU) so that the
model it then builds holds this rank's slice of every layer. Every rank runs
every step; the collectives inside the forward keep them in lockstep.

Simplified here: no pipeline parallelism, no sleep mode, no profiler hooks,
no torch.compile.
"""
from __future__ import annotations

import contextlib

import torch

from vllm_anatomy.config import VllmConfig
from vllm_anatomy.core.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput
from vllm_anatomy.core.sched.output import GrammarOutput, SchedulerOutput
from vllm_anatomy.distributed.parallel_state import (ensure_model_parallel_initialized, get_tp_group,
                                                     init_distributed_environment, resolve_backend)
from vllm_anatomy.tracing.collectives import CollectiveTracer
from vllm_anatomy.tracing.recorder import NullRecorder, Recorder
from vllm_anatomy.worker.cudagraph import CUDAGraphRunner
from vllm_anatomy.worker.gpu_model_runner import GPUModelRunner


class Worker:
    model_runner: GPUModelRunner

    def __init__(self, vllm_config: VllmConfig, device: str = "cpu",
                 recorder: Recorder = NullRecorder(), attn_backend: str | None = None, *,
                 local_rank: int = 0, rank: int = 0, distributed_init_method: str | None = None) -> None:
        """rank: this worker's global rank; local_rank: its device on this host;
        distributed_init_method: where the ranks meet (tcp://host:port), None for one rank."""
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.recorder = recorder
        self.attn_backend = attn_backend
        self.local_rank, self.rank = local_rank, rank
        self.distributed_init_method = distributed_init_method
        # self.model_runner: made by init_device, as in vLLM's Worker
        # Counts this rank's collectives per step (None with one rank: no group).
        self.collective_tracer: CollectiveTracer | None = None

    def init_device(self) -> None:
        with self.recorder.span("Worker.init_device", device=str(self.device)):
            if self.device.type == "cuda":
                if self.device.index is None:
                    self.device = torch.device("cuda", torch.cuda.current_device())
                torch.cuda.set_device(self.device)
                torch.cuda.empty_cache()
            init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                                self.local_rank)
            # NOTE: seeds the *global* RNG (unseeded requests); seeded requests
            # use their own generators and do not depend on this. Every rank
            # seeds the same way, so every rank samples the same tokens.
            torch.manual_seed(self.vllm_config.model_config.seed)
            self.model_runner = GPUModelRunner(self.vllm_config, self.device, self.recorder,
                                               self.attn_backend)
            if self.vllm_config.parallel_config.world_size > 1:
                self._trace_collectives(get_tp_group())

    def _trace_collectives(self, tp_group) -> None:
        """Count the TP group's collectives on this worker's spans (and time them at level full)."""
        self.collective_tracer = tp_group.tracer = CollectiveTracer(self.recorder,
                                                                    self.model_runner.tracer.kernel_timer)
        # NOTE: a graph replays its collectives without Python: it adds
        # what its capture counted (worker/cudagraph.py).
        self.model_runner.cudagraph_runner.collective_tracer = self.collective_tracer

    def load_model(self) -> None:
        self.model_runner.load_model()
        # NOTE: the run meta's model_weight_bytes is one rank's weights (the dashboard's "weights (one
        # rank)", set against one rank's KV). Rank 0 writes it: every rank holds the same bytes (each
        # sharded layer splits evenly, divide() asserts it, and the norms are replicated), and one
        # writer leaves no race on the key.
        if self.rank == 0:
            self.recorder.set_run_meta("model_weight_bytes", self.model_runner.model_memory_usage)

    def determine_num_available_blocks(self) -> int:
        return self.model_runner.determine_num_available_blocks()

    def initialize_from_config(self, num_blocks: int) -> None:
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.model_runner.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> None:
        """vLLM's name; we compile nothing ahead of time: warm up, then capture graphs."""
        with self.recorder.span("Worker.compile_or_warm_up_model"):
            self.model_runner.warm_up()
            self.model_runner.capture_model()
            # The device is idle now: link its clock to the host's for the device lane.
            self.model_runner.tracer.device_timer.calibrate()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        with self.recorder.span("Worker.execute_model") as span:
            tracer = self.collective_tracer
            if tracer is None:
                return self.model_runner.execute_model(scheduler_output)
            tracer.reset()                  # drop start-up collectives (profiling, warm-up, capture)
            output = self.model_runner.execute_model(scheduler_output)
            # The step's communication account: vllm_anatomy.num_all_reduce, ..._bytes, ...
            span.set_attribute("vllm_anatomy.step_id", scheduler_output.step_id)
            for key, value in tracer.take_step_counts().items():
                span.set_attribute(key, value)
            return output

    def sample_tokens(self, grammar_output: GrammarOutput | None
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        with self.recorder.span("Worker.sample_tokens"):
            return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Speculative decoding: the drafts proposed after the last step (None without)."""
        return self.model_runner.take_draft_token_ids()

    def remote_trace_context(self, trace_headers: dict[str, str] | None, follows: bool = False,
                             step_headers: dict[str, str] | None = None) -> contextlib.AbstractContextManager:
        """During one RPC from another process: the caller's span, as its RPC
        envelope names it, parents this worker's spans (one trace across the
        boundary); follows: a rank whose reply nobody reads, whose spans follow from
        the caller's instead (nothing waits for them to end). `step_headers`: the
        engine step the call works for (the device lane's GPU.step joins it).
        In-process calls need nothing: the caller's span and step are current."""
        return self.recorder.remote_parent(trace_headers, follows=follows, step_headers=step_headers)

    def snapshot(self) -> dict:
        return self.model_runner.snapshot()

    def shutdown(self) -> None:
        """Give the device memory back (the KV cache takes most of it), so that
        another engine in this process can size its own. Idempotent."""
        runner = getattr(self, "model_runner", None)     # (none before init_device)
        if runner is not None:
            runner.tracer.flush()         # device spans still waiting for their work (a last step's drafter)
        if runner is not None and self.device.type == "cuda":
            runner.kv_caches = []
            runner.cudagraph_runner = CUDAGraphRunner()   # the graphs and their memory pool go
            torch.cuda.empty_cache()



def init_worker_distributed_environment(vllm_config: VllmConfig, rank: int,
                                        distributed_init_method: str | None, local_rank: int) -> None:
    """Join the ranks' world and make the TP group (vLLM: gpu_worker.py, same name).

    NOTE: nothing at all with one rank: the single-process engine (tp = 1)
    creates no process group, and its layers see tp_size 1."""
    parallel_config = vllm_config.parallel_config
    if parallel_config.world_size == 1:
        return
    if distributed_init_method is None:
        raise ValueError(f"world_size {parallel_config.world_size} needs a distributed_init_method")
    backend = resolve_backend(parallel_config.distributed_backend, vllm_config.model_config.device)
    init_distributed_environment(parallel_config.world_size, rank, distributed_init_method, local_rank, backend)
    ensure_model_parallel_initialized(parallel_config.tensor_parallel_size, backend)
