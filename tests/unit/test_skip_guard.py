"""tests/conftest.py turns an importorskip of a declared dependency that is missing into a
failure, and leaves a skip for an optional one (pytester runs a throwaway test session)."""
import sys
from pathlib import Path

pytest_plugins = ["pytester"]


REPO = Path(__file__).parents[2]


def _run(pytester, body: str):
    """A copy of our conftest and pyproject.toml around one test file, run in a new pytest."""
    (pytester.path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    tests = pytester.mkdir("tests")
    (tests / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tests / "test_it.py").write_text(body)
    return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "tests")


def test_a_broken_declared_dependency_fails_the_run(pytester, monkeypatch):
    # msgspec is declared in pyproject.toml; here it is "not installed" (a missing install step)
    pytester.makepyfile(msgspec="raise ModuleNotFoundError(\"No module named 'msgspec'\", name='msgspec')")
    result = _run(pytester, "import pytest\npytest.importorskip('msgspec')\ndef test_x():\n    pass\n")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*declared dependency failed to import*"])


def test_an_optional_dependency_may_still_skip(pytester):
    result = _run(pytester, "import pytest\npytest.importorskip('no_such_module_anywhere')\n"
                            "def test_x():\n    pass\n")
    assert result.ret == 5 or "skipped" in result.stdout.str(), result.stdout.str()
    assert sys.version_info >= (3, 10)
