"""Run vLLM 0.27.1's own core unit tests against vllm_anatomy through an import map.

    PYTHONPATH=$PWD python scripts/vllm_import_map.py [--tests DIR] [--json OUT.json] [pytest args...]

DIR defaults to /work/vllm-src/sdist/vllm-0.27.1/tests (vLLM's sdist; `pip download --no-binary :all:
--no-deps vllm==0.27.1` and unpack it). The files run are DIR/v1/core/*.py (and prefix_cache/);
pass test paths or -k after the options to narrow it. Prints passed/failed/error counts per file and
writes them as JSON with --json.

How: a meta-path finder answers every `import vllm...`. A module we mirror (MODULE_MAP) is our
module itself, so a test drives our code unchanged; a name our module lacks, and every module we do
not mirror, is a `Missing` placeholder that raises NotInAnatomy when used (so a test of a feature we
lack fails, it is not skipped). The few ADAPTERS build our configs from vLLM's test keywords
(vLLM's ModelConfig reads a model's config.json from the hub; here the model's max length is given).
Nothing of vLLM's is copied: vLLM's test files are read from DIR and run as they are, assertions
untouched. vLLM's own conftest.py is not loaded (--noconftest): it imports all of vLLM.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import json
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

DEFAULT_TESTS = Path("/work/vllm-src/sdist/vllm-0.27.1/tests")

# vLLM module -> ours.
MODULE_MAP = {
    "vllm.sampling_params": "vllm_anatomy.sampling_params",
    "vllm.v1.request": "vllm_anatomy.core.request",
    "vllm.v1.engine": "vllm_anatomy.engine.protocol",
    "vllm.v1.outputs": "vllm_anatomy.core.outputs",
    "vllm.v1.core.kv_cache_utils": "vllm_anatomy.core.kv_cache_utils",
    "vllm.v1.core.block_pool": "vllm_anatomy.core.block_pool",
    "vllm.v1.core.kv_cache_manager": "vllm_anatomy.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator": "vllm_anatomy.core.kv_cache_coordinator",
    "vllm.v1.core.single_type_kv_cache_manager": "vllm_anatomy.core.single_type_kv_cache_manager",
    "vllm.v1.core.sched.scheduler": "vllm_anatomy.core.sched.scheduler",
    "vllm.v1.core.sched.async_scheduler": "vllm_anatomy.core.sched.async_scheduler",
    "vllm.v1.core.sched.output": "vllm_anatomy.core.sched.output",
    "vllm.v1.core.sched.interface": "vllm_anatomy.core.sched.interface",
    "vllm.v1.core.sched.request_queue": "vllm_anatomy.core.sched.request_queue",
    "vllm.v1.core.sched.utils": "vllm_anatomy.core.sched.utils",
    "vllm.v1.kv_cache_interface": "vllm_anatomy.kv_cache_interface",
    "vllm.v1.structured_output": "vllm_anatomy.structured_output",
    "vllm.v1.structured_output.request": "vllm_anatomy.structured_output.request",
    "vllm.v1.metrics.stats": "vllm_anatomy.metrics.stats",
    "vllm.distributed.kv_events": "vllm_anatomy.distributed.kv_events",
    "vllm.config.kv_events": "vllm_anatomy.config",
}


class NotInAnatomy(Exception):
    """A vLLM name this project does not have."""


class Missing:
    """Stands for a vLLM name we do not mirror: importing it works, using it raises."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise NotInAnatomy(self._name)

    __call__ = __iter__ = __bool__ = __len__ = __enter__ = __eq__ = __hash__ = _fail  # type: ignore[assignment]

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __getitem__(self, item: Any) -> Missing:
        return self      # Missing[int] in an annotation

    def __or__(self, other: Any) -> Missing:
        return self      # Missing | None in an annotation

    __ror__ = __or__

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (MissingBase,)

    def __repr__(self) -> str:
        return f"<not in vllm_anatomy: {self._name}>"


