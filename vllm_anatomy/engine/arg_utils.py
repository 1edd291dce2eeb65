"""EngineArgs: user-facing engine arguments (vLLM's names) -> VllmConfig.

Mirrors vllm/engine/arg_utils.py. Defaults that depend on the hardware are
resolved here, once, and the resolved values are what the trace records.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, fields

import torch

from vllm_anatomy.config import (LOAD_FORMATS, CacheConfig, CompilationConfig, KVEventsConfig, LoadConfig,
                                 ModelConfig, ObservabilityConfig, ParallelConfig, SchedulerConfig,
                                 SpeculativeConfig, VllmConfig, default_capture_sizes)
from vllm_anatomy.distributed.parallel_state import resolve_backend
from vllm_anatomy.transformers_utils.default_model import resolve_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """--kv-events-config's JSON -> KVEventsConfig (unknown keys are an error)."""
    try:
        fields_ = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--kv-events-config is not valid JSON: {e}") from e
    if not isinstance(fields_, dict):
        raise argparse.ArgumentTypeError("--kv-events-config must be a JSON object")
    try:
        return KVEventsConfig(**fields_)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--kv-events-config: {e}") from e


def teaching_attention_backend() -> str:
    """The backend the lessons and the dashboard's live run ask for when none is given:
    the torch reference on a CPU (the code they point a learner at), each device's
    default (auto: the Triton kernels) on CUDA."""
    return "auto" if torch.cuda.is_available() else "torch"


