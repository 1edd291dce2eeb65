"""Tiny random Llama / Qwen2 / Qwen3 checkpoints whose shapes divide by 2 and 4.

4 query heads and 2 KV heads: TP=2 splits both, TP=4 replicates each KV head
on two ranks. Random biases (Qwen2's q/k/v), random norm weights (Qwen3's
per-head q/k norms) and an untied LM head (Qwen2) so that every sharded or
replicated weight matters; a large init scale so greedy tokens vary.
"""
from typing import Any

import pytest

from tests.conftest import save_word_level_tokenizer

ARCHS = ("llama", "qwen2", "qwen3")


def make_tiny_model(path: str, arch: str) -> str:
    import torch
    import transformers
    common: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  initializer_range=0.2)
    torch.manual_seed(0)                  # (before the weights' init; building a config draws nothing)
    model: transformers.PreTrainedModel
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=True, **common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=False, **common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=48, tie_word_embeddings=True, **common))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(path)
    save_word_level_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_tp_models(tmp_path_factory) -> dict[str, str]:
    return {arch: make_tiny_model(str(tmp_path_factory.mktemp(f"tiny_{arch}")), arch) for arch in ARCHS}


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    # Spawned ranks inherit the environment: one torch thread each on these 2 cores.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
