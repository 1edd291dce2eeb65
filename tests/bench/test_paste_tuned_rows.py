"""bench/peers/paste_tuned_rows.py: the device stage that writes bench/skinny_gemm.py's measured
rows into TUNED_CONFIGS. The committed rows are exactly those of the committed H100 JSON (pasting
them changes nothing), an empty table takes rows, and rows can be taken away again."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))

import paste_tuned_rows  # noqa: E402

SOURCE = os.path.join(ROOT, "vllm_anatomy", "kernels", "skinny_gemm.py")
RESULT = os.path.join(ROOT, "bench", "results", "skinny_gemm_h100.json")


def test_committed_rows_are_the_h100_runs():
    rows = json.load(open(RESULT))["tuned_rows"]
    source = open(SOURCE).read()
    assert len(rows) == 25 and paste_tuned_rows.paste(rows, source) == source


def test_empty_table_takes_rows_and_gives_them_back():
    rows = json.load(open(RESULT))["tuned_rows"]
    source = open(SOURCE).read()
    empty = paste_tuned_rows.paste([], source)
    assert "SkinnyGemmConfig | None] = {}\n" in empty and "(4096, 1024, 16): None," not in empty
    assert empty.count("\n") == source.count("\n") - len(rows) - 1
    assert paste_tuned_rows.paste(rows, empty) == source
    namespace: dict = {}
    table = empty[empty.index("TUNED_CONFIGS:"):].split("\n", 1)[0]
    exec(table.replace("dict[tuple[int, int, int], SkinnyGemmConfig | None]", "dict"), namespace)
    assert namespace["TUNED_CONFIGS"] == {}
