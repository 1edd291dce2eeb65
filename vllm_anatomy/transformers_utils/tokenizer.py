"""Load the tokenizer of a local model directory.

Mirrors vllm/transformers_utils/tokenizer.py (get_tokenizer). vLLM adds
tokenizer modes (slow, mistral, custom) and remote-code options; here it is
the directory's tokenizer.json through transformers, with its chat template.
"""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def get_tokenizer(model_dir: str | Path, **kwargs) -> PreTrainedTokenizerBase:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir} is not a directory: tokenizers load from local files")
    # NOTE: local_files_only: nothing is ever fetched from a model hub at run time.
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **kwargs)
