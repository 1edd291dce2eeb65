"""Fixtures shared by every test directory."""
import json
import os

import pytest


def save_word_level_tokenizer(path: str, vocab_size: int = 512) -> None:
    """The tokenizer a tiny random model needs for the frontend: words t0 … t{vocab_size-1}
    (t0 unknown, t2 end of sequence), saved beside its weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t2", "unk_token": "t0"}, f)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The default model's converted directory (downloaded and converted on first use, then cached)."""
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    return str(ensure_default_model())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A small random Llama saved by transformers (no download needed on the GPU box)."""
    import torch
    import transformers
    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    save_word_level_tokenizer(str(path))
    return str(path)
