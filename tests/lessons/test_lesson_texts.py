"""What two lessons say, without running them (no model): lesson 7 counts the three serving
processes apart from Python's helper, lesson 9 sends the learner to the dashboard's Self-test page
(the same five questions), not to an inspector tab."""
from __future__ import annotations

import ast
import os
from types import ModuleType

from tests.helpers import module_from_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lesson(name: str) -> ModuleType:
    return module_from_file(name[:-3], os.path.join(ROOT, "lessons", name))


def test_lesson_7_counts_three_serving_processes_and_names_the_helper():
    l7 = _lesson("07_call_chain.py")
    family = {10: "/usr/bin/python -c from vllm_anatomy.entrypoints.cli.main import main; main() serve --port 1",
              11: "/usr/bin/python -c from multiprocessing.resource_tracker import main;main(7)",
              12: "/usr/bin/python -m vllm_anatomy.engine.core_proc",
              13: "/usr/bin/python -m vllm_anatomy.executor.worker_proc"}
    serving, helpers = l7.serving_and_helpers(family)
    assert serving == [10, 12, 13] and helpers == [11]


def test_lesson_9_links_to_the_self_test_page():
    src = open(os.path.join(ROOT, "lessons", "09_self_test.py")).read()
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "dashboard_link"]
    assert calls and all(isinstance(c.args[1], ast.Constant) and c.args[1].value == "selftest" for c in calls)
