"""Model shapes for `load_format="dummy"`: config.json contents of the article's models.

vLLM reads a `--model` name's config.json from the Hugging Face hub and, with
`--load-format dummy`, fills the weights with random values (DummyModelLoader): the
shapes and the arithmetic are the real model's, nothing is downloaded but the config.
This project reaches no hub, so the configs of the models the article measures are
built in, by their hub names (the values of their published config.json files):

    meta-llama/Llama-2-7b-hf    the article's §七 setup: 32 layers, 6.74 B parameters
                                (13.5 GB in FP16, read once per decode step)
    meta-llama/Llama-2-70b-hf   a 70B-class model for tensor parallelism: 80 layers, so
                                2 x 80 = 160 all-reduces per step (§九 Q5's communication account)
    vllm-anatomy/tiny-llama     a 2-layer Llama of the same family, for CPU tests of the path

A local directory with a config.json works too (`--model DIR --load-format dummy`).
"""
from __future__ import annotations

_LLAMA_COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
                 "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 32000,
                 "max_position_embeddings": 4096, "torch_dtype": "float16"}

DUMMY_CONFIGS: dict[str, dict] = {
    "meta-llama/Llama-2-7b-hf": {**_LLAMA_COMMON, "hidden_size": 4096, "intermediate_size": 11008,
                                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32},
    "meta-llama/Llama-2-70b-hf": {**_LLAMA_COMMON, "hidden_size": 8192, "intermediate_size": 28672,
                                  "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8},
    "vllm-anatomy/tiny-llama": {**_LLAMA_COMMON, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 2048, "max_position_embeddings": 2048, "torch_dtype": "float32"},
}
# Short names for the command line.
ALIASES = {"llama-2-7b": "meta-llama/Llama-2-7b-hf", "llama-2-70b": "meta-llama/Llama-2-70b-hf",
           "tiny-llama": "vllm-anatomy/tiny-llama"}


def builtin_config(name: str) -> dict | None:
    """The built-in config.json of `name` (a hub name or its short alias), or None."""
    cfg = DUMMY_CONFIGS.get(ALIASES.get(name, name))
    return dict(cfg) if cfg is not None else None


def num_parameters(cfg: dict) -> int:
    """Parameters of a Llama-family config (embedding, layers, final norm, lm_head unless tied)."""
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv = (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * head_dim
    attn = h * (cfg["num_attention_heads"] * head_dim) + 2 * h * kv + cfg["num_attention_heads"] * head_dim * h
    per_layer = attn + 3 * h * inter + 2 * h
    return vocab * h + layers * per_layer + h + (0 if cfg.get("tie_word_embeddings") else vocab * h)
