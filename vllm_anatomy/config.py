"""Engine configuration, split the way vLLM splits it (vllm/config/*.py).

ModelConfig (what model, which dtype, how long), LoadConfig (how its weights
are loaded), CacheConfig (the paged KV cache), SchedulerConfig (the token
budget), CompilationConfig (CUDA graphs), SpeculativeConfig (speculative
decoding, vllm/config/speculative.py) and VllmConfig holding them all.
Users set these through EngineArgs (vllm_anatomy/engine/arg_utils.py) using
vLLM's argument names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass
class ModelConfig:
    model: str                       # path of an HF-style directory
    dtype: torch.dtype = torch.float32
    max_model_len: int = 2048
    seed: int = 0
    device: str = "cpu"
    attention_backend: str = "torch"    # torch (reference) | cpu (fast CPU path) | triton (GPU kernels)
    # Filled from config.json by the loader (vllm: model_config.hf_config).
    hf_config: dict = field(default_factory=dict)

    @property
    def num_hidden_layers(self) -> int:
        return self.hf_config["num_hidden_layers"]

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return c.get("num_key_value_heads") or c["num_attention_heads"]

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    def verify_with_parallel_config(self, parallel_config: "ParallelConfig") -> None:
        """Refuse a tensor_parallel_size the model cannot be split by, before
        any process starts (vLLM checks the heads here; its layers would fail
        on the rest later, in every rank: we say it once, up front)."""
        tp = parallel_config.tensor_parallel_size
        c = self.hf_config
        heads, kv_heads = c["num_attention_heads"], self.num_kv_heads
        if heads % tp:
            raise ValueError(f"Total number of attention heads ({heads}) must be divisible by "
                             f"tensor parallel size ({tp}).")
        # NOTE: fewer KV heads than ranks is fine when each KV head can be
        # replicated on a whole number of ranks (QKVParallelLinear).
        if (kv_heads % tp) if kv_heads >= tp else (tp % kv_heads):
            raise ValueError(f"Total number of KV heads ({kv_heads}) must be divisible by tensor parallel "
                             f"size ({tp}), or tensor parallel size by it (KV heads are then replicated).")
        for key, what in (("intermediate_size", "MLP intermediate size"), ("vocab_size", "Vocabulary size")):
            if c[key] % tp:
                raise ValueError(f"{what} ({c[key]}) must be divisible by tensor parallel size ({tp}).")


@dataclass
class LoadConfig:
    """How the model's weights are loaded (vllm/config/load.py, same name). load_format:
    "auto" / "safetensors" read the checkpoint (model_executor/loader.py: DefaultModelLoader);
    "dummy" fills random values into the config's shapes (model_executor/dummy_loader.py),
    to measure a model whose weights are not on this machine (the article's Llama-2-7B)."""
    load_format: str = "auto"

    def __post_init__(self) -> None:
        self.load_format = self.load_format.lower()
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")


LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    # Fraction of device memory the engine may use (weights + activations + KV).
    gpu_memory_utilization: float = 0.92
    # On CPU there is no device memory to measure: KV cache gets this many bytes.
    cpu_kv_cache_space_bytes: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks: int | None = None     # resolved at start-up


@dataclass
class SchedulerConfig:
    DEFAULT_MAX_NUM_BATCHED_TOKENS: ClassVar[int] = 2048
    DEFAULT_MAX_NUM_SEQS: ClassVar[int] = 128

    max_num_batched_tokens: int = 2048
    # The scheduler's token budget per step (None: max_num_batched_tokens).
    # NOTE: smaller than max_num_batched_tokens when the worker may add tokens
    # of its own to a step (vLLM: speculative decoding's drafts).
    max_num_scheduled_tokens: int | None = None
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    # "fcfs": first come, first served; "priority": lower `priority` first,
    # then earlier arrival (and preemption takes the worst of that order).
    policy: str = "fcfs"
    # Fraction of the KV-cache blocks left free when admitting a waiting or
    # preempted request beside running ones (0.0: off, vLLM's default).
    watermark: float = 0.0
    # Schedule step N+1 while step N runs on the device (AsyncScheduler +
    # EngineCore.step_with_batch_queue). vLLM's default; ours only on a GPU.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"Unknown scheduling policy: {self.policy}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_num_scheduled_tokens is not None and self.max_num_scheduled_tokens < 0:
            raise ValueError(f"max_num_scheduled_tokens must be >= 0, got {self.max_num_scheduled_tokens}")
        self.verify_max_model_len(self.max_model_len)

    def verify_max_model_len(self, max_model_len: int) -> SchedulerConfig:
        """Refuse budgets with which some request could never be scheduled (vLLM checks them here,
        at start-up, so that the Scheduler itself builds whatever it is given)."""
        if self.max_num_batched_tokens < max_model_len and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}). This effectively limits the maximum sequence length to "
                f"max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
                f"max_num_batched_tokens or decrease max_model_len.")
        if self.long_prefill_token_threshold > max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot be "
                             f"greater than the max_model_len ({max_model_len}).")
        return self

    @property
    def max_concurrent_batches(self) -> int:
        """Steps in flight at once (vLLM: VllmConfig.max_concurrent_batches, no PP)."""
        return 2 if self.async_scheduling else 1

    def get_scheduler_cls(self) -> type:
        if self.async_scheduling:
            from vllm_anatomy.core.sched.async_scheduler import AsyncScheduler
            return AsyncScheduler
        from vllm_anatomy.core.sched.scheduler import Scheduler
        return Scheduler


