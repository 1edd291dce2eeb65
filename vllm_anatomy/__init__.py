"""vllm_anatomy: a readable, instrumented reference implementation of a vLLM-V1-style engine."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]


def __getattr__(name: str):
    # Lazy: `import vllm_anatomy.core...` must not pull torch/transformers.
    if name == "LLM":
        from vllm_anatomy.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from vllm_anatomy.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from vllm_anatomy import outputs
        return getattr(outputs, name)
    if name == "EngineArgs":
        from vllm_anatomy.engine.arg_utils import EngineArgs
        return EngineArgs
    raise AttributeError(f"module 'vllm_anatomy' has no attribute {name!r}")
