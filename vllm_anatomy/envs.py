"""Environment variables the engine reads, named as vLLM names them.

Mirrors vllm/envs.py: each variable is read when it is looked up
(`envs.VLLM_ENABLE_V1_MULTIPROCESSING`), not at import, so a script or a test
may set it after importing vllm_anatomy and before building an engine.
"""
from __future__ import annotations

import os
from typing import Any, Callable

environment_variables: dict[str, Callable[[], Any]] = {
    # The offline LLM's EngineCore runs in its own process (EngineCoreProc,
    # reached through SyncMPClient) while this one detokenizes.
    # NOTE: vLLM's default is 1; ours is 0 for now: the lessons, notebooks and
    # many tests read the engine's scheduler and executor in this process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": lambda: bool(int(os.getenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))),
    # KV cache events (BlockStored / BlockRemoved) carry each block hash as its
    # last 8 bytes, a 64-bit int (what KV-aware routers index by); 0: the raw bytes.
    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES":
        lambda: bool(int(os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1"))),
    # Log every cyclic garbage collection (utils/gc_utils.py, attached by EngineCore
    # after it froze its start-up heap): "0" off, "1" each collection's time,
    # '{"top_objects": 5}' and its five most common object types.
    "VLLM_GC_DEBUG": lambda: os.getenv("VLLM_GC_DEBUG", ""),
    # Ours, not vLLM's: the performance seams' off switches, for A/B runs (set to 0).
    # Qwen3's q/k norm + RoPE in one launch on CUDA (model_executor/models/llama.py),
    # read when the model is built.
    "VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION":
        lambda: _default_on("VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION"),
    # ... and, on top of it, the step's K/V written into the paged cache by the same launch
    # (vLLM's pass_config.fuse_qk_norm_rope_kvcache; compilation/qk_norm_rope_kvcache_fusion.py),
    # for steps of at most 256 tokens, read when the model is built. On by default: +1.2-1.4 %
    # output tok/s on an H100 (bench/results/throughput_ab_fuse_kv_h100.json, two ABBA rounds).
    "VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE":
        lambda: _default_on("VLLM_ANATOMY_FUSE_QK_NORM_ROPE_KVCACHE"),
    # Llama's (no q/k norm) RoPE and the step's K/V write into the paged cache in one launch
    # (vLLM's pass_config.fuse_rope_kvcache; compilation/rope_kvcache_fusion.py), for steps of at
    # most 256 tokens, read when the model is built. Off by default: bit-equal to the unfused pair
    # in the interpreter, not yet timed on a GPU ("1" turns it on; other values are refused).
    "VLLM_ANATOMY_FUSE_ROPE_KVCACHE":
        lambda: _switch("VLLM_ANATOMY_FUSE_ROPE_KVCACHE", os.getenv("VLLM_ANATOMY_FUSE_ROPE_KVCACHE", "0")) == "1",
    # Temperature-only batches sampled in one read of the logits on CUDA
    # (model_executor/sampler.py, vllm_anatomy/kernels/sampling.py), read when the sampler is imported.
    "VLLM_ANATOMY_FUSED_SAMPLING": lambda: _default_on("VLLM_ANATOMY_FUSED_SAMPLING"),
    # Ours: the Triton attention backend runs fresh prefills (no cached context) of at
    # least VLLM_ANATOMY_PREFILL_MIN_LEN tokens through the prefill kernel
    # (attention/backends/prefill_split.py), read when the backend is built.
    # "0" (off), "1" (kernels/prefill_attention.py; the default), or "cudnn": as "1", but
    # fresh prefills of at least VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN tokens through torch's
    # SDPA on cuDNN (kernels/prefill_attention_sdpa.py).
    "VLLM_ANATOMY_PREFILL_KERNEL": lambda: _switch(
        "VLLM_ANATOMY_PREFILL_KERNEL", os.getenv("VLLM_ANATOMY_PREFILL_KERNEL", "1"), "cudnn",
        "0 (off), 1 (the Triton prefill kernel) or cudnn (long fresh prefills through torch SDPA on cuDNN, "
        "the rest as 1)"),
    "VLLM_ANATOMY_PREFILL_MIN_LEN":
        lambda: _positive_int("VLLM_ANATOMY_PREFILL_MIN_LEN", os.getenv("VLLM_ANATOMY_PREFILL_MIN_LEN", "2048")),
    "VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN":
        lambda: _positive_int("VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN", os.getenv("VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN", "8192")),
    # Ours: decode-only batches of unified_attention's 2D kernel run their sequences
    # longest context first (attention/backends/decode_order.py), read once when the
    # model runner is built. "0" keeps batch order (the A/B's baseline).
    "VLLM_ANATOMY_DECODE_LPT": lambda: _default_on("VLLM_ANATOMY_DECODE_LPT"),
    # Linear layers on a CPU multiply with oneDNN on a weight prepacked once
    # (model_executor/layers/utils.py), read when a model is loaded.
    "VLLM_ANATOMY_CPU_ONEDNN_GEMM": lambda: _default_on("VLLM_ANATOMY_CPU_ONEDNN_GEMM"),
    # Linear layers and the lm_head on CUDA multiply through the split-K Triton kernel
    # (kernels/skinny_gemm.py) when a step has at most VLLM_ANATOMY_SKINNY_GEMM_MAX_M tokens,
    # through F.linear (cuBLAS) above it (model_executor/layers/utils.py), read when a model
    # is loaded. "tuned" (the default): only for (N, K, token bucket)s whose TUNED_CONFIGS row
    # measured the kernel faster than cuBLAS; "1": every shape (default_config where no row);
    # "0": F.linear always (the A/B's baseline).
    "VLLM_ANATOMY_SKINNY_GEMM": lambda: _switch(
        "VLLM_ANATOMY_SKINNY_GEMM", os.getenv("VLLM_ANATOMY_SKINNY_GEMM", "tuned"), "tuned",
        "0 (F.linear always), tuned (the split-K kernel where TUNED_CONFIGS measured it faster) or 1 (the "
        "kernel for every shape)"),
    "VLLM_ANATOMY_SKINNY_GEMM_MAX_M":
        lambda: _positive_int("VLLM_ANATOMY_SKINNY_GEMM_MAX_M", os.getenv("VLLM_ANATOMY_SKINNY_GEMM_MAX_M", "256")),
    # Ours: the decode step's Triton kernels (skinny_gemm, rms_norm, silu_and_mul, the fused
    # q/k norm + RoPE (+ KV cache write), unified_attention) launched with Hopper's programmatic
    # dependent launch (kernels/pdl.py says how and why), read when a layer or the attention
    # backend is built. "0" (the default: not measured yet) or "1"; sm_90+ only, else ignored.
    "VLLM_ANATOMY_PDL": lambda: _switch("VLLM_ANATOMY_PDL", os.getenv("VLLM_ANATOMY_PDL", "0")) == "1",
    # Seconds a dead EngineCore process may spend shutting down after a fatal
    # error before it dumps every thread's stack to stderr and exits (core_proc.py).
    "VLLM_ANATOMY_DEAD_ENGINE_EXIT_TIMEOUT_S":
        lambda: float(os.getenv("VLLM_ANATOMY_DEAD_ENGINE_EXIT_TIMEOUT_S", "20")),
    # Seconds of CPU time a structured-output grammar may take to compile in EngineCore
    # before its request fails with a 400 (structured_output/compile_executor.py; vLLM
    # has only VLLM_REGEX_COMPILATION_TIMEOUT_S, 5 s of wall time, for regexes). 0 = none.
    "VLLM_ANATOMY_GRAMMAR_COMPILE_TIMEOUT_S":
        lambda: float(os.getenv("VLLM_ANATOMY_GRAMMAR_COMPILE_TIMEOUT_S", "20")),
    # Seconds of CPU time the HTTP server may spend checking one request's constraint
    # (compiling it against a byte-level vocabulary, off the event loop) before it answers 400.
    "VLLM_ANATOMY_GRAMMAR_VALIDATION_TIMEOUT_S":
        lambda: float(os.getenv("VLLM_ANATOMY_GRAMMAR_VALIDATION_TIMEOUT_S", "5")),
}


OFF_VALUES = ("0", "false", "False", "")
ON_VALUES = ("1", "true", "True")


def _switch(name: str, value: str, word: str | None = None, expected: str = "0 or 1") -> str:
    """A switch's value as "0", "1" or (where the switch has one) its third setting `word`;
    anything else is refused: a typo (a misspelt "cudnn", say) must not silently measure the
    other side."""
    if value in OFF_VALUES:
        return "0"
    if value in ON_VALUES:
        return "1"
    if word is not None and value == word:
        return word
    raise ValueError(f"{name}={value!r}: expected {expected}")


def _default_on(name: str) -> bool:
    """A switch that is on unless set to an off value ("0", "false", "False"); unset or empty
    keeps it on, as before these switches shared _switch.

    NOTE: these five once read any value but their off words as on, so a typo in an A/B run
    ("no", "off") silently measured the switch on against itself; now it is refused."""
    return _switch(name, os.getenv(name) or "1") == "1"


def _positive_int(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return number


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