@dataclass
class ParallelConfig:
    # "uni": one worker in the engine process (UniProcExecutor, a plain call);
    # "mp": worker processes behind a shared-memory ring buffer (MultiprocExecutor).
    distributed_executor_backend: str = "uni"
    tensor_parallel_size: int = 1
    # Ranks in all (vLLM: pipeline x tensor parallel size; no pipeline here).
    world_size: int = field(init=False)
    # The torch.distributed backend: None = the device's (nccl on CUDA, gloo
    # on CPU). Not a vLLM argument (vLLM takes the platform's dist_backend).
    distributed_backend: str | None = None
    # Several hosts (vLLM's names): node 0 runs the engine and local_world_size
    # ranks; every other node runs local_world_size headless ranks. The ranks
    # meet at master_addr:master_port (rank 0's torch.distributed store).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501

    def __post_init__(self) -> None:
        self.world_size = self.tensor_parallel_size

    @property
    def local_world_size(self) -> int:
        """Ranks on this host."""
        return self.world_size // self.nnodes


@dataclass
class KVEventsConfig:
    """KV cache events (vllm/config/kv_events.py): BlockStored / BlockRemoved /
    AllBlocksCleared, published per step over ZMQ for KV-aware routers
    (vllm_anatomy/distributed/kv_events.py). `--kv-events-config` takes it as JSON."""
    enable_kv_cache_events: bool = False
    # "zmq" or "null"; None: zmq when events are on, else null.
    publisher: str | None = None
    # PUB address: tcp://*:5557 binds; tcp://host:port connects.
    endpoint: str = "tcp://*:5557"
    # ROUTER address where a subscriber asks for missed batches (None: no replay).
    replay_endpoint: str | None = None
    # Batches kept for replay.
    buffer_steps: int = 10_000
    # ZMQ high-water mark of the PUB socket (past it, messages are dropped).
    hwm: int = 100_000
    # Batches queued for the publisher thread.
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"Unknown event publisher '{self.publisher}' (zmq or null)")


@dataclass
class ObservabilityConfig:
    trace_level: str = "off"              # off | spans | full
    trace_dir: str | None = None          # where run stores are written
    otlp_traces_endpoint: str | None = None


