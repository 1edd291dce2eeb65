"""Convert a llama.cpp GGUF checkpoint into an HF-style directory.

vLLM v0.27.1 has no GGUF loader (nothing under vllm/model_executor/model_loader/
reads the format). This project only needs one small GGUF (the default model),
so it does the simplest honest thing:
dequantize every tensor once, write a float32 `model.safetensors` with Hugging
Face names and layout, and rebuild `config.json`, `tokenizer.json`,
`tokenizer_config.json` and `generation_config.json` from the GGUF metadata.
After that the directory loads like any HF checkpoint, much faster than
transformers parsing (and dequantizing) the GGUF on every load.

Everything is read from the file's metadata; nothing about SmolLM2 is
hard-coded here. Only what the default model uses is supported (architecture
`llama`, a byte-level BPE tokenizer); anything else is refused by name.

    convert_gguf_to_hf(Path("model.gguf"), Path("out/"))
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

# NOTE: json.dumps of these files is deterministic (sorted keys, fixed indent),
# so converting the same GGUF twice gives byte-identical output.
_JSON: dict[str, Any] = dict(indent=2, sort_keys=True)

_MISSING = object()

# GGUF tensor names (inside "blk.{i}.") -> HF LlamaForCausalLM names.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3


class GGUFConversionError(ValueError):
    """The GGUF describes something this converter does not handle."""


# ---------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------

def read_metadata(reader) -> dict[str, Any]:
    """All key/value fields of a `gguf.GGUFReader` as plain Python values."""
    # NOTE: ReaderField.contents() decodes strings and arrays, the three big
    # tokenizer arrays (49k tokens, 49k types, 49k merges) included: the slow
    # part of reading the metadata, done once per conversion.
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}


def _get(meta: dict, key: str, default: Any = _MISSING) -> Any:
    if key in meta:
        return meta[key]
    if default is _MISSING:
        raise GGUFConversionError(f"GGUF metadata has no {key!r}")
    return default


def _f32(x: float) -> float:
    # NOTE: GGUF stores floats as float32, so 1e-5 comes back as
    # 9.999999747378752e-06. The shortest decimal that rounds to the same
    # float32 ("1e-05") is what the original config.json says, and a model
    # computing in float32 sees the identical value either way.
    return float(str(np.float32(x)))


def gguf_to_hf_config(meta: dict) -> dict:
    """A LlamaForCausalLM config.json dict from the GGUF's `llama.*` keys."""
    arch = _get(meta, "general.architecture")
    if arch != "llama":
        raise GGUFConversionError(
            f"GGUF architecture {arch!r} is not supported (only 'llama')")
    p = f"{arch}."
    hidden = int(_get(meta, p + "embedding_length"))
    n_heads = int(_get(meta, p + "attention.head_count"))
    n_kv = int(_get(meta, p + "attention.head_count_kv", n_heads))
    head_dim = int(_get(meta, p + "attention.key_length", hidden // n_heads))
    rope_dim = int(_get(meta, p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFConversionError(
            f"partial rotary embeddings (rope dim {rope_dim} != head_dim "
            f"{head_dim}) are not supported")
    if p + "rope.scaling.type" in meta:
        raise GGUFConversionError("RoPE scaling in a GGUF is not supported")
    tokens = _get(meta, "tokenizer.ggml.tokens")
    vocab = int(_get(meta, p + "vocab_size", len(tokens)))
    theta = _f32(_get(meta, p + "rope.freq_base", 10000.0))
    bos = int(_get(meta, "tokenizer.ggml.bos_token_id"))
    eos = int(_get(meta, "tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_get(meta, p + "feed_forward_length")),
        "num_hidden_layers": int(_get(meta, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": int(_get(meta, p + "context_length")),
        "rms_norm_eps": _f32(_get(meta, p + "attention.layer_norm_rms_epsilon")),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        # NOTE: both spellings on purpose: transformers >= 5 reads
        # `rope_parameters` (and leaves `rope_theta` None), older versions
        # and simple loaders read `rope_theta`.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        # Filled in by convert_gguf_to_hf once it knows whether output.weight
        # exists.
        "tie_word_embeddings": None,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": int(_get(meta, "tokenizer.ggml.padding_token_id", eos)),
        "torch_dtype": "float32",
    }


def generation_config(hf_config: dict) -> dict:
    return {"bos_token_id": hf_config["bos_token_id"],
            "eos_token_id": hf_config["eos_token_id"],
            "pad_token_id": hf_config["pad_token_id"]}


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------

def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    raise GGUFConversionError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q_proj / k_proj rows.

    HF Llama applies RoPE "rotate-half" style: within a head, dimension i is
    paired with i + head_dim/2. ggml's RoPE pairs adjacent dimensions (2i,
    2i+1), so llama.cpp's converter interleaves the two halves of every head's
    rows when writing the GGUF. Reading it back we de-interleave them.
    """
    rows, cols = w.shape
    # [rows, cols] -> [heads, head_dim/2, 2, cols]: the pair (2i, 2i+1) as
    # stored -> swap to [heads, 2, head_dim/2, cols]: halves, as HF wants.
    return (w.reshape(n_heads, rows // n_heads // 2, 2, cols)
             .swapaxes(1, 2).reshape(rows, cols))


def dequantize_tensor(tensor) -> np.ndarray:
    """One `gguf.ReaderTensor` as a float32 array in HF `[out, in]` layout."""
    from gguf.quants import dequantize

    # NOTE: GGUF lists dimensions innermost first (ggml's ne[0] is the row
    # length), so HF's [out, in] is the reversed GGUF shape.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    arr = dequantize(tensor.data, tensor.tensor_type)
    # np.array copies: F32 tensors come back as read-only views into the
    # memory-mapped file.
    return np.array(arr, dtype=np.float32).reshape(shape)


def convert_weights(reader, hf_config: dict,
                    progress: Callable[[str], None] = lambda _: None
                    ) -> dict[str, torch.Tensor]:
    """Every GGUF tensor dequantized to a float32 torch tensor, HF-named."""
    state_dict: dict[str, torch.Tensor] = {}
    n_layers = hf_config["num_hidden_layers"]
    for i, tensor in enumerate(reader.tensors):
        name = hf_tensor_name(tensor.name)
        arr = dequantize_tensor(tensor)
        if name.endswith("q_proj.weight"):
            arr = unpermute_qk(arr, hf_config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            arr = unpermute_qk(arr, hf_config["num_key_value_heads"])
        state_dict[name] = torch.from_numpy(arr)
        if (i + 1) % 50 == 0:
            progress(f"dequantized {i + 1}/{len(reader.tensors)} tensors")
    _check_complete(state_dict, n_layers)
    return state_dict


def _check_complete(state_dict: dict, n_layers: int) -> None:
    expected = {f"model.layers.{i}.{n}" for i in range(n_layers)
                for n in _LAYER_TENSORS.values()}
    expected |= {"model.embed_tokens.weight", "model.norm.weight"}
    missing = sorted(expected - state_dict.keys())
    if missing:
        raise GGUFConversionError(
            f"GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------

def _pre_tokenizer(pre: str):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # NOTE: SmolLM's own tokenizer.json splits every numeric char off
        # before the GPT-2 regex. Its merges contain no ASCII digit pairs, so
        # for ASCII digits plain GPT-2 splitting gives the same ids; not for
        # other numerics (" ¼" -> "Ġ", "Â¼" here, "ĠÂ", "¼" without the split).
        # transformers' GGUF tokenizer does the plain split: the integration
        # test compares against it piece by piece.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    raise GGUFConversionError(f"GGUF pre-tokenizer {pre!r} is not supported")


def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` (byte-level BPE) from `tokenizer.ggml.*`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _get(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(
            f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
    tokens: list[str] = _get(meta, "tokenizer.ggml.tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFConversionError("GGUF vocabulary has duplicate tokens")
    # NOTE: a byte-level vocabulary spells a space as "Ġ", so every merge is
    # exactly two tokens separated by one real space.
    merges = [tuple(m.split(" ")) for m in _get(meta, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_get(meta, "tokenizer.ggml.pre", "gpt2"))
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole and count as special
    # (skipped by decode(skip_special_tokens=True)). They are already in the
    # vocabulary, so adding them keeps their ids.
    types = _get(meta, "tokenizer.ggml.token_type")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types)
                            if ty == _TOKEN_TYPE_CONTROL])
    if _get(meta, "tokenizer.ggml.add_bos_token", False):
        bos = tokens[int(_get(meta, "tokenizer.ggml.bos_token_id"))]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, vocab[bos])])
    if tok.get_vocab_size() != len(tokens):
        raise GGUFConversionError("special tokens changed the vocabulary size")
    return tok


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: special tokens, flags and the chat template."""
    tokens = _get(meta, "tokenizer.ggml.tokens")

    def token(key: str):
        idx = meta.get(f"tokenizer.ggml.{key}")
        return None if idx is None else tokens[int(idx)]

    cfg = {
        # NOTE: the generic fast tokenizer class loads tokenizer.json as is;
        # a model-specific class (GPT2Tokenizer, ...) may rebuild parts of
        # the pipeline in transformers >= 5.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id") or token("eos_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_get(meta, "llama.context_length")),
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


# ---------------------------------------------------------------------------
# the whole conversion
# ---------------------------------------------------------------------------

def convert_gguf_to_hf(gguf_path: Path, out_dir: Path,
                       progress: Callable[[str], None] = lambda _: None) -> None:
    """Write an HF-style checkpoint directory for `gguf_path` into `out_dir`.

    `out_dir` must exist. The caller makes this atomic (see default_model.py):
    this function just writes files, the weights last but one.
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))  # memory-maps the file
    meta = read_metadata(reader)
    config = gguf_to_hf_config(meta)
    tok = build_tokenizer(meta)          # before the weights: fail early
    state_dict = convert_weights(reader, config, progress)
    # NOTE: no output.weight in the GGUF means the LM head reuses the token
    # embedding; writing a copy would double the file for nothing.
    config["tie_word_embeddings"] = "lm_head.weight" not in state_dict
    progress(f"writing model.safetensors ({_nbytes(state_dict) / 2**20:.0f} MiB, float32)")
    save_file(state_dict, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    del state_dict
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta))
    _write_json(out_dir / "generation_config.json", generation_config(config))
    _write_json(out_dir / "config.json", config)


def _nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, **_JSON) + "\n", encoding="utf-8")
