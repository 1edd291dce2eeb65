"""Tiny random Llama / Qwen2 / Qwen3 models: our loader + forward equal transformers.

Each model is built by transformers from a small config, given large random
weights (the default init is so small that attention would be nearly uniform
and many bugs would hide), saved with save_pretrained and loaded back with
get_model. Between them the variants cover: GQA ratios 2, 3 and 4, head_dim !=
hidden / heads (Qwen3), q/k/v bias (Qwen2), o_proj and MLP bias (Llama with
attention_bias / mlp_bias), tied and untied embeddings, Llama-3 RoPE scaling,
and a checkpoint split into several shards with an index file.
"""
import json

import pytest
import torch
import transformers

from tests.helpers import PagedSequences, build_attn_metadata
from vllm_anatomy.config import ModelConfig
from vllm_anatomy.model_executor.loader import get_model
from vllm_anatomy.model_executor.layers.rotary_embedding import get_rope, get_rope_parameters

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
              max_position_embeddings=128, rms_norm_eps=1e-6)
VARIANTS = {
    "llama": (transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "qwen2": (transformers.Qwen2Config, dict(
        num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "qwen3": (transformers.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)),
}
PROMPTS = [
    [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 14, 50, 8, 29, 90, 1, 77, 36, 12, 4, 67],
    [40, 2, 95, 13, 13, 58, 7, 21, 84, 30, 3, 62, 19],
    [11, 70, 44, 6, 93, 25, 52, 38, 0, 81],
]


def randomize_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:       # norm weights around 1, biases around 0
                p.copy_(1 + 0.2 * noise if "norm" in name else 0.2 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:                  # 2 / sqrt(fan_in): large enough for peaked attention
                p.copy_(noise * 2 / p.shape[1] ** 0.5)


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(our model, transformers' model) for one variant, from the same directory."""
    config_cls, kwargs = VARIANTS[request.param]
    hf_model = getattr(transformers, config_cls.__name__.replace("Config", "ForCausalLM"))(
        config_cls(**COMMON, **kwargs)).eval()
    randomize_(hf_model, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    # NOTE: a tiny max_shard_size forces several shards + model.safetensors.index.json.
    hf_model.save_pretrained(path, max_shard_size="100KB" if request.param == "qwen2" else "50MB")
    model = get_model(ModelConfig(model=str(path), max_model_len=128))
    return model, hf_model


def hf_logits(hf_model, token_ids):
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0]      # [L, V]


def test_checkpoint_is_packed_and_tied(models):
    model, hf_model = models
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj" in n or ".gate_proj" in n for n in names)
    attn = model.model.layers[1].self_attn
    hf_attn = hf_model.model.layers[1].self_attn
    # q rows first, then k, then v: the packed matrix is the three stacked.
    torch.testing.assert_close(attn.qkv_proj.weight, torch.cat(
        [hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight]), atol=0, rtol=0)
    tied = hf_model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.num_kv_heads == hf_model.config.num_key_value_heads
    assert model.head_dim == hf_attn.head_dim


def test_single_prefill_matches(models):
    model, hf_model = models
    prompt = PROMPTS[0]
    seqs = PagedSequences(model, num_blocks=8, block_size=4)
    (logits,) = seqs.step([("a", prompt)])
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


def test_mixed_paged_batch_matches(models):
    """Chunked prefill continuing earlier context, decodes and a fresh prefill in one batch."""
    model, hf_model = models
    a, b, c = PROMPTS
    ref = {name: hf_logits(hf_model, p) for name, p in zip("abc", PROMPTS)}
    seqs = PagedSequences(model, num_blocks=32, block_size=4, seed=3)
    step1 = seqs.step([("a", a[:9]), ("b", b[:-1])])
    step2 = seqs.step([("b", b[-1:]), ("c", c), ("a", a[9:])])   # decode, prefill, chunk
    assert seqs.block_ids["a"] != sorted(seqs.block_ids["a"]), "blocks should be shuffled"
    for got, name, lo, hi in [(step1[0], "a", 0, 9), (step1[1], "b", 0, len(b) - 1),
                              (step2[0], "b", len(b) - 1, len(b)), (step2[1], "c", 0, len(c)),
                              (step2[2], "a", 9, len(a))]:
        torch.testing.assert_close(got, ref[name][lo:hi], atol=1e-4, rtol=1e-4)


def test_padded_batch_ignores_padding(models):
    """Extra padding tokens (slot -1) change neither the real tokens' output nor the cache."""
    model, hf_model = models
    prompt = PROMPTS[1]
    seqs = PagedSequences(model, num_blocks=8, block_size=16)
    positions, meta = build_attn_metadata([len(prompt)], [len(prompt)], [[2]], 16,
                                          num_padded_tokens=len(prompt) + 3)
    input_ids = torch.tensor(prompt + [7, 7, 7])
    with torch.inference_mode():
        hidden = model(input_ids, positions, seqs.kv_caches, meta)
        logits = model.compute_logits(hidden[:len(prompt)])
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)
    for kv_cache in seqs.kv_caches:
        assert kv_cache[:, [0, 1, 3, 4, 5, 6, 7]].abs().sum() == 0


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model.*GPT2LMHeadModel"):
        get_model(ModelConfig(model=str(tmp_path)))


def test_rope_parameters_both_config_spellings():
    old = {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0}}
    new = {"rope_theta": None, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                                   "factor": 8.0}}
    assert get_rope_parameters(old) == get_rope_parameters(new) | {"type": "llama3"}
    assert get_rope_parameters({})["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match="RoPE scaling type 'yarn' is not supported"):
        get_rope(64, 128, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})
