"""load_format="dummy" (vLLM's DummyModelLoader): the real shapes from a config, random weights, nothing
read from a checkpoint — run on the CPU with the built-in 2-layer config, and the article's configs
checked against their published sizes (Llama-2-7B: 6.74 B parameters, 13.5 GB in FP16)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from vllm_anatomy.config import LoadConfig
from vllm_anatomy.model_executor.dummy_configs import DUMMY_CONFIGS, builtin_config, num_parameters


def test_the_article_configs_have_their_published_sizes():
    p7 = num_parameters(DUMMY_CONFIGS["meta-llama/Llama-2-7b-hf"])
    assert p7 == 6_738_415_616                        # Llama-2-7b-hf's parameter count
    assert round(2 * p7 / 1e9, 1) == 13.5             # §七: "13.5 GB of weights" in FP16
    p70 = num_parameters(DUMMY_CONFIGS["meta-llama/Llama-2-70b-hf"])
    assert p70 == 68_976_648_192
    assert DUMMY_CONFIGS["meta-llama/Llama-2-70b-hf"]["num_hidden_layers"] * 2 == 160   # §九 Q5: 160 all-reduces
    assert builtin_config("llama-2-7b") == DUMMY_CONFIGS["meta-llama/Llama-2-7b-hf"]
    assert builtin_config("no-such-model") is None


def test_load_format_is_checked():
    assert LoadConfig("DUMMY").load_format == "dummy"
    with pytest.raises(ValueError, match="load_format must be one of"):
        LoadConfig("pt")


def test_dummy_weights_depend_only_on_size_and_are_small():
    from vllm_anatomy.model_executor.dummy_loader import initialize_dummy_weights
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    initialize_dummy_weights(a)
    initialize_dummy_weights(b)
    assert torch.equal(a.weight, b.weight) and a.weight.abs().max() <= 1e-3 and a.weight.std() > 0


@pytest.mark.model
def test_a_dummy_model_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch, default_model_dir):
    """The tiny built-in config: its directory is made once (config + the default model's tokenizer, no
    weights file), the engine builds the real shapes, fills random weights, and generates; the run meta
    records the load format."""
    _private_cache(tmp_path, monkeypatch, default_model_dir)
    from vllm_anatomy import LLM, SamplingParams
    from vllm_anatomy.tracing.reader import open_run
    llm = LLM("vllm-anatomy/tiny-llama", load_format="dummy", trace_level="full", trace_dir=str(tmp_path),
              max_model_len=128, num_gpu_blocks_override=32, attention_backend="torch")
    model_dir = llm.llm_engine.vllm_config.model_config.model
    assert json.load(open(os.path.join(model_dir, "config.json")))["num_hidden_layers"] == 2
    assert not [f for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    w = runner.model.model.layers[0].mlp.down_proj.weight
    assert w.shape[1] == 128 and 0 < w.abs().max() <= 1e-3          # the config's shape, random values
    outs = llm.generate([{"prompt_token_ids": [5, 17, 300, 1999]}] * 2,
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 and max(o.outputs[0].token_ids) < 2048 for o in outs)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids           # greedy: same prompt, same tokens
    path = llm.llm_engine.recorder.run_path
    llm.llm_engine.shutdown()
    with open_run(path) as run:
        assert run.meta["config"]["load_config"]["load_format"] == "dummy"


def _private_cache(tmp_path, monkeypatch, default_model_dir: str) -> None:
    """Dummy directories under tmp_path (not the shared cache); the tokenizer from the default model."""
    from pathlib import Path
    monkeypatch.setenv("VLLM_ANATOMY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("vllm_anatomy.model_executor.dummy_loader.ensure_default_model",
                        lambda quiet=False: Path(default_model_dir))


@pytest.mark.model
def test_a_directory_without_its_tokenizer_gets_the_default_one(tmp_path, monkeypatch, default_model_dir):
    """--model DIR --load-format dummy with only a config.json: the engine's directory is made under the cache."""
    from vllm_anatomy.model_executor.dummy_loader import dummy_model_dir
    _private_cache(tmp_path, monkeypatch, default_model_dir)
    src = tmp_path / "cfg"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(DUMMY_CONFIGS["vllm-anatomy/tiny-llama"]))
    d = dummy_model_dir(str(src))
    assert d.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(d, "tokenizer.json"))
    assert dummy_model_dir(str(src)) == d                                     # made once
