"""A draft model cut from a target: its first N decoder layers, its embeddings, norm and head.

Not in vLLM (which takes any checkpoint of the target's vocabulary). A cheap way
to get a draft that is much faster than its target and agrees with it often,
but not always: the lessons, tests and benchmarks use one to show rejections
and recovered tokens, next to the target itself as a draft (always accepted
under greedy sampling). The weights are sliced from the target's safetensors,
nothing is trained; tokenizer files are copied so the directory is a
complete model.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from vllm_anatomy.model_executor.loader import get_safetensors_files

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def write_truncated_draft(model_dir: str | Path, num_layers: int, out_dir: str | Path) -> str:
    """Write `model_dir`'s first `num_layers` layers as a model directory at `out_dir`; returns it."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{config['num_hidden_layers']}, got {num_layers}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in get_safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                layer = _LAYER.search(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out_dir / name)
    return str(out_dir)
