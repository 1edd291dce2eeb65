"""`vllm-anatomy lesson N` runs lessons/NN_*.py; `vllm-anatomy lesson --list` lists them.

A lesson ends with a link to the dashboard that shows what it taught: on
$STREAMLIT_SERVER_PORT (the port `make run` and `vllm-anatomy dashboard` use), else 8501;
--port sets it for one lesson. --trace-dir sets where the lesson records its run.

The lessons are scripts in the repository's lessons/ folder, not part of the
installed package: they are found next to the package of an editable install
(the repository root), else in a lessons/ folder in the current directory or
one of its parents, or wherever VLLM_ANATOMY_LESSONS_DIR points.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

LESSON_FILE = re.compile(r"^(\d\d)_(\w+)\.py$")


def add_parser(sub) -> None:
    p = sub.add_parser("lesson", help="run a lesson (a recorded, narrated, self-checking scenario)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("number", nargs="?", help="the lesson number (1, 01, ...)")
    p.add_argument("--list", action="store_true", help="list the lessons and exit")
    p.add_argument("--trace-dir", default=None,
                   help="where the lesson records its run (default: $VLLM_ANATOMY_LESSON_TRACE_DIR, else the "
                        "lessons folder of the dashboard's trace directory: ./vllm_anatomy_traces/lessons)")
    p.add_argument("--port", type=int, default=None,
                   help="the port of the dashboard the lesson links to (default: $STREAMLIT_SERVER_PORT, else 8501)")


def _is_lessons_dir(path: Path) -> bool:
    return path.is_dir() and (path / "_common.py").is_file()


def find_lessons_dir() -> Path:
    """The lessons/ folder, or FileNotFoundError saying where it was looked for."""
    tried = []
    env = os.environ.get("VLLM_ANATOMY_LESSONS_DIR")
    if env:
        path = Path(env).expanduser().resolve()
        if _is_lessons_dir(path):
            return path
        raise FileNotFoundError(f"VLLM_ANATOMY_LESSONS_DIR={env} is not a lessons folder (no _common.py in it)")
    import vllm_anatomy
    candidates = [Path(vllm_anatomy.__file__).resolve().parent.parent / "lessons"]
    cwd = Path.cwd().resolve()
    candidates += [d / "lessons" for d in (cwd, *cwd.parents)]
    for path in candidates:
        tried.append(str(path))
        if _is_lessons_dir(path):
            return path
    raise FileNotFoundError(
        "cannot find the lessons/ folder (looked in " + ", ".join(dict.fromkeys(tried)) + "). The lessons live "
        "in the vllm_anatomy repository, not in the installed package: run this from a checkout, install it "
        "editable (pip install -e .), or set VLLM_ANATOMY_LESSONS_DIR.")


def list_lessons(lessons_dir: Path) -> list[tuple[int, Path, str]]:
    """(number, path, first docstring line) of every NN_*.py, in order."""
    lessons = []
    for path in sorted(lessons_dir.iterdir()):
        m = LESSON_FILE.match(path.name)
        if not m:
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        except SyntaxError as e:
            doc = f"(cannot be parsed: {e.msg}, line {e.lineno})"
        summary = doc.strip().splitlines()[0] if doc.strip() else m.group(2).replace("_", " ")
        lessons.append((int(m.group(1)), path, summary))
    return lessons


def run(args: argparse.Namespace) -> int:
    lessons_dir = find_lessons_dir()
    lessons = list_lessons(lessons_dir)
    if args.list:
        if not lessons:
            print(f"no lessons in {lessons_dir}")
        for number, path, summary in lessons:
            print(f"  {number:2d}  {path.name:32} {summary}")
        return 0
    if args.number is None:
        raise ValueError("give a lesson number (vllm-anatomy lesson 1) or --list")
    try:
        number = int(args.number)
    except ValueError:
        raise ValueError(f"lesson number must be an integer, got {args.number!r}") from None
    matches = [path for n, path, _ in lessons if n == number]
    if not matches:
        have = ", ".join(str(n) for n, _, _ in lessons) or "none"
        raise FileNotFoundError(f"no lesson {number} in {lessons_dir} (lessons there: {have})")
    if len(matches) > 1:
        raise ValueError(f"lesson {number} is ambiguous: {', '.join(p.name for p in matches)}")
    env = dict(os.environ)
    if args.trace_dir:
        env["VLLM_ANATOMY_LESSON_TRACE_DIR"] = args.trace_dir
    if getattr(args, "port", None):
        env["STREAMLIT_SERVER_PORT"] = str(args.port)     # Streamlit's variable: lessons/_common.py reads it
    # NOTE: a child process, as `python lessons/NN_*.py` would run it: a lesson may
    # start worker processes (spawn re-imports its __main__), and its exit status
    # is the lesson's verdict.
    return subprocess.run([sys.executable, str(matches[0])], env=env).returncode
