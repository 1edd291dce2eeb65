"""Write the symbol manifest of a vLLM release, so tests can check vLLM paths without its wheel.

    python scripts/vllm_manifest.py /path/to/vllm-0.27.1-...whl         # or
    python scripts/vllm_manifest.py /path/to/unpacked/src/vllm          # the `vllm` package folder
    python scripts/vllm_manifest.py SOURCE -o docs/vllm-v0.27.1-symbols.json.gz

The output is a gzipped JSON object (keys sorted, gzip mtime 0, so the same
source gives the same bytes):

    {"version": "0.27.1",
     "files": {"vllm/v1/core/block_pool.py": ["BlockPool", "BlockPool.free_blocks", ...], ...}}

Each file's list holds, as `ast` sees them without importing anything:
top-level classes, functions and assigned names (`NONE_HASH`, `logger`, ...),
and for each top-level class its methods and its class-level attributes
(dataclass fields such as `CompilationConfig.cudagraph_mode`) as `Class.name`;
classes nested in a class appear as `Class.Inner`. Every `vllm/**/*.py` file is
listed, even one with no symbols, so that a file's existence can be checked too.
Names bound under a top-level `if`/`try`/`with` are included, except in an
`if TYPE_CHECKING:` block (whose `else: X = object` stand-ins define nothing);
imported names are not: a symbol is listed where it is defined (a re-export
such as `UniProcExecutor = _UniProcExecutor` is an assignment, so it counts).
"""
from __future__ import annotations

import argparse
import ast
import gzip
import io
import json
import os
import re
import sys
import zipfile
from typing import Iterable, Iterator

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "docs", "vllm-v0.27.1-symbols.json.gz")


def _targets(node: ast.AST) -> Iterator[str]:
    """Names bound by an assignment target (plain names and tuples of them)."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _flatten(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a body, descending into top-level if/try/with blocks (not into defs)."""
    for stmt in body:
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            continue  # imports for annotations, and `else: X = object` stand-ins: not definitions
        if isinstance(stmt, ast.If):
            yield from _flatten(stmt.body)
            yield from _flatten(stmt.orelse)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            yield from _flatten(stmt.body)
            for h in stmt.handlers:
                yield from _flatten(h.body)
            yield from _flatten(stmt.orelse)
            yield from _flatten(stmt.finalbody)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _flatten(stmt.body)
        else:
            yield stmt


def _bound_names(stmt: ast.stmt) -> Iterator[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield stmt.name
    elif isinstance(stmt, ast.Assign):
        for t in stmt.targets:
            yield from _targets(t)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        yield from _targets(stmt.target)
    elif type(stmt).__name__ == "TypeAlias":  # `type X = ...` (3.12+)
        yield from _targets(stmt.name)


def symbols_of(source: str, filename: str = "<vllm>") -> list[str]:
    """Top-level names and Class.member names defined in one module's source."""
    tree = ast.parse(source, filename=filename)
    out: set[str] = set()
    for stmt in _flatten(tree.body):
        for name in _bound_names(stmt):
            out.add(name)
        if isinstance(stmt, ast.ClassDef):
            for member in _flatten(stmt.body):
                for name in _bound_names(member):
                    out.add(f"{stmt.name}.{name}")
    return sorted(out)


def iter_sources(source: str) -> Iterator[tuple[str, str]]:
    """(path relative to the wheel root, e.g. 'vllm/v1/request.py', text) for every vllm/**/*.py."""
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as zf:
            for name in sorted(zf.namelist()):
                if name.startswith("vllm/") and name.endswith(".py"):
                    yield name, zf.read(name).decode("utf-8", errors="replace")
        return
    root = os.path.abspath(source)
    if os.path.basename(root) != "vllm":
        if os.path.isdir(os.path.join(root, "vllm")):
            root = os.path.join(root, "vllm")
        else:
            raise SystemExit(f"{source}: neither a wheel nor a folder named vllm (or holding one)")
    base = os.path.dirname(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                with open(path, encoding="utf-8", errors="replace") as f:
                    yield os.path.relpath(path, base).replace(os.sep, "/"), f.read()


def build(source: str) -> dict:
    files: dict[str, list[str]] = {}
    version = None
    for rel, text in iter_sources(source):
        try:
            files[rel] = symbols_of(text, rel)
        except SyntaxError as e:  # keep the file listed; say why it has no symbols
            print(f"warning: {rel}: {e}", file=sys.stderr)
            files[rel] = []
        if rel == "vllm/_version.py":
            m = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", text)
            version = m.group(1) if m else None
    if not files:
        raise SystemExit(f"{source}: no vllm/**/*.py found")
    return {"version": version, "files": files}


def dump(manifest: dict, out: str) -> int:
    raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    if out.endswith(".gz"):
        buf = io.BytesIO()
        # mtime=0 and no file name in the header: reproducible bytes.
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
            gz.write(raw)
        raw = buf.getvalue()
    with open(out, "wb") as f:
        f.write(raw)
    return len(raw)


def load(path: str = DEFAULT_OUT) -> dict:
    """The manifest as written by dump() (gzipped or not)."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a vLLM wheel, or the unpacked `vllm` package folder (or its parent)")
    ap.add_argument("-o", "--out", default=DEFAULT_OUT, help="default: %(default)s")
    args = ap.parse_args(argv)
    manifest = build(args.source)
    if args.out == DEFAULT_OUT and manifest["version"] != "0.27.1":
        version = manifest["version"]
        raise SystemExit(f"{args.source} is vLLM {version}: pass -o to write its manifest elsewhere")
    size = dump(manifest, args.out)
    n_sym = sum(len(v) for v in manifest["files"].values())
    print(f"vllm {manifest['version']}: {len(manifest['files'])} files, {n_sym} symbols -> "
          f"{args.out} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
