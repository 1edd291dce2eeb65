"""Bad tensor-parallel configurations fail with one clear message, and leave nothing running.

The shape checks, NCCL on a CPU, more ranks than GPUs, and the executor
choice are refused by EngineArgs before any process starts; a failure inside
the ranks (a checkpoint missing a tensor) stops every rank that did start.
"""
import json
import shutil
import subprocess
import sys

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_anatomy import LLM
from vllm_anatomy.engine.arg_utils import EngineArgs

BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5)


def _config_dir(tmp_path, **overrides) -> str:
    """A model directory with only config.json: EngineArgs reads nothing else."""
    path = tmp_path / "_".join(["model"] + [f"{k}{v}" for k, v in overrides.items()])
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**BASE, **overrides}))
    return str(path)


def _children() -> set[int]:
    """This process' descendants, but multiprocessing's resource tracker (one per
    process, started by the first shared-memory queue and kept until exit)."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())}


@pytest.mark.parametrize("overrides, tp, message", [
    ({}, 3, r"Total number of attention heads \(4\) must be divisible by tensor parallel size \(3\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96}, 3,
     r"Total number of KV heads \(2\) must be divisible by tensor parallel size \(3\), or tensor parallel "
     r"size by it"),
    ({"intermediate_size": 250}, 4, r"MLP intermediate size \(250\) must be divisible by tensor parallel size \(4\)"),
    ({"vocab_size": 510}, 4, r"Vocabulary size \(510\) must be divisible by tensor parallel size \(4\)"),
])
def test_shapes_that_do_not_divide(tmp_path, overrides, tp, message):
    before = _children()
    with pytest.raises(ValueError, match=message):
        LLM(model=_config_dir(tmp_path, **overrides), tensor_parallel_size=tp)
    assert _children() == before


def test_nccl_on_the_cpu(tmp_path):
    before = _children()
    with pytest.raises(ValueError, match=r"'nccl' needs CUDA devices, but this run is on the CPU: use 'gloo'"):
        LLM(model=_config_dir(tmp_path), device="cpu", tensor_parallel_size=2, distributed_backend="nccl")
    assert _children() == before


def test_more_ranks_than_gpus(tmp_path, monkeypatch):
    # No GPU here: pretend there is one, so that two ranks are one too many.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 puts 2 ranks on this host, one per GPU, "
                                         r"but it has 1 GPU\(s\)"):
        EngineArgs(model=_config_dir(tmp_path), device="cuda", tensor_parallel_size=2).create_engine_config()


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), r"needs worker processes"),
    (dict(tensor_parallel_size=3, nnodes=2), r"tensor_parallel_size \(3\) must be divisible by nnodes \(2\)"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), r"0 <= node_rank < nnodes"),
])
def test_executor_choices(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=_config_dir(tmp_path), **kwargs).create_engine_config()


def test_shapes_that_divide(tmp_path):
    # 8 heads, 8 KV heads, 256 features, 512 words: all divide by 8; 2 KV heads by 4 (replicated)
    EngineArgs(model=_config_dir(tmp_path, num_attention_heads=8, num_key_value_heads=8),
               tensor_parallel_size=8).create_engine_config()
    EngineArgs(model=_config_dir(tmp_path), tensor_parallel_size=4).create_engine_config()


def test_more_than_one_rank_picks_worker_processes(tmp_path):
    config = EngineArgs(model=_config_dir(tmp_path), tensor_parallel_size=2).create_engine_config()
    pc = config.parallel_config
    assert (pc.distributed_executor_backend, pc.world_size, pc.distributed_backend) == ("mp", 2, "gloo")
    one = EngineArgs(model=_config_dir(tmp_path, num_hidden_layers=1)).create_engine_config().parallel_config
    assert (one.distributed_executor_backend, one.world_size, one.distributed_backend) == ("uni", 1, None)


def test_cli_says_it_and_exits(tmp_path):
    out = subprocess.run([sys.executable, "-m", "vllm_anatomy.entrypoints.cli.main", "generate",
                          "--model", _config_dir(tmp_path), "-tp", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "vllm-anatomy: error: Total number of attention heads (4) must be divisible by tensor " \
           "parallel size (3)." in out.stderr


def test_a_rank_failing_to_load_stops_every_rank(tiny_tp_models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_tp_models["llama"], broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    before = _children()
    with pytest.raises(RuntimeError, match=r"WorkerProc rank \d failed to start:(.|\n)*checkpoint lacks weights "
                                           r"for \['model.layers.1.mlp.down_proj.weight'\]"):
        LLM(model=str(broken), tensor_parallel_size=2)
    assert _children() == before
