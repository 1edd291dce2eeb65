"""The package installs the Triton kernels as vllm_anatomy.kernels, never as a
top-level `kernels` that would shadow the PyPI package transformers probes for."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, cwd: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, check=True,
                          capture_output=True, text=True, timeout=300).stdout.strip()


def test_kernels_installed_under_package(tmp_path):
    out = _run("import vllm_anatomy.kernels as k, importlib.util as u; "
               "print(k.__file__); print(u.find_spec('kernels'))", cwd=str(tmp_path))
    kernels_file, top_level = out.splitlines()
    assert kernels_file == os.path.join(REPO, "kernels", "__init__.py")
    assert top_level == "None", "a top-level `kernels` package is importable from a neutral cwd"


@pytest.mark.parametrize("where", ["neutral", "repo"])
def test_transformers_imports_and_runs(tmp_path, where):
    cwd = str(tmp_path) if where == "neutral" else REPO
    code = ("import torch, transformers\n"
            "from transformers.utils import is_kernels_available\n"
            "assert not is_kernels_available(), 'transformers sees a `kernels` package'\n"
            "cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,"
            " num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)\n"
            "m = transformers.LlamaForCausalLM(cfg).eval()\n"
            "print(tuple(m(torch.tensor([[1, 2, 3]])).logits.shape))\n")
    assert _run(code, cwd) == "(1, 3, 64)"


def test_top_level_names_do_not_import_torch():
    code = ("import sys, vllm_anatomy; from vllm_anatomy.sampling_params import SamplingParams; "
            "print('torch' in sys.modules)")
    assert _run(code, REPO) == "False"


def test_every_subpackage_is_listed_in_pyproject():
    # The package list is explicit (the kernels folder is remapped), so a new
    # subpackage missing from it would vanish from a non-editable install.
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {"vllm_anatomy.kernels"}
    for root, dirs, files in os.walk(os.path.join(REPO, "vllm_anatomy")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            found.add(os.path.relpath(root, REPO).replace(os.sep, "."))
    assert found == listed
