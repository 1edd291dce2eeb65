"""Every "read the code" pointer on the dashboard names a file that exists, and the
first symbol it names is defined there — so moving code cannot leave the pages
pointing at nothing (CPU, no Streamlit)."""
from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _code_refs() -> list[tuple[str, str, str]]:
    """(dashboard file, path, what) for every literal code_ref(path, what) call."""
    refs = []
    for folder, _, files in os.walk(os.path.join(ROOT, "dashboard")):
        for name in files:
            if not name.endswith(".py"):
                continue
            src = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(src).read())):
                if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "code_ref"
                        and len(node.args) >= 2):
                    continue
                # (a literal is a str: mypy checks the dashboard's code_ref(path: str, what: str) calls)
                path, what = node.args[0], node.args[1]
                if (isinstance(path, ast.Constant) and isinstance(path.value, str)
                        and isinstance(what, ast.Constant) and isinstance(what.value, str)):
                    refs.append((os.path.relpath(src, ROOT), path.value, what.value))
    return refs


REFS = _code_refs()


def test_the_pages_have_code_refs():
    assert len(REFS) >= 10


@pytest.mark.parametrize("src,path,what", REFS, ids=[f"{s}:{p}" for s, p, _ in REFS])
def test_code_ref_points_at_code_that_exists(src, path, what):
    assert os.path.isfile(os.path.join(ROOT, path)), f"{src} points at {path}, which does not exist"
    # The first dotted name (Class.method, function or constant) must be defined in that file.
    m = re.match(r"\s*([A-Za-z_][\w]*)(?:\.([A-Za-z_]\w*))?", what)
    if not m or not path.endswith(".py"):
        return
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.id for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    names = [n for n in m.groups() if n]
    assert any(n in defined for n in names), f"{src}: {what!r} names nothing defined in {path}"
