"""Load the tokenizer of a local model directory.

Mirrors vllm/tokenizers/registry.py (get_tokenizer). vLLM adds
tokenizer modes (slow, mistral, model-specific ones) and remote-code options;
here it is
the directory's tokenizer.json through transformers, with its chat template.
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def get_tokenizer(model_dir: str | Path, **kwargs) -> PreTrainedTokenizerBase:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir} is not a directory: tokenizers load from local files")
    # NOTE: local_files_only: nothing is ever fetched from a model hub at run time.
    # A tokenizer_config.json that names PreTrainedTokenizerFast (the default model's)
    # is loaded by that class: the same tokenizer AutoTokenizer returns, without its
    # detour through AutoConfig, which imports the model family's transformers
    # modules (about a second of CPU at every engine start on a small CPU).
    if _tokenizer_class(model_dir) == "PreTrainedTokenizerFast":
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True, **kwargs)
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **kwargs)


def _tokenizer_class(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
