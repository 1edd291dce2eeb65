"""Load a model from a local HF-style directory: config.json + *.safetensors.

Mirrors vllm/model_executor/model_loader/ (get_model, DefaultModelLoader,
weight_utils.safetensors_weights_iterator) and vllm/utils/torch_utils.py
(set_default_torch_dtype).
The order is vLLM's:
  1. read config.json and pick the model class from `architectures`;
  2. build the model *directly* on the target device and dtype, with empty
     (uninitialised) parameters — no random init, no fp32 copy on the host;
  3. stream the checkpoint tensors, shard by shard, into model.load_weights,
     which packs q/k/v and gate/up as they arrive; with tensor parallelism
     each tensor comes as a safetensors slice, and each rank's weight_loader
     reads only its own rows or columns of it (layers/linear.py);
  4. check that every parameter was loaded; process_weights_after_loading
     (on a CPU: prepack each linear's weight for oneDNN; on Hopper, by
     default: the split-K kernel for few tokens where it was measured faster; layers/utils.py); eval().
Nothing is downloaded: the directory must exist (see default_model.py for the
default SmolLM2 model, converted once from its GGUF).

Step 3 is the model loader's (vLLM: get_model_loader(load_config)): DefaultModelLoader
here, or with load_format="dummy" the DummyModelLoader of dummy_loader.py, which
fills random values instead (the article's Llama-2-7B without its checkpoint).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open

from vllm_anatomy.attention.selector import get_attn_backend
from vllm_anatomy.config import LoadConfig, ModelConfig
from vllm_anatomy.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm_anatomy.model_executor.layers.linear import LinearBase
from vllm_anatomy.model_executor.layers.utils import dispatch_unquantized_gemm
from vllm_anatomy.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm_anatomy.model_executor.models.llama import LlamaForCausalLM, resolve_model_cls


class DefaultModelLoader:
    """Reads the directory's safetensors shard by shard into the model (vLLM's, same name)."""

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    def load_weights(self, model: LlamaForCausalLM, model_config: ModelConfig) -> None:
        model_dir = Path(model_config.model)
        # NOTE: one rank reads the whole of every tensor (get_tensor, as before);
        # N ranks each read slices, ~1/N of the split matrices (get_slice).
        sharded = get_tensor_model_parallel_world_size() > 1
        weights = safetensors_weights_iterator(get_safetensors_files(model_dir), as_slices=sharded)
        with torch.no_grad():
            loaded = model.load_weights(weights)
        missing = {name for name, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"{model_dir}: checkpoint lacks weights for {sorted(missing)[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")


def get_model_loader(load_config: LoadConfig):
    """The loader for a load format (vLLM: model_loader/__init__.py, same name)."""
    if load_config.load_format == "dummy":
        from vllm_anatomy.model_executor.dummy_loader import DummyModelLoader
        return DummyModelLoader(load_config)
    return DefaultModelLoader(load_config)


def get_model(model_config: ModelConfig, backend: str = "torch",
              load_config: LoadConfig | None = None) -> LlamaForCausalLM:
    model_dir = Path(model_config.model)
    if not model_config.hf_config:
        model_config.hf_config = load_hf_config(model_dir)
    hf_config = model_config.hf_config
    model_cls = resolve_model_cls(hf_config)
    max_position = hf_config.get("max_position_embeddings")
    if max_position is not None and model_config.max_model_len > max_position:
        # NOTE: the RoPE table has max_position_embeddings rows; a longer
        # sequence would index past it. vLLM refuses this at config time too.
        raise ValueError(f"max_model_len={model_config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={max_position}")
    attn_backend = get_attn_backend(backend)
    dtype = _resolve_dtype(model_config.dtype)
    with set_default_torch_dtype(dtype), torch.device(model_config.device):
        model = model_cls(hf_config, attn_backend)
    get_model_loader(load_config or LoadConfig()).load_weights(model, model_config)
    process_weights_after_loading(model)
    return model.eval()


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """What each layer does once its weights are in (vLLM: model_loader/utils.py, same name):
    every linear layer and the lm_head get their platform's gemm (layers/utils.py): oneDNN on a
    prepacked weight on a CPU; on CUDA F.linear, or the skinny split-K kernel for few tokens
    (VLLM_ANATOMY_SKINNY_GEMM: where its table says so by default, everywhere with =1)."""
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            dispatch_unquantized_gemm(module)


def load_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a local HF-style directory")
    return json.loads(path.read_text())


def get_safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint shards: from model.safetensors.index.json if present, else *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def safetensors_weights_iterator(files: Iterable[Path], as_slices: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs; with as_slices, (name, safetensors slice): nothing is
    read until a weight_loader indexes the slice (valid until the next pair)."""
    # NOTE: one tensor at a time, so peak host memory is one shard's mmap plus
    # one tensor, never a second full copy of the model.
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if as_slices else f.get_tensor(name))


@contextlib.contextmanager
def set_default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get this dtype (vLLM: model_loader/utils.py)."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved
