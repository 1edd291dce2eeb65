"""docs/vllm-mapping.md and the module docstrings name things that exist.

Ours side: every backticked name in a table's first column imports and
resolves in this project (the convention is at the top of the doc).
vLLM side: every backticked `vllm/...` path in the doc, and every `vllm/...`
path in a docstring under vllm_anatomy/ and dashboard/, is a file
(or folder) of vLLM v0.27.1, and every symbol named next to it is defined
there. vLLM is not installed: the check reads docs/vllm-v0.27.1-symbols.json.gz,
written by scripts/vllm_manifest.py from the release's wheel.

Each test collects every problem before failing, one line per problem,
naming the doc row (line number and first column) or the docstring's file.
"""
from __future__ import annotations

import argparse
import ast
import gzip
import importlib
import importlib.util
import inspect
import json
import os
import re
from functools import lru_cache

import pytest

from tests.helpers import module_from_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(REPO, "docs", "vllm-mapping.md")
MANIFEST = os.path.join(REPO, "docs", "vllm-v0.27.1-symbols.json.gz")
DOCSTRING_ROOTS = ("vllm_anatomy", "dashboard")

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"{IDENT}(?:\.{IDENT})*")
BACKTICKED = re.compile(r"`([^`]+)`")


# ---------------------------------------------------------------- the manifest

@lru_cache(maxsize=None)
def manifest() -> dict:
    with open(MANIFEST, "rb") as f:
        return json.loads(gzip.decompress(f.read()))


def vllm_files() -> dict[str, list[str]]:
    return manifest()["files"]


def path_problem(path: str) -> str | None:
    """None if `path` (a file, a folder ending in '/', or a glob such as vllm/config/*.py) is in v0.27.1."""
    files = vllm_files()
    if "*" in path:
        pat = re.compile("^" + re.escape(path).replace(r"\*", "[^/]*") + "$")
        return None if any(pat.match(f) for f in files) else f"{path} matches no file of vLLM 0.27.1"
    if path.endswith("/"):
        return None if any(f.startswith(path) for f in files) else f"{path} is not a folder of vLLM 0.27.1"
    if path in files:
        return None
    if any(f.startswith(path + "/") for f in files):
        return None  # a folder written without its trailing slash
    return f"{path} is not a file of vLLM 0.27.1"


def symbol_problem(path: str, symbol: str) -> str | None:
    """None if `symbol` (Name or Class.member) is defined in `path` (a file, or any file under a folder)."""
    files = vllm_files()
    if path.endswith("/") or path not in files:
        where = [f for f in files if f.startswith(path.rstrip("/") + "/")]
    else:
        where = [path]
    for f in where:
        if symbol in files[f]:
            return None
        # In a folder, `utils.set_default_torch_dtype` names utils.py's function.
        if "." in symbol and f == path.rstrip("/") + "/" + symbol.split(".")[0] + ".py" \
                and symbol.split(".", 1)[1] in files[f]:
            return None
    return f"`{symbol}` is not defined in {path} in vLLM 0.27.1"


# ---------------------------------------------------------------- the doc's tables

def table_rows() -> list[tuple[int, list[str], list[str]]]:
    """(line number, header cells, row cells) for every body row of every table in the doc."""
    with open(DOC, encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows, header = [], None
    for i, line in enumerate(lines, 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue
        else:
            rows.append((i, header, cells))
    return rows


def row_name(lineno: int, cells: list[str]) -> str:
    first = cells[0] if len(cells[0]) <= 90 else cells[0][:87] + "..."
    return f"docs/vllm-mapping.md:{lineno} | {first} |"


@lru_cache(maxsize=None)
def server_flags() -> frozenset[str]:
    from vllm_anatomy.entrypoints.openai.cli_args import make_arg_parser
    parser = make_arg_parser(argparse.ArgumentParser())
    return frozenset(parser._option_string_actions)


def _member_problem(obj, attr: str, shown: str) -> tuple[object, str | None]:
    """getattr, or (for a class) a field it declares or an attribute its methods assign to self."""
    if hasattr(obj, attr):
        return getattr(obj, attr), None
    if inspect.isclass(obj):
        for klass in obj.__mro__:
            if attr in getattr(klass, "__annotations__", {}) or attr in getattr(klass, "__struct_fields__", ()):
                return None, None
            try:
                src = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            if re.search(rf"\bself\.{attr}\s*(:[^=\n]+)?=(?!=)", src):
                return None, None
    return None, f"`{shown}`: {getattr(obj, '__name__', obj)!s} has no attribute {attr}"


def _import(name: str):
    """(module, problem) for a module name that find_spec found."""
    try:
        return importlib.import_module(name), None
    except Exception as e:  # a module that exists but fails to import is a problem of its own
        return None, f"cannot import {name}: {type(e).__name__}: {e}"


def _module_prefix(parts: list[str]):
    """The longest importable module among parts[:1], parts[:2], ...: (module, how many parts, problem)."""
    mod, used = None, 0
    for j in range(1, len(parts) + 1):
        if mod is not None and not hasattr(mod, "__path__"):
            break
        name = ".".join(parts[:j])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            break
        mod, problem = _import(name)
        if problem:
            return None, j, problem
        used = j
    return mod, used, None


def ours_problems(cells: list[str]) -> list[str]:
    """Problems with the first column: each backticked name must resolve (see the doc's convention)."""
    problems, anchor = [], None
    tokens = BACKTICKED.findall(cells[0])
    if not tokens:
        return ["names nothing in backticks"]
    for tok in tokens:
        if tok.startswith("--"):
            if tok not in server_flags():
                problems.append(f"`{tok}` is not a flag of vllm-anatomy serve (cli_args.make_arg_parser)")
            continue
        if not DOTTED.fullmatch(tok):
            problems.append(f"`{tok}` is not a dotted Python name (or a --flag)")
            continue
        parts = tok.split(".")
        if parts[0] == "vllm_anatomy":
            mod, used, problem = _module_prefix(parts)
            if problem or mod is None:
                problems.append(problem or f"`{tok}`: no module {parts[0]}")
                continue
            anchor, obj, rest = mod, mod, parts[used:]
        elif anchor is None:
            problems.append(f"`{tok}` comes before any fully qualified vllm_anatomy.… name in the row")
            continue
        elif hasattr(anchor, parts[0]):
            obj, rest = anchor, parts
        else:  # a module beside the anchor: `uniproc_executor.UniProcExecutor`
            package = anchor.__name__.rpartition(".")[0]
            sibling = f"{package}.{parts[0]}"
            try:
                spec = importlib.util.find_spec(sibling)
            except (ImportError, ValueError):
                spec = None
            if spec is None:
                problems.append(f"`{tok}`: {parts[0]} is neither in {anchor.__name__} nor a module of {package}")
                continue
            obj, problem = _import(sibling)
            if problem:
                problems.append(problem)
                continue
            anchor, rest = obj, parts[1:]  # later names in the row are read in that module
        for k, attr in enumerate(rest):
            obj, problem = _member_problem(obj, attr, tok)
            if problem:
                problems.append(problem)
                break
            if obj is None and k < len(rest) - 1:
                problems.append(f"`{tok}`: {attr} is an instance attribute; nothing can be named below it")
                break
    return problems


def vllm_problems(cell: str) -> list[str]:
    """Problems with a vLLM cell: its paths exist in v0.27.1, each symbol in the path named before it."""
    tokens = BACKTICKED.findall(cell)
    if cell.startswith("(none"):
        if not cell.startswith("(none in v0.27.1"):
            return ["a row without a counterpart must say `(none in v0.27.1: ...)`"]
    elif not tokens or not tokens[0].startswith("vllm/"):
        return ["must start with a backticked vllm/ path, or say (none in v0.27.1: ...)"]
    problems, current = [], None
    for tok in tokens:
        if tok.startswith("vllm/"):
            current = tok
            problem = path_problem(tok)
        elif re.fullmatch(rf"(?:{IDENT}/)*{IDENT}\.py", tok):
            if current is None:
                problems.append(f"`{tok}` comes before any vllm/ path in the cell")
                continue
            current = current[:current.rstrip("/").rfind("/") + 1] if not current.endswith("/") else current
            current += tok
            problem = path_problem(current)
        elif DOTTED.fullmatch(tok):
            if current is None:
                problems.append(f"`{tok}` comes before any vllm/ path in the cell")
                continue
            problem = symbol_problem(current, tok)
        else:
            problem = f"`{tok}` is neither a vllm/ path, a file beside the last one, nor a Python name"
        if problem:
            problems.append(problem)
    return problems


def test_doc_has_tables():
    rows = table_rows()
    assert len(rows) > 50, f"only {len(rows)} table rows parsed from {DOC}"
    headers = {tuple(h) for _, h, _ in rows}
    assert headers <= {("Ours", "vLLM"), ("Ours", "Why")}, headers


def test_ours_side_resolves():
    bad = []
    for lineno, _header, cells in table_rows():
        bad += [f"{row_name(lineno, cells)} {p}" for p in ours_problems(cells)]
    assert not bad, "project-side names in docs/vllm-mapping.md that do not resolve:\n" + "\n".join(bad)


def test_vllm_side_exists_in_v0_27_1():
    bad = []
    for lineno, header, cells in table_rows():
        if header[1] != "vLLM":
            continue
        bad += [f"{row_name(lineno, cells)} {p}" for p in vllm_problems(cells[1])]
    assert not bad, "vLLM-side entries of docs/vllm-mapping.md not in v0.27.1:\n" + "\n".join(bad)


def test_every_vllm_path_in_the_doc_exists():
    """Prose too (the header, "Since v0.27.1"): a backticked vllm/ path names a v0.27.1 file or folder."""
    with open(DOC, encoding="utf-8") as f:
        lines = f.read().splitlines()
    bad = []
    for i, line in enumerate(lines, 1):
        for tok in BACKTICKED.findall(line):
            if tok.startswith("vllm/"):
                problem = path_problem(tok.split()[0])
                if problem:
                    bad.append(f"docs/vllm-mapping.md:{i}: {problem}")
    assert not bad, "\n".join(bad)


def test_no_link_leaves_the_repository():
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    bad = [u for u in re.findall(r"\b[a-z][a-z0-9+.-]*://\S+", text)]
    for target in re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"(?<![\w/])\.\./[\w./-]+", text):
        target = target.split("#")[0]
        if not target:
            continue
        full = os.path.normpath(os.path.join(os.path.dirname(DOC), target))
        if os.path.commonpath([full, REPO]) != REPO or not os.path.exists(full):
            bad.append(target)
    assert not bad, f"links in docs/vllm-mapping.md that leave the repository or go nowhere: {bad}"


# ---------------------------------------------------------------- docstrings

PATH_IN_TEXT = re.compile(r"vllm/(?:[\w.*]+/)*(?:[\w.*]+)?")


def code_names(text: str) -> list[str]:
    """Names in prose that look like code: Foo.bar, snake_case, or CamelCase with two capitals."""
    out = []
    for m in re.finditer(rf"(?<![\w./]){IDENT}(?:\.{IDENT})*(?![\w/]|\.\w)", text):
        name = m.group(0)
        if name.endswith(".py") or text[:m.start()].rstrip().endswith("/"):
            continue  # a file name, or a shorthand alternative: "get_x_rank / _world_size"
        if "." in name or "_" in name.strip("_") or (
                sum(c.isupper() for c in name) >= 2 and any(c.islower() for c in name)):
            out.append(name)
    return out


def docstrings():
    """(repo-relative file, line, text) of every module, class and function docstring."""
    for root in DOCSTRING_ROOTS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, root)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
            for fn in sorted(filenames):
                if not fn.endswith(".py"):
                    continue
                path = os.path.join(dirpath, fn)
                with open(path, encoding="utf-8") as f:
                    src = f.read()
                rel = os.path.relpath(path, REPO)
                try:
                    tree = ast.parse(src)
                except SyntaxError as e:
                    yield rel, e.lineno or 0, None
                    continue
                for node in [tree] + [n for n in ast.walk(tree)
                                      if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]:
                    body = getattr(node, "body", [])
                    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                            and isinstance(body[0].value.value, str):
                        yield rel, body[0].lineno, body[0].value.value


def docstring_problems(text: str) -> list[str]:
    """Each vllm/ path exists; `path::name` names a symbol of it; code-like names in the parenthesis
    right after a path (`Mirrors vllm/x.py (Foo, Foo.bar)`) are defined in that file (or folder)."""
    # A path broken over two lines: "vllm/model_executor/model_loader/\n    gguf_loader.py".
    text = re.sub(r"(vllm/(?:[\w.]+/)+)\n[ \t]*([\w/]+\.py)", r"\1\2", text)
    problems = []
    for m in PATH_IN_TEXT.finditer(text):
        path = m.group(0).rstrip(".")
        problem = path_problem(path)
        if problem:
            problems.append(problem)
            continue
        after = text[m.end():]
        if after.startswith("::"):
            sym = re.match(rf"::({IDENT}(?:\.{IDENT})*)", after)
            if sym and (problem := symbol_problem(path, sym.group(1))):
                problems.append(problem)
        elif "*" not in path and (paren := re.match(r"[ \t]*\n?[ \t]*\(([^)]*)\)", after)):
            for name in code_names(paren.group(1)):
                problem = symbol_problem(path, name)
                if problem and not _member_of_any_class(path, name):
                    problems.append(problem)
    return problems


def _member_of_any_class(path: str, name: str) -> bool:
    """A bare method name in prose (`forward_cuda`) is fine if some class of the file defines it."""
    files = vllm_files()
    where = [f for f in files if f == path or f.startswith(path.rstrip("/") + "/")]
    return "." not in name and any(s.endswith("." + name) for f in where for s in files[f])


