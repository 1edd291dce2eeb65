"""No folder or module of ours shadows an installed distribution, wherever Python starts.

transformers >= 5.25 imports the PyPI package `kernels` (Hugging Face's kernel hub) at
start-up; our Triton kernels were a top-level `kernels/` folder, so from the repo root
`import transformers` failed (2026-12-06). They now live in vllm_anatomy/kernels/. These
tests pin that from every directory a learner's Python starts in: the repo root
(`python`, `python -m pytest`, the dashboard), bench/, lessons/, scripts/ and the test
folders (pytest's rootdir-less `prepend` import mode puts each on sys.path).
"""
import os
import subprocess
import sys
import sysconfig
from importlib import metadata

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP_DIRS = {".git", ".venv", ".venv-latest", ".cache", "samples", "__pycache__", "node_modules", "build"}
OUR_DISTRIBUTION = "vllm_anatomy"
SITE = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}


def _ours(path: str) -> bool:
    """A file of the repo's own, not of the venv that may live inside it (.venv/)."""
    return path.startswith(REPO + os.sep) and not any(path.startswith(s + os.sep) for s in SITE)


def _run(code: str, cwd: str, pythonpath: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"in {cwd}:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip()


def _script_dirs() -> list[str]:
    """Every folder of the repo holding Python files: each can be sys.path[0] for somebody.
    Our package's own folders are not: they import only as vllm_anatomy.*."""
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")
                         and not (root == REPO and d == OUR_DISTRIBUTION))
        if any(f.endswith(".py") for f in files) or root == REPO:
            out.append(root)
    return out


def _installed_top_level_names() -> dict[str, set[str]]:
    """Import name -> the distributions that install it (top-level packages and modules)."""
    names: dict[str, set[str]] = {}
    for top, dists in metadata.packages_distributions().items():
        if not top.isidentifier():
            continue
        names.setdefault(top, set()).update(d for d in dists if d.replace("-", "_") != OUR_DISTRIBUTION)
    for dist in metadata.distributions():
        name = dist.metadata["Name"].replace("-", "_").lower()
        if name != OUR_DISTRIBUTION:
            names.setdefault(name, set()).add(dist.metadata["Name"])
    return {k: v for k, v in names.items() if v}


def test_no_folder_or_module_of_ours_is_named_like_an_installed_distribution():
    installed = _installed_top_level_names()
    assert "kernels" in installed or "transformers" in installed   # the check sees the venv
    clashes = []
    for folder in _script_dirs():
        for entry in sorted(os.listdir(folder)):
            path = os.path.join(folder, entry)
            name = entry[:-3] if entry.endswith(".py") else entry
            is_module = entry.endswith(".py") or (os.path.isdir(path) and entry not in SKIP_DIRS
                                                 and any(f.endswith(".py") for f in os.listdir(path)))
            if is_module and name in installed and not (folder == REPO and name == OUR_DISTRIBUTION):
                clashes.append(f"{os.path.relpath(path, REPO)} shadows {sorted(installed[name])}")
    assert not clashes, "\n".join(clashes)


@pytest.mark.parametrize("where", ["repo", "bench", "lessons", "scripts", "dashboard", "tests/unit"])
def test_transformers_imports_from_every_start_directory(where):
    """transformers' Llama/Qwen configs and activations import as a script there would see them,
    and `kernels` (when installed, as transformers >= 5.25 requires) is the PyPI one."""
    folder = REPO if where == "repo" else os.path.join(REPO, where)
    code = ("import sys; sys.path.insert(0, '.')\n"          # what `python script.py` puts first
            "import importlib.util, torch, transformers\n"
            "from transformers import LlamaConfig, Qwen2Config, Qwen3Config\n"
            "from transformers.activations import ACT2FN\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(spec.origin if spec else None)\n"
            "cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,"
            " num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)\n"
            "m = transformers.LlamaForCausalLM(cfg).eval()\n"
            "print(tuple(m(torch.tensor([[1, 2, 3]])).logits.shape), ACT2FN['silu'].__class__.__name__)\n")
    origin, shape = _run(code, folder).splitlines()
    assert origin == "None" or not _ours(origin), f"`kernels` resolves to {origin}"
    assert shape == "(1, 3, 64) SiLUActivation"


def test_pypi_kernels_package_imports_from_the_repo_root():
    try:
        metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("the PyPI package `kernels` is not installed (transformers no longer requires it)")
    origin = _run("import kernels; print(kernels.__file__)", REPO)
    assert not _ours(origin), origin


def test_kernels_import_as_part_of_the_package(tmp_path):
    out = _run("import vllm_anatomy.kernels.unified_attention as k; print(k.__file__)", cwd=str(tmp_path))
    assert out == os.path.join(REPO, "vllm_anatomy", "kernels", "unified_attention.py")


@pytest.mark.slow
def test_a_built_wheel_carries_the_kernels(tmp_path):
    """A normal (non-editable) install: the wheel setuptools builds holds every subpackage."""
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), REPO], check=True, timeout=600, capture_output=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    *map(str, wheel_dir.glob("*.whl"))], check=True, timeout=600, capture_output=True)
    expected = sorted(os.path.relpath(os.path.join(root, f), REPO)
                      for root, dirs, files in os.walk(os.path.join(REPO, "vllm_anatomy"))
                      for f in files if f.endswith(".py"))
    shipped = sorted(os.path.relpath(os.path.join(root, f), target)
                     for root, dirs, files in os.walk(target / "vllm_anatomy")
                     for f in files if f.endswith(".py"))
    assert shipped == expected
    out = _run("import vllm_anatomy.kernels.unified_attention as k; print(k.__file__)",
               cwd=str(tmp_path), pythonpath=str(target))
    assert out == str(target / "vllm_anatomy" / "kernels" / "unified_attention.py")


def test_top_level_names_do_not_import_torch():
    code = ("import sys, vllm_anatomy; from vllm_anatomy.sampling_params import SamplingParams; "
            "print('torch' in sys.modules)")
    assert _run(code, REPO) == "False"
