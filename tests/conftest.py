"""Fixtures shared by every test directory, and the markers that define the test lanes."""
import functools
import json
import os
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
# `make test-fast` runs `pytest -m fast`: the tests of these folders that are not marked
# slow, gpu or browser (plus any test marked fast by hand).
FAST_FOLDERS = ("unit", "kernel_tests", "dashboard")
# pytest-timeout's limit for a test marked slow (the default, `timeout` in pyproject.toml, is 600 s).
SLOW_TIMEOUT_S = 1800


@pytest.hookimpl(tryfirst=True)      # NOTE: before `-m` deselects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "browser" in item.fixturenames:
            item.add_marker(pytest.mark.browser)
        if "default_model_dir" in item.fixturenames:
            item.add_marker(pytest.mark.model)
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        try:
            folder = item.path.relative_to(TESTS_DIR).parts[0]
        except ValueError:
            continue
        if folder in FAST_FOLDERS and not any(item.get_closest_marker(m) for m in ("slow", "gpu", "browser")):
            item.add_marker(pytest.mark.fast)


def save_word_level_tokenizer(path: str, vocab_size: int = 512) -> None:
    """The tokenizer a tiny random model needs for the frontend: words t0 … t{vocab_size-1}
    (t0 unknown, t2 end of sequence), saved beside its weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t2", "unk_token": "t0"}, f)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The default model's converted directory (downloaded and converted on first use, then cached)."""
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    return str(ensure_default_model())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A small random Llama saved by transformers (no download needed on the GPU box)."""
    import torch
    import transformers
    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    save_word_level_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_smollm2_dir(tmp_path_factory):
    """The default model's attention shape (SmolLM2-135M: 9 q heads over 3 KV heads of 64, hidden 576,
    RoPE theta 1e5) in 2 layers with a small vocabulary, random weights saved by transformers."""
    import torch
    import transformers
    path = tmp_path_factory.mktemp("tiny_smollm2")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
                                   max_position_embeddings=512, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    save_word_level_tokenizer(str(path))
    return str(path)


# -- a declared dependency that does not import is an error, never a skip --------------------------
# NOTE: pytest.importorskip turns any ImportError into a skip. When transformers 5.25 met our old
# top-level kernels/ folder, `import transformers` raised ImportError: a module guarded by
# importorskip("transformers") would have vanished from the run as "skipped". Packages that
# pyproject.toml declares (its dependencies and the test extra) must import; only optional ones
# (the bench extra's matplotlib, say) may skip.

# NOTE: tomllib is Python >= 3.11's and the package admits 3.10 (requires-python): there the
# same lists are read from the installed distribution's Requires-Dist (`make setup` installs it
# from this pyproject.toml, and reinstalls when it changes).

@functools.lru_cache(maxsize=None)
def _declared_import_names() -> frozenset[str]:
    import re
    import sys
    from importlib import metadata
    if sys.version_info >= (3, 11):
        import tomllib
        with open(TESTS_DIR.parent / "pyproject.toml", "rb") as f:
            project = tomllib.load(f)["project"]
        requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    else:
        requirements = [req for req in metadata.requires("vllm_anatomy") or []
                        if "extra ==" not in req or re.search(r"extra == ['\"]test['\"]", req)]
    wanted = {re.split(r"[\s<>=!~\[;]", req, maxsplit=1)[0].lower().replace("_", "-")
              for req in requirements}
    return frozenset(top for top, dists in metadata.packages_distributions().items()
                     if any(d.lower().replace("_", "-") in wanted for d in dists))


def _skip_hides_a_broken_dependency(report) -> str | None:
    import re
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    found = re.search(r"could not import '([\w.]+)'", str(report.longrepr[2]))
    if found and found[1].split(".")[0] in _declared_import_names():
        return f"a declared dependency failed to import, which must fail the run: {report.longrepr[2]}"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if why := _skip_hides_a_broken_dependency(report):
        report.outcome, report.longrepr = "failed", why


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if why := _skip_hides_a_broken_dependency(report):
        report.outcome, report.longrepr = "failed", why
