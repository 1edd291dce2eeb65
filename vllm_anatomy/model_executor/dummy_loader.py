"""`load_format="dummy"`: the model's real shapes, random weights, nothing downloaded.

Mirrors vllm/model_executor/model_loader/dummy_loader.py (DummyModelLoader) and
weight_utils.py (initialize_dummy_weights). vLLM uses it to measure a model's speed
without its checkpoint: every floating-point parameter gets uniform values in
[-1e-3, 1e-3] from a generator seeded the same for every parameter, so the values
depend only on a tensor's size and dtype — a tensor-parallel rank's slice is filled
the same way whichever rank holds it, and no forward pass meets a NaN.

    dummy_model_dir(name)      `--model` for a dummy load -> a local directory with the
                               config.json (a built-in one: model_executor/dummy_configs.py,
                               or the directory's own) and a tokenizer
    DummyModelLoader(cfg)      load_weights(model, model_config): the random fill

NOTE: the tokenizer of a built-in config is the default model's (SmolLM2): the
article's models' tokenizers are not on this machine, and with random weights the
text is noise anyway; what the dummy load is for — step times, bytes moved, the
number of collectives — does not depend on it. Token ids stay below the model's
vocab_size (the sampler's logits are that wide), and every one of them decodes.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from vllm_anatomy.config import LoadConfig, ModelConfig
from vllm_anatomy.model_executor.dummy_configs import builtin_config
from vllm_anatomy.transformers_utils.default_model import ensure_default_model, get_cache_dir, resolve_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class DummyModelLoader:
    """Model loader that sets the model's weights to random values (vLLM's, same name)."""

    def __init__(self, load_config: LoadConfig) -> None:
        if load_config.load_format != "dummy":
            raise ValueError(f"DummyModelLoader is for load_format 'dummy', not {load_config.load_format!r}")
        self.load_config = load_config

    def download_model(self, model_config: ModelConfig) -> None:
        pass  # nothing to download: the shapes come from config.json

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        # NOTE: random values rather than zeros or torch.empty: a speed measurement must not
        # meet denormals, NaNs or an all-zero shortcut (vLLM's reason too).
        initialize_dummy_weights(model)


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, low: float = -1e-3, high: float = 1e-3,
                             seed: int = 1234) -> None:
    """Every floating-point tensor of the model uniform in [low, high), one seeded generator per tensor."""
    for param in model.state_dict().values():
        if not torch.is_floating_point(param):
            continue
        generator = torch.Generator(device=param.device).manual_seed(seed)
        if param.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            param.uniform_(low, high, generator=generator)
        else:       # (float8 and friends have no uniform_: fill in fp16, then cast)
            param.copy_(torch.empty(param.shape, dtype=torch.float16, device=param.device)
                        .uniform_(low, high, generator=generator))


def dummy_model_dir(name: str | None) -> str:
    """A directory the engine can start from with random weights: `name`'s own directory when it has a
    config.json and a tokenizer; else a directory made once under the cache, holding the built-in (or
    the directory's) config.json and the default model's tokenizer files."""
    cfg = builtin_config(name) if name else None
    key = str(name)
    if cfg is None:
        src = Path(resolve_model(name))             # the default model, or a local directory with config.json
        if (src / "tokenizer.json").is_file() or (src / "tokenizer.model").is_file():
            return str(src)
        cfg = json.loads((src / "config.json").read_text())
        key = str(src)
    target = get_cache_dir() / "dummy" / _safe(key)
    config_json = json.dumps(cfg, indent=1, sort_keys=True)
    if not _complete(target, config_json):
        tok_dir = ensure_default_model(quiet=True)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(config_json)
        for f in TOKENIZER_FILES:
            if (tok_dir / f).is_file():
                shutil.copy(tok_dir / f, tmp / f)
        (tmp / "README.txt").write_text(f"load_format='dummy' for {key}: its config.json and the default model's "
                                        f"tokenizer ({tok_dir.name}); no weights (random at load time).\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return str(target)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "--" for c in name.strip("/"))


def _complete(target: Path, config_json: str) -> bool:
    try:
        return (target / "config.json").read_text() == config_json and (target / "tokenizer.json").is_file()
    except OSError:
        return False
