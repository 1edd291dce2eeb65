"""The converted default model against transformers' own GGUF loading.

transformers can read the same GGUF directly (slowly: ~16 s for the model,
~14 s for the tokenizer, each loaded once per module here). Our converted
directory must give bit-identical weights, the same config, the same logits,
and a tokenizer that encodes, decodes and applies the chat template the same.
"""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_anatomy.transformers_utils import default_model as dm

pytestmark = pytest.mark.model

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world",
    "In 2024, 12345 people paid $3.50 for 1.5x more.",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "def f(x):\n    return x ** 2  # comment",
    "Ünïcödé, 日本語, emoji 🚀🙂, and Ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>x<file_sep>y<|endoftext|>",
    "don't won't it's I'm we'll they've",
    "",
]


@pytest.fixture(scope="module")
def model_dir():
    return dm.ensure_default_model(quiet=True)


@pytest.fixture(scope="module")
def gguf_file():
    return dm.default_gguf_path(quiet=True)


@pytest.fixture(scope="module")
def gguf_model(gguf_file):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_file):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def our_tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def test_cache_is_complete_and_gguf_verified(model_dir, gguf_file):
    assert dm.is_complete(model_dir, dm.SMOLLM2_SOURCE)
    assert dm.sha256_file(gguf_file) == dm.SMOLLM2_SOURCE.gguf_sha256


def test_weights_bit_identical_to_transformers_gguf_load(model_dir, gguf_model):
    from safetensors.torch import load_file
    ours = load_file(model_dir / "model.safetensors")
    theirs = gguf_model.state_dict()
    # Tied: transformers exposes lm_head.weight, we store only the embedding.
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    assert len(ours) == 272
    for name, t in theirs.items():
        mine = ours["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert mine.dtype == torch.float32 and torch.equal(mine, t), name


def test_config_matches_transformers_reading_of_the_gguf(model_dir, gguf_model):
    cfg = json.loads((model_dir / "config.json").read_text())
    ref = gguf_model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert torch.tensor(cfg["rms_norm_eps"], dtype=torch.float32) == \
        torch.tensor(ref.rms_norm_eps, dtype=torch.float32)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)


def test_converted_dir_gives_same_logits_and_answer(model_dir, gguf_model, our_tokenizer):
    from transformers import AutoModelForCausalLM
    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = our_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, gguf_model(ids).logits)
        out = ours.generate(ids, max_new_tokens=10, do_sample=False)
    answer = our_tokenizer.decode(out[0, ids.shape[1]:])
    assert answer.startswith("The capital of France is Paris."), answer
    assert out[0, -1].item() == our_tokenizer.eos_token_id or "<|im_end|>" in answer


def test_tokenizer_matches_gguf_tokenizer(our_tokenizer, gguf_tokenizer):
    assert len(our_tokenizer) == len(gguf_tokenizer) == 49152
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(our_tokenizer, attr) == getattr(gguf_tokenizer, attr), attr
    assert (our_tokenizer.bos_token_id, our_tokenizer.eos_token_id) == (1, 2)
    for text in TEXTS:
        ids = our_tokenizer(text)["input_ids"]
        assert ids == gguf_tokenizer(text)["input_ids"], text
        for skip in (False, True):
            assert our_tokenizer.decode(ids, skip_special_tokens=skip) == \
                gguf_tokenizer.decode(ids, skip_special_tokens=skip), text
    assert our_tokenizer.decode(our_tokenizer("Hi 42!")["input_ids"]) == "Hi 42!"


def test_chat_template_matches(our_tokenizer, gguf_tokenizer):
    for msgs in (CHAT, [{"role": "system", "content": "Be brief."}, *CHAT]):
        ours = our_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ours == gguf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                          tokenize=False)
    text = our_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def _digit_pieces(text: str) -> list[str]:
    """SmolLM's first pre-tokenizer, Digits(individual_digits=True): every char whose
    Unicode category is a number (Nd, Nl, No: Rust's char::is_numeric) alone."""
    pieces, run = [], ""
    for ch in text:
        if unicodedata.category(ch)[0] == "N":
            pieces += [run, ch] if run else [ch]
            run = ""
        else:
            run += ch
    return pieces + ([run] if run else [])


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
@example(" ¼ and ٣½, x²3 in 2024")
def test_tokenizer_agrees_on_random_text(our_tokenizer, gguf_tokenizer, text):
    ours = our_tokenizer(text)["input_ids"]
    # NOTE: transformers' GGUF tokenizer has the GPT-2 byte-level pre-tokenizer
    # only; SmolLM's tokenizer.json (and ours) first splits off every numeric
    # char. ASCII digits never merge, so that changes nothing for them -- but
    # " ¼" is "Ġ" + "Â¼" for SmolLM and "ĠÂ" + "¼" for the GGUF tokenizer. So:
    # ours == the GGUF tokenizer run on SmolLM's digit pieces, always, and ==
    # the GGUF tokenizer on the whole text when no non-ASCII numeric occurs.
    assert ours == [i for piece in _digit_pieces(text) for i in gguf_tokenizer(piece)["input_ids"]]
    if all(ch.isascii() or unicodedata.category(ch)[0] != "N" for ch in text):
        assert ours == gguf_tokenizer(text)["input_ids"]


def test_numeric_chars_split_off_as_smollm_does(our_tokenizer, gguf_tokenizer):
    """The case hypothesis found: the GGUF tokenizer keeps " ¼" together, SmolLM does not."""
    assert our_tokenizer(" ¼")["input_ids"] == [216, 28151]            # "Ġ", "Â¼"
    assert gguf_tokenizer(" ¼")["input_ids"] == [3351, 137]            # "ĠÂ", "¼"
    assert our_tokenizer.backend_tokenizer.pre_tokenizer.__class__.__name__ == "Sequence"


def test_resolve_model_and_cli(model_dir, capsys):
    for name in (None, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
                 str(model_dir)):
        assert Path(dm.resolve_model(name)).resolve() == model_dir.resolve(), name
    assert dm.download_main([]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)
