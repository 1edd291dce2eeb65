"""make_recorder: the Recorder a process of a run uses, from ObservabilityConfig.

    trace_level "off"   -> NullRecorder (OpenTelemetry is never imported)
    otherwise           -> OTelRecorder, writing the run store under trace_dir
                           (created by the first process, attached by the others
                           through `run_path`) and/or live OTLP.

NOTE: `LLM(trace_level="spans")` with neither trace_dir, an OTLP endpoint nor
OTEL_EXPORTER_OTLP_* would record into the void; it writes the run store under
DEFAULT_TRACE_DIR instead, so a run asked to be traced always is.
"""
from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

from vllm_anatomy.tracing.recorder import NullRecorder, Recorder

DEFAULT_TRACE_DIR = "vllm_anatomy_traces"


def _has_otlp_env() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def run_meta(vllm_config) -> dict[str, Any]:
    """What the run store's meta table says about the run (docs/trace-format.md):
    the model, the device (and its name), the trace level, the engine config, and
    the bytes one KV-cache block takes (with config.cache_config.num_gpu_blocks:
    the KV cache's size in MB)."""
    mc = vllm_config.model_config
    config = dataclasses.asdict(vllm_config)
    config["model_config"].pop("hf_config", None)
    if (config.get("speculative_config") or {}).get("draft_model_config"):
        config["speculative_config"]["draft_model_config"].pop("hf_config", None)
    return {"model": mc.model, "device": mc.device, "device_name": device_name(mc.device),
            "trace_level": vllm_config.observability_config.trace_level,
            "kv_cache_bytes_per_block": kv_cache_bytes_per_block(vllm_config),
            "config": _plain(config)}


def kv_cache_bytes_per_block(vllm_config) -> int | None:
    """K and V of one block, all layers (all ranks together): 2 x layers x block_size x
    num_kv_heads x head_dim x the dtype's size; None when the model config lacks a field."""
    mc = vllm_config.model_config
    try:
        itemsize = mc.dtype.itemsize if hasattr(mc.dtype, "itemsize") else 4
        # NOTE: a draft model's layers keep their own K and V in the same blocks (spec_decode/draft_model.py).
        models = [mc] + ([sc.draft_model_config] if (sc := getattr(vllm_config, "speculative_config", None))
                         and sc.draft_model_config is not None else [])
        return sum(2 * m.num_hidden_layers * vllm_config.cache_config.block_size * m.num_kv_heads * m.head_dim
                   * itemsize for m in models)
    except (KeyError, TypeError, AttributeError, ZeroDivisionError):
        return None


def device_name(device: str) -> str:
    """"NVIDIA H200" for a CUDA device, else the CPU's model name and core count."""
    if str(device).startswith("cuda"):
        try:
            import torch
            return torch.cuda.get_device_name(torch.device(device))
        except (RuntimeError, AssertionError, ValueError):
            return str(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj if obj is None or isinstance(obj, (str, int, float, bool)) else str(obj)


def make_recorder(vllm_config, process_kind: str = "frontend", run_path: str | None = None,
                  process_name: str | None = None) -> Recorder:
    """The recorder of one process. The first process of a run passes no run_path
    (a new run store is created); the others pass `first_recorder.run_path`."""
    obs = vllm_config.observability_config
    if obs.trace_level == "off":
        return NullRecorder()
    from vllm_anatomy.tracing.otel import OTelRecorder
    from vllm_anatomy.tracing.store import RunStore
    trace_dir = obs.trace_dir
    if trace_dir is None and obs.otlp_traces_endpoint is None and not _has_otlp_env():
        trace_dir = DEFAULT_TRACE_DIR
    if run_path is not None:
        store = RunStore.attach(run_path)
    elif trace_dir is not None:
        store = RunStore.create(trace_dir, run_meta(vllm_config))
    else:
        store = None
    return OTelRecorder(obs.trace_level, process_kind=process_kind, process_name=process_name,
                        store=store, otlp_traces_endpoint=obs.otlp_traces_endpoint)