@dataclass
class CompilationConfig:
    """How the forward pass runs (vllm/config/compilation.py).

    cudagraph_mode: FULL_AND_PIECEWISE (vLLM's default, ours on a GPU) = a
    full CUDA graph for batches where every request decodes one token (padded
    up to a capture size), and graph pieces around eager attention for any
    other batch up to the largest size; FULL_DECODE_ONLY = the full graphs
    only, eager otherwise; NONE = always eager (`--enforce-eager`, and always
    on a CPU). vLLM cuts the pieces with torch.compile; we with a breakable
    capture (compilation/breakable_cudagraph.py).
    """
    cudagraph_mode: str = "NONE"                      # FULL_AND_PIECEWISE | FULL_DECODE_ONLY | NONE
    cudagraph_capture_sizes: list[int] = field(default_factory=list)   # resolved at start-up
    max_cudagraph_capture_size: int = 0

    def adjust_cudagraph_sizes_for_spec_decode(self, uniform_decode_query_len: int) -> None:
        """Round every capture size up to a multiple of uniform_decode_query_len (1 + K), as vLLM.

        NOTE: with K drafts per request a decode step is R requests of 1 + K
        tokens, so a full graph holds (1 + K) * R tokens: only multiples of
        1 + K can be uniform. vLLM rounds the whole list (piecewise sizes too),
        drops what rounds past the largest size and keeps 1 + K itself if
        nothing else is left. Idempotent (every worker of a TP group calls it)."""
        multiple_of = uniform_decode_query_len
        if not self.cudagraph_capture_sizes or multiple_of <= 1:
            return
        round_up = lambda n: -(-n // multiple_of) * multiple_of   # noqa: E731
        sizes = sorted({round_up(s) for s in self.cudagraph_capture_sizes
                        if round_up(s) <= self.max_cudagraph_capture_size})
        if not sizes and multiple_of <= self.max_cudagraph_capture_size:
            sizes = [multiple_of]
        if not sizes:
            raise ValueError(f"No valid cudagraph sizes after rounding to multiple of {multiple_of} "
                             f"(num_speculative_tokens + 1): adjust num_speculative_tokens "
                             f"({multiple_of - 1}) or max_cudagraph_capture_size ({self.max_cudagraph_capture_size})")
        self.cudagraph_capture_sizes = sizes
        self.max_cudagraph_capture_size = sizes[-1]


def default_capture_sizes(max_size: int) -> list[int]:
    """[1, 2, 4, 8, 16, ..., 248, 256, 272, ..., max_size]: vLLM's list (1, 2, 4, steps of 8
    below 256, steps of 16 from 256, where padding costs relatively less; the max itself too)."""
    sizes = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, min(max_size + 1, 256), 8)) \
        + list(range(256, max_size + 1, 16))
    if max_size not in sizes:
        sizes.append(max_size)
    return sizes


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vllm/config/speculative.py, the fields we implement).

    method "ngram": drafts come from the request's own tokens (prompt lookup:
    the longest suffix n-gram, prompt_lookup_min..max tokens, that occurred
    earlier; the K tokens that followed it). method "draft_model": a smaller
    model of the same vocabulary (`model`, a local HF directory; the target's
    own directory is allowed: greedy drafts are then always accepted) runs K
    single-token steps on its own KV cache. As in vLLM, `method` may be left
    out: "ngram" if model is "ngram", else "draft_model".
    """
    num_speculative_tokens: int = 0
    method: str | None = None
    model: str | None = None
    # ngram: the n-gram window (vLLM: both default to 5; one given sets the other).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: its config.json, read when the config is built (vLLM: draft_model_config).
    draft_model_config: "ModelConfig | None" = None

    def __post_init__(self) -> None:
        # NOTE: the same inference and defaults as vLLM's __post_init__.
        if self.method is None:
            self.method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative method {self.method!r} is not supported here "
                             "(vllm_anatomy implements 'ngram' and 'draft_model')")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens <= 0:
            raise ValueError("Expected num_speculative_tokens to be greater than zero "
                             f"({self.num_speculative_tokens}).")
        if self.method == "ngram":
            self.model = "ngram"
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min = self.prompt_lookup_max = 5
            elif self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            elif self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min
            assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
            if self.prompt_lookup_min < 1:
                raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be at least 1")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must "
                                 f"be <= prompt_lookup_max={self.prompt_lookup_max}")
        elif self.model is None:
            raise ValueError("num_speculative_tokens was provided but without speculative model.")

    def use_ngram(self) -> bool:
        return self.method == "ngram"

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig | None = None
    load_config: LoadConfig = field(default_factory=LoadConfig)
    kv_events_config: KVEventsConfig | None = None

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per request per step (0 without speculative decoding), as vLLM's property."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0