def test_docstring_vllm_paths_exist_in_v0_27_1():
    bad = []
    for rel, line, text in docstrings():
        if text is None:
            continue  # a file that does not parse is another test's business
        bad += [f"{rel}:{line}: {p}" for p in docstring_problems(text)]
    assert not bad, "vLLM paths in docstrings that are not in v0.27.1:\n" + "\n".join(bad)


# ---------------------------------------------------------------- the manifest itself

def test_manifest_is_v0_27_1_and_small():
    assert manifest()["version"] == "0.27.1"
    assert os.path.getsize(MANIFEST) < 512 * 1024
    files = vllm_files()
    assert "Scheduler.schedule" in files["vllm/v1/core/sched/scheduler.py"]
    assert "BlockPool.free_blocks" in files["vllm/v1/core/block_pool.py"]


def test_manifest_script_reads_symbols():
    vm = module_from_file("vllm_manifest", os.path.join(REPO, "scripts", "vllm_manifest.py"))
    src = ("import os\nX: int = 1\nA, B = 1, 2\nif os.name:\n    def f(): pass\n"
           "class C:\n    y: int\n    def m(self):\n        z = 1\n    class D: pass\n"
           "if TYPE_CHECKING:\n    from x import T\nelse:\n    T = object\n")
    assert vm.symbols_of(src) == ["A", "B", "C", "C.D", "C.m", "C.y", "X", "f"]


@pytest.mark.parametrize("cell, expected", [
    ("`vllm/v1/request.py` (`Request`, `RequestStatus`)", []),
    ("`vllm/v1/executor/abstract.py`, `uniproc_executor.py` (`UniProcExecutor`)", []),
    ("`vllm/attention/layer.py`", ["vllm/attention/layer.py is not a file of vLLM 0.27.1"]),
    ("`vllm/v1/worker/block_table.py` (`ComputeSlotMappingKernel`)",
     ["`ComputeSlotMappingKernel` is not defined in vllm/v1/worker/block_table.py in vLLM 0.27.1"]),
    ("(none in v0.27.1: a readable oracle)", []),
    ("(none: a readable oracle)", ["a row without a counterpart must say `(none in v0.27.1: ...)`"]),
])
def test_vllm_cell_checker(cell, expected):
    assert vllm_problems(cell) == expected


@pytest.mark.parametrize("cell, expected", [
    ("`vllm_anatomy.core.request.Request`, `RequestStatus`, `Request.num_computed_tokens`", []),
    ("`vllm_anatomy.executor.abstract.Executor`, `uniproc_executor.UniProcExecutor`", []),
    ("`vllm_anatomy.core.request.Requestt`",
     ["`vllm_anatomy.core.request.Requestt`: vllm_anatomy.core.request has no attribute Requestt"]),
    ("`Request.status`",
     ["`Request.status` comes before any fully qualified vllm_anatomy.… name in the row"]),
    ("`vllm_anatomy.core.request.Request` (`vllm-anatomy`)", ["`vllm-anatomy` is not a dotted Python name (or a --flag)"]),
])
def test_ours_cell_checker(cell, expected):
    assert ours_problems([cell]) == expected