class MissingBase:
    """The base of a test's subclass of a Missing class: instantiating it fails."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotInAnatomy(type(self).__name__)


class ModuleProxy(types.ModuleType):
    """vllm.<name>: our module's names, adapters first, Missing for the rest. Setting an
    attribute (monkeypatch) sets it on our module."""

    def __init__(self, name: str, ours: types.ModuleType | None, adapters: dict[str, Any]) -> None:
        super().__init__(name)
        object.__setattr__(self, "_ours", ours)
        object.__setattr__(self, "_adapters", adapters)
        self.__path__: list[str] = []      # a package: submodules import through the finder

    def __getattr__(self, attr: str) -> Any:
        adapters = object.__getattribute__(self, "_adapters")
        if attr in adapters:
            return adapters[attr]
        ours = object.__getattribute__(self, "_ours")
        if ours is not None and hasattr(ours, attr):
            return getattr(ours, attr)
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self.__name__}.{attr}")

    def __setattr__(self, attr: str, value: Any) -> None:
        ours = object.__getattribute__(self, "_ours")
        if attr.startswith("__") or ours is None:
            object.__setattr__(self, attr, value)
        else:
            setattr(ours, attr, value)

    def __delattr__(self, attr: str) -> None:
        ours = object.__getattribute__(self, "_ours")
        delattr(ours if ours is not None else self, attr)


# -- adapters: vLLM's test-side constructors, building our objects ---------------------------

# max_model_len vLLM's ModelConfig reads from each test model's config.json.
KNOWN_MODELS = {"facebook/opt-125m": 2048, "Qwen/Qwen3-0.6B": 40960, "meta-llama/Llama-3.2-1B-Instruct": 131072}


def _split(kwargs: dict[str, Any], cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """Keep the keywords `cls` has; a dropped keyword must hold vLLM's default (else: a feature we lack)."""
    names = {f.name for f in dataclasses.fields(cls)}
    kept = {}
    for key, value in kwargs.items():
        if key in names:
            kept[key] = value
        elif key in defaults and value == defaults[key]:
            continue
        else:
            raise NotInAnatomy(f"{cls.__name__}({key}={value!r})")
    return kept