@dataclass
class EngineArgs:
    model: str | None = None            # a local HF directory, or None / the default alias
    # "dummy": random weights in the config's shapes (a built-in config by its hub name, e.g.
    # meta-llama/Llama-2-7b-hf, or a directory's config.json): model_executor/dummy_loader.py.
    load_format: str = "auto"
    dtype: str = "auto"                 # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"                # auto = cuda if available else cpu
    attention_backend: str = "auto"     # auto = triton on CUDA, cpu (the fast CPU path) on CPU; torch = the reference
    seed: int = 0
    max_model_len: int | None = None    # None = the model's max_position_embeddings
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    # The scheduler's token budget (None: max_num_batched_tokens).
    max_num_scheduled_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    # fcfs | priority (lower `priority` first, then arrival; preemption takes the worst).
    scheduling_policy: str = "fcfs"
    # Fraction of the KV-cache blocks left free when admitting beside running requests.
    watermark: float = 0.0
    # KV cache events for KV-aware routers (a KVEventsConfig, or its JSON on the command line).
    kv_events_config: KVEventsConfig | None = None
    # None = on where it pays (a GPU, one in-process worker), as vLLM turns it
    # on by default; on a CPU every op is synchronous, so nothing would overlap.
    async_scheduling: bool | None = None
    distributed_executor_backend: str | None = None   # uni | mp; None = uni for one rank, else mp
    # Ranks that split every layer (worker processes of the "mp" executor).
    tensor_parallel_size: int = 1
    distributed_backend: str | None = None      # nccl | gloo; None = nccl on CUDA, gloo on CPU
    # Several hosts (vLLM's flags): the ranks are spread evenly over nnodes;
    # node 0 runs the engine, the others `vllm-anatomy serve --headless`.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    # CUDA graphs (vLLM's names: compilation_config.cudagraph_mode etc.); ignored on a CPU.
    enforce_eager: bool = False
    cudagraph_mode: str = "FULL_AND_PIECEWISE"      # | FULL_DECODE_ONLY | NONE
    max_cudagraph_capture_size: int | None = None   # None = min(max_num_batched_tokens, 2048): see below
    cudagraph_capture_sizes: list[int] | None = None
    # vLLM's --speculative-config: a dict (or its JSON), e.g. {"method": "ngram",
    # "num_speculative_tokens": 3, "prompt_lookup_max": 4}; None = no speculative decoding.
    speculative_config: dict | str | None = None
    trace_level: str = "off"                    # off | spans | full
    trace_dir: str | None = None
    otlp_traces_endpoint: str | None = None

    def _resolve_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but no CUDA device is available.")
        return self.device

    def _resolve_dtype(self, device: str) -> torch.dtype:
        if self.dtype == "auto":
            # NOTE: bf16 is slower than fp32 on these CPUs, and fp32 makes the
            # CPU path bit-comparable with transformers.
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        return _DTYPES[self.dtype]

    def _resolve_attention_backend(self, device: str) -> str:
        name = self.attention_backend
        if name == "auto":
            # NOTE: as vLLM's selector picks the platform's backend (CPU_ATTN on a
            # CPU), auto picks the fast path of each device. The torch reference
            # (attention/backends/torch_ref.py) is what a learner reads and the
            # oracle every backend is tested against: the lessons and the
            # dashboard's live run ask for it (teaching_attention_backend).
            return "triton" if device.startswith("cuda") else "cpu"
        if name not in ("torch", "cpu", "triton"):
            raise ValueError(f"attention_backend must be auto, torch, cpu or triton; got {name!r}")
        if name == "cpu" and device.startswith("cuda"):
            raise ValueError("attention_backend='cpu' runs on the CPU; on a CUDA device use triton (or torch)")
        if name == "triton" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' needs a CUDA device "
                             "(or TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)")
        return name

    def create_engine_config(self) -> VllmConfig:
        load_config = LoadConfig(self.load_format)
        if load_config.load_format == "dummy":
            from vllm_anatomy.model_executor.dummy_loader import dummy_model_dir
            model_dir = dummy_model_dir(self.model)
        else:
            model_dir = resolve_model(self.model)
        with open(os.path.join(model_dir, "config.json")) as f:
            hf_config = json.load(f)
        device = self._resolve_device()
        model_max = hf_config.get("max_position_embeddings", 2048)
        max_model_len = self.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_max}.")
        if self.block_size <= 0 or self.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {self.block_size}")
        on_gpu = device.startswith("cuda")
        # vLLM picks these by GPU size for the offline LLM; on CPU a smaller budget
        # keeps one step short enough to watch.
        max_num_batched_tokens = self.max_num_batched_tokens or (16384 if on_gpu else 2048)
        max_num_seqs = self.max_num_seqs or (1024 if on_gpu else 128)
        if not self.enable_chunked_prefill:
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (block 0 is the null block)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        model_config = ModelConfig(model=model_dir, dtype=self._resolve_dtype(device),
                                   max_model_len=max_model_len, seed=self.seed, device=device,
                                   attention_backend=self._resolve_attention_backend(device),
                                   hf_config=hf_config)
        cache_config = CacheConfig(block_size=self.block_size,
                                   num_gpu_blocks_override=self.num_gpu_blocks_override,
                                   gpu_memory_utilization=self.gpu_memory_utilization,
                                   enable_prefix_caching=self.enable_prefix_caching)
        parallel_config = self._parallel_config(device)
        model_config.verify_with_parallel_config(parallel_config)
        speculative_config = self.create_speculative_config(model_config)
        if self.max_num_scheduled_tokens is not None and not \
                0 < self.max_num_scheduled_tokens <= max_num_batched_tokens:
            raise ValueError(f"max_num_scheduled_tokens ({self.max_num_scheduled_tokens}) must be in "
                             f"[1, max_num_batched_tokens={max_num_batched_tokens}]")
        scheduler_config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                           max_num_scheduled_tokens=self.max_num_scheduled_tokens,
                                           max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                           enable_chunked_prefill=self.enable_chunked_prefill,
                                           long_prefill_token_threshold=self.long_prefill_token_threshold,
                                           policy=self.scheduling_policy, watermark=self.watermark,
                                           async_scheduling=self._resolve_async_scheduling(on_gpu,
                                                                                           speculative_config))
        if self.trace_level not in ("off", "spans", "full"):
            raise ValueError(f"trace_level must be one of off, spans, full; got {self.trace_level!r}")
        observability_config = ObservabilityConfig(trace_level=self.trace_level, trace_dir=self.trace_dir,
                                                   otlp_traces_endpoint=self.otlp_traces_endpoint)
        # (no step holds more tokens than max_num_seqs requests of max_model_len)
        compilation_config = self._compilation_config(on_gpu, max_num_seqs,
                                                      min(max_num_batched_tokens, max_num_seqs * max_model_len))
        return VllmConfig(model_config, cache_config, scheduler_config, parallel_config, observability_config,
                          compilation_config, speculative_config, load_config,
                          kv_events_config=self._kv_events_config())

    def create_speculative_config(self, target: ModelConfig) -> SpeculativeConfig | None:
        """SpeculativeConfig from the --speculative-config dict (vLLM: create_speculative_config).

        A draft model's config.json is read here: it must have the target's
        vocabulary (the rejection sampler compares their token ids), and runs on the
        target's device, dtype, attention backend and max_model_len."""
        raw = self.speculative_config
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), got {type(raw).__name__}")
        known = {f.name for f in fields(SpeculativeConfig)} - {"draft_model_config"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {sorted(unknown)}; known here: {sorted(known)}")
        config = SpeculativeConfig(**raw)
        if config.uses_draft_model():
            assert config.model is not None
            draft_dir = resolve_model(config.model)
            with open(os.path.join(draft_dir, "config.json")) as f:
                draft_hf = json.load(f)
            config.model = draft_dir
            if draft_hf.get("vocab_size") != target.hf_config.get("vocab_size"):
                raise ValueError("Target and draft model should have the same vocabulary size. "
                                 f"Target model vocab_size={target.hf_config.get('vocab_size')}. "
                                 f"Draft model vocab_size={draft_hf.get('vocab_size')}.")
            if draft_hf.get("max_position_embeddings", target.max_model_len) < target.max_model_len:
                raise ValueError(f"the draft model's max_position_embeddings="
                                 f"{draft_hf['max_position_embeddings']} is below max_model_len="
                                 f"{target.max_model_len}")
            config.draft_model_config = dataclasses.replace(target, model=draft_dir, hf_config=draft_hf)
        return config

    def _kv_events_config(self) -> KVEventsConfig | None:
        config = self.kv_events_config
        if isinstance(config, str):
            config = parse_kv_events_config(config)
        if config is not None and not isinstance(config, KVEventsConfig):
            raise ValueError(f"kv_events_config must be a KVEventsConfig or its JSON, got {type(config).__name__}")
        return config

    def _resolve_executor_backend(self) -> str:
        """vLLM's rule: one rank in-process, several ranks in worker processes."""
        backend = self.distributed_executor_backend
        if backend is None:
            return "mp" if self.tensor_parallel_size > 1 or self.nnodes > 1 else "uni"
        if backend not in ("uni", "mp"):
            raise ValueError(f"distributed_executor_backend must be 'uni' or 'mp', got {backend!r}")
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs worker processes: "
                             "distributed_executor_backend='mp' (the default for more than one rank)")
        return backend

    def _parallel_config(self, device: str) -> ParallelConfig:
        """The ranks, checked before any process starts."""
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
        if nnodes < 1 or not 0 <= self.node_rank < nnodes:
            raise ValueError(f"need nnodes >= 1 and 0 <= node_rank < nnodes; got nnodes={nnodes}, "
                             f"node_rank={self.node_rank}")
        if tp % nnodes:
            raise ValueError(f"tensor_parallel_size ({tp}) must be divisible by nnodes ({nnodes}): "
                             "every node runs the same number of ranks")
        executor_backend = self._resolve_executor_backend()
        if nnodes > 1 and executor_backend != "mp":
            raise ValueError("nnodes > 1 needs distributed_executor_backend='mp'")
        # NOTE: resolved even for one rank, so that asking for NCCL on a CPU
        # is an error whatever the rank count, not silently ignored.
        backend = resolve_backend(self.distributed_backend, device) if (tp > 1 or self.distributed_backend) \
            else None
        if device.startswith("cuda") and tp // nnodes > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} puts {tp // nnodes} ranks on this host, one per GPU, "
                             f"but it has {torch.cuda.device_count()} GPU(s)")
        return ParallelConfig(distributed_executor_backend=executor_backend, tensor_parallel_size=tp,
                              distributed_backend=backend, nnodes=nnodes, node_rank=self.node_rank,
                              master_addr=self.master_addr, master_port=self.master_port)

    def _resolve_async_scheduling(self, on_gpu: bool, speculative_config: SpeculativeConfig | None = None) -> bool:
        """Default: on a GPU with the in-process executor. With worker processes
        (mp) only when asked for: their busy loop waits for each step's tokens
        before it takes the next call (no async-output thread, see
        executor/worker_proc.py), so the overlap is the engine's alone.

        Speculative decoding, as v0.27.1 decides (VllmConfig.__post_init__):
        asked for explicitly, async scheduling runs with method='draft_model'
        (drafts kept on the device: worker/async_spec_decode.py) and is an
        error with the CPU ngram proposer; left unset, it is turned off (with
        a warning) for both methods, as v0.27.1 turns it off for every method
        but EAGLE/MTP/ngram_gpu/DSpark."""
        if speculative_config is not None:
            if self.async_scheduling:
                if not speculative_config.uses_draft_model():
                    raise ValueError("Currently, async scheduling is only supported with EAGLE/MTP/Draft "
                                     "Model/NGram GPU/DSpark kind of speculative decoding")
                return True
            if self.async_scheduling is None and on_gpu:
                logger.warning("Async scheduling not supported with %s-based speculative decoding and will "
                               "be disabled.", speculative_config.method)
            return False
        if self.async_scheduling is None:
            return on_gpu and self._resolve_executor_backend() == "uni"
        return self.async_scheduling

    # NOTE: vLLM's default largest graph is min(2 * max_num_seqs, 512) tokens:
    # past it, its torch.compile'd forward runs eager with fused kernels. Ours
    # launches each of ~400 kernels from Python (~20 ms for a 1,024-token
    # prompt whose GPU work takes 2 ms), so we capture piecewise graphs further.
    DEFAULT_MAX_CAPTURE_SIZE = 2048

    def _compilation_config(self, on_gpu: bool, max_num_seqs: int, max_num_batched_tokens: int) -> CompilationConfig:
        if self.cudagraph_mode not in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE"):
            raise ValueError("cudagraph_mode must be FULL_AND_PIECEWISE, FULL_DECODE_ONLY or NONE, "
                             f"got {self.cudagraph_mode!r}")
        if self.cudagraph_capture_sizes is not None:
            sizes = sorted(set(self.cudagraph_capture_sizes))
            if not sizes or sizes[0] < 1:
                raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {self.cudagraph_capture_sizes}")
        else:
            max_size = self.max_cudagraph_capture_size or self.DEFAULT_MAX_CAPTURE_SIZE
            if max_size < 1:
                raise ValueError(f"max_cudagraph_capture_size must be at least 1, got {max_size}")
            sizes = default_capture_sizes(min(max_size, max_num_batched_tokens))
        # NOTE: no step holds more than the token budget; a full decode graph
        # also needs one request per token (CudagraphDispatcher caps those at max_num_seqs).
        limit = max_num_batched_tokens if self.cudagraph_mode == "FULL_AND_PIECEWISE" \
            else min(max_num_seqs, max_num_batched_tokens)
        sizes = [s for s in sizes if s <= limit] or [1]
        if not on_gpu or self.enforce_eager or self.cudagraph_mode == "NONE":
            return CompilationConfig("NONE", [], 0)
        return CompilationConfig(self.cudagraph_mode, sizes, sizes[-1])

    # -- command line -------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        p = parser.add_argument
        p("--model", default=None, help="local HF model directory (default: SmolLM2-135M-Instruct); with "
          "--load-format dummy also a built-in config: meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-70b-hf, "
          "vllm-anatomy/tiny-llama")
        p("--load-format", choices=list(LOAD_FORMATS), default=d.load_format,
          help="auto/safetensors: the checkpoint; dummy: random weights in the config's shapes (no download)")
        p("--dtype", default=d.dtype)
        p("--device", default=d.device)
        p("--attention-backend", choices=["auto", "torch", "cpu", "triton"], default=d.attention_backend)
        p("--seed", type=int, default=d.seed)
        p("--max-model-len", type=int, default=None)
        p("--block-size", type=int, default=d.block_size)
        p("--num-gpu-blocks-override", type=int, default=None)
        p("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        p("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        p("--max-num-batched-tokens", type=int, default=None)
        p("--max-num-seqs", type=int, default=None)
        p("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        p("--long-prefill-token-threshold", type=int, default=0)
        p("--max-num-scheduled-tokens", type=int, default=None,
          help="the scheduler's token budget per step (default: max_num_batched_tokens)")
        p("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
          help="fcfs: arrival order; priority: a request's `priority` (lower first), then arrival")
        p("--watermark", type=float, default=d.watermark,
          help="fraction of KV-cache blocks kept free when admitting beside running requests")
        p("--kv-events-config", type=parse_kv_events_config, default=None,
          help='KV cache events as JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'')
        p("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
          help="schedule the next step while the device runs this one (default: on a GPU)")
        p("--distributed-executor-backend", choices=["uni", "mp"], default=None,
          help="uni: one in-process worker; mp: worker processes (default: mp for more than one rank)")
        p("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
          help="ranks that split every layer (one worker process each; gloo on CPU, nccl on CUDA)")
        p("--distributed-backend", choices=["nccl", "gloo"], default=None,
          help="torch.distributed backend (default: nccl on CUDA, gloo on CPU)")
        p("--nnodes", type=int, default=d.nnodes, help="hosts the ranks are spread over")
        p("--node-rank", type=int, default=d.node_rank, help="this host's index (0 runs the engine)")
        p("--master-addr", default=d.master_addr, help="address of node 0 (where the ranks meet)")
        p("--master-port", type=int, default=d.master_port, help="port of rank 0's torch.distributed store")
        p("--enforce-eager", action="store_true", help="never use CUDA graphs")
        p("--cudagraph-mode", default="FULL_AND_PIECEWISE",
          choices=["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE"],
          help="vLLM's compilation_config.cudagraph_mode (those we implement)")
        p("--max-cudagraph-capture-size", type=int, default=None)
        p("--cudagraph-capture-sizes", type=int, nargs="+", default=None)
        p("--speculative-config", "-sc", default=None,
          help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3, '
               '"prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "draft_model", '
               '"model": DIR, "num_speculative_tokens": 3}')
        p("--trace-level", choices=["off", "spans", "full"], default=d.trace_level)
        p("--trace-dir", default=None)
        p("--otlp-traces-endpoint", default=None)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
