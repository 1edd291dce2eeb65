"""--speculative-config / LLM(speculative_config=...) -> SpeculativeConfig, and the async-scheduling
decision as v0.27.1 makes it: off by default with speculation, an error when asked for with ngram
(and with draft_model, which v0.27.1 runs async but this engine does not)."""
from __future__ import annotations

import argparse
import json

import pytest

from vllm_anatomy.engine.arg_utils import EngineArgs


@pytest.fixture
def model_dir(tmp_path):
    def write(path, vocab=512, max_pos=512):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "max_position_embeddings": max_pos}))
        return str(path)
    return write


def config(model, **kw):
    return EngineArgs(model=model, device="cpu", max_model_len=256, **kw).create_engine_config()


def test_cli_json_reaches_the_engine_args():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert EngineArgs.from_cli_args(args).speculative_config == '{"method": "ngram", "num_speculative_tokens": 2}'


def test_ngram_and_draft_model_configs(model_dir, tmp_path):
    target = model_dir(tmp_path / "target")
    cfg = config(target, speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    spec = cfg.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 2, 3, 3)
    assert cfg.num_speculative_tokens == 2 and cfg.scheduler_config.async_scheduling is False
    draft = model_dir(tmp_path / "draft")
    spec = config(target, speculative_config={"model": draft, "num_speculative_tokens": 4}).speculative_config
    assert spec.method == "draft_model" and spec.draft_model_config.model == draft
    assert spec.draft_model_config.max_model_len == 256 and spec.draft_model_config.hf_config["vocab_size"] == 512
    assert config(target).speculative_config is None


def test_refusals(model_dir, tmp_path):
    target = model_dir(tmp_path / "target")
    with pytest.raises(ValueError, match="same vocabulary size"):
        config(target, speculative_config={"model": model_dir(tmp_path / "other", vocab=1000),
                                           "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        config(target, speculative_config={"model": model_dir(tmp_path / "short", max_pos=128),
                                           "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="async scheduling is only supported"):
        config(target, async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    # v0.27.1's three cases: explicit async + draft_model runs; unset, async is off; explicit + ngram refused (above).
    assert config(target, async_scheduling=True, speculative_config={"model": target, "num_speculative_tokens": 2}
                  ).scheduler_config.async_scheduling is True
    assert config(target, async_scheduling=None, speculative_config={"model": target, "num_speculative_tokens": 2}
                  ).scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="not valid JSON"):
        config(target, speculative_config="{method: ngram}")
    with pytest.raises(ValueError, match="unknown speculative_config key"):
        config(target, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "typo": 1})