def _adapters() -> dict[str, dict[str, Any]]:
    import torch

    from vllm_anatomy import config as ours

    @dataclasses.dataclass
    class MockKVConfig:
        """vLLM's test helper type (tests/v1/kv_connector/unit/utils.py): a KV connector's
        test settings. Only its type is needed here; a test that passes one asks for a
        KV connector, which KVTransferConfig (Missing) then refuses."""
        matched_tokens: int = 0
        is_async: bool = False
        num_defers_before_matching: int = 0

    class TestModelConfig(ours.ModelConfig):
        """vLLM's ModelConfig(model=...): our ModelConfig with the model's max length."""
        is_encoder_decoder = False
        is_diffusion = False

    def ModelConfig(model: str = "facebook/opt-125m", **kwargs: Any) -> ours.ModelConfig:
        dtype = kwargs.pop("dtype", "auto")
        if kwargs.pop("runner", "generate") != "generate":
            raise NotInAnatomy("ModelConfig(runner=...): pooling models")
        max_model_len = kwargs.pop("max_model_len", None) or KNOWN_MODELS.get(model)
        if max_model_len is None:
            raise NotInAnatomy(f"ModelConfig(model={model!r}): unknown test model")
        # (what only loading a real model reads: no meaning here)
        for key in ("trust_remote_code", "skip_tokenizer_init", "tokenizer", "enforce_eager", "tokenizer_mode"):
            kwargs.pop(key, None)
        kept = _split(kwargs, ours.ModelConfig, {})
        return TestModelConfig(model=model, max_model_len=max_model_len,
                               dtype=torch.float16 if dtype in ("float16", "half") else torch.float32,
                               hf_config={"vocab_size": 50272}, **kept)

    def SchedulerConfig(**kwargs: Any) -> ours.SchedulerConfig:
        kwargs.pop("is_encoder_decoder", None)
        kwargs.setdefault("max_model_len", 8192)
        return ours.SchedulerConfig(**_split(kwargs, ours.SchedulerConfig, {
            "disable_chunked_mm_input": False, "watermark": 0.0, "async_scheduling": None}))

    def CacheConfig(**kwargs: Any) -> ours.CacheConfig:
        return ours.CacheConfig(**_split(kwargs, ours.CacheConfig, {"cache_dtype": "auto", "swap_space": 0}))

    def ParallelConfig(**kwargs: Any) -> ours.ParallelConfig:
        return ours.ParallelConfig(**_split(kwargs, ours.ParallelConfig, {
            "pipeline_parallel_size": 1, "data_parallel_size": 1}))

    def VllmConfig(**kwargs: Any) -> ours.VllmConfig:
        # (vLLM's VllmConfig has a default for every part)
        kwargs.setdefault("model_config", ModelConfig())
        kwargs.setdefault("cache_config", ours.CacheConfig())
        kwargs.setdefault("scheduler_config", SchedulerConfig(max_model_len=kwargs["model_config"].max_model_len))
        return ours.VllmConfig(**_split(kwargs, ours.VllmConfig, {
            "kv_transfer_config": None, "speculative_config": None, "ec_transfer_config": None,
            "lora_config": None}))

    # (their class attributes: SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS ...)
    for adapter, cls in ((SchedulerConfig, ours.SchedulerConfig), (CacheConfig, ours.CacheConfig)):
        for name in dir(cls):
            if name.isupper():
                setattr(adapter, name, getattr(cls, name))

    config = {"ModelConfig": ModelConfig, "SchedulerConfig": SchedulerConfig, "CacheConfig": CacheConfig,
              "ParallelConfig": ParallelConfig, "VllmConfig": VllmConfig}
    if hasattr(ours, "KVEventsConfig"):
        config["KVEventsConfig"] = ours.KVEventsConfig

    from vllm_anatomy.core import kv_cache_utils
    # (vLLM's defaults)
    envs = {"VLLM_USE_V2_MODEL_RUNNER": False, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": True}
    return {
        "vllm.config": config,
        "vllm.utils.hashing": {"sha256": kv_cache_utils.sha256},
        "vllm.envs": envs,
        # (ours: one spec type, a static map; vLLM's registry is for plugins)
        "vllm.v1.core.single_type_kv_cache_manager": {"register_all_kvcache_specs": lambda *a, **k: None},
        "tests.v1.kv_connector.unit.utils": {"MockKVConfig": MockKVConfig},
    }


class ImportMap(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `vllm` and `vllm.*` (and the KV-connector test helpers) with ModuleProxies."""

    def __init__(self) -> None:
        self.adapters = _adapters()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "vllm" or fullname.startswith("vllm.") or fullname in self.adapters:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        ours_name = MODULE_MAP.get(spec.name)
        ours = None
        if ours_name is not None:
            try:
                ours = importlib.import_module(ours_name)
            except ImportError:
                ours = None       # not (yet) a module of ours: every name Missing
        return ModuleProxy(spec.name, ours, self.adapters.get(spec.name, {}))

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    if not any(isinstance(f, ImportMap) for f in sys.meta_path):
        sys.meta_path.insert(0, ImportMap())


class Tally:
    """A pytest plugin counting outcomes per file."""

    def __init__(self) -> None:
        self.per_file: dict[str, Counter] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        path = report.nodeid.split("::")[0]
        counts = self.per_file.setdefault(path, Counter())
        if report.when == "call":
            counts[report.outcome] += 1
        elif report.outcome == "failed":
            counts["error"] += 1         # a fixture or setup failed
        elif report.outcome == "skipped" and report.when == "setup":
            counts["skipped"] += 1

    def pytest_collectreport(self, report: Any) -> None:
        if report.outcome == "failed":
            self.per_file.setdefault(report.nodeid, Counter())["collection_error"] += 1


def main() -> int:
    import pytest

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=Path, default=DEFAULT_TESTS)
    parser.add_argument("--json", type=Path)
    args, rest = parser.parse_known_args()
    install()
    # NOTE: vLLM's `tests` package first on the path and imported now: a folder
    # of test files without __init__.py (prefix_cache/) would otherwise let
    # `import tests` find this repository's tests/ (a namespace package) first.
    sys.path.insert(0, str(args.tests.parent))
    importlib.import_module("tests")
    core = args.tests / "v1" / "core"
    targets = [a for a in rest if Path(a.split("::")[0]).exists()] or [str(core)]
    options = [a for a in rest if a not in targets]
    tally = Tally()
    pytest.main(["-q", "--noconftest", "-p", "no:cacheprovider", "--rootdir", str(args.tests.parent),
                 "-o", "addopts=", "--continue-on-collection-errors", "-p", "no:warnings", *options, *targets], plugins=[tally])
    total: Counter = Counter()
    print(f"\n{'file':60s} passed failed error skipped")
    for path, counts in sorted(tally.per_file.items()):
        total.update(counts)
        errors = counts["error"] + counts["collection_error"]
        print(f"{path[-60:]:60s} {counts['passed']:6d} {counts['failed']:6d} {errors:5d} {counts['skipped']:7d}")
    print(f"{'total':60s} {total['passed']:6d} {total['failed']:6d} "
          f"{total['error'] + total['collection_error']:5d} {total['skipped']:7d}")
    if args.json:
        args.json.write_text(json.dumps({p: dict(c) for p, c in tally.per_file.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
