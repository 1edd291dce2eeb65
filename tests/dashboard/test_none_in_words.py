"""A value a run cannot have is said in words, with its reason, never a bare "—" that reads as a number
lost on the way: Self-test Q1's event hashes (only cache and evict events carry them), Q4's freed block
hashes (prefix caching off, or a block not full), the tensor-parallel table's share of a forward that has
no span, a device-lane kernel outside every decoder layer, a pool cell's block without a hash. Read
from the shipped samples (no model, no Streamlit run)."""
from __future__ import annotations

import os

import pytest

from tests.dashboard.conftest import ROOT

COMPARE = os.path.join(ROOT, "samples", "compare")
CACHING = {"off": os.path.join(COMPARE, "cpu-prefix-caching-a.sqlite"),
           "on": os.path.join(COMPARE, "cpu-prefix-caching-b.sqlite")}


def _cells(tables: dict) -> list[str]:
    return [str(v) for rows in tables.values() for r in rows for v in r.values()]


@pytest.mark.parametrize("caching", ["on", "off"])
def test_q1_and_q4_tables_say_why_a_hash_is_missing(caching):
    from dashboard.answers import q1_allocation, q4_finish
    from dashboard.answers.source import RunSource
    path = CACHING[caching]
    if not os.path.exists(path):
        pytest.skip(f"{path} is not shipped here")
    src = RunSource(path)
    assert src.enable_caching is (caching == "on")
    q1, q4 = q1_allocation.answer(src), q4_finish.answer(src)
    assert q1.ok and q4.ok
    assert "—" not in _cells(q1.tables) + _cells(q4.tables), (q1.tables, q4.tables)
    for r in q1.tables["block-pool events of this step, in order"]:
        if r["event"] not in ("cache", "evict"):
            assert r["hashes"] == f"not in {'an' if r['event'] == 'allocate' else 'a'} {r['event']} event", r
    assert q1_allocation.HASHES_NOTE in q1.notes
    rows = q4.tables["KVCacheManager.free, block by block"]
    unhashed = [r for r in rows if r["hash"].startswith("none")]
    assert unhashed, rows          # (both samples' picked finish frees a block without a hash)
    want = "none (not full: only full blocks are hashed)" if caching == "on" else "none (prefix caching off)"
    assert all(r["hash"] == want and r["hash kept"] == "no hash to keep" for r in unhashed), unhashed
    held = [r for r in rows if r["free queue"].startswith("not freed")]
    assert all(r["hash kept"] == "yes (still held)" for r in held if not r["hash"].startswith("none")), held


def test_components_say_why_a_value_is_missing():
    from dashboard.components.block_pool import _cell
    from dashboard.components.device_lane import _one_hover
    from dashboard.components.tensor_parallel import forward_share
    assert forward_share(3.0, 12.0) == "25%" and forward_share(3.0, 0.0) == "no _model_forward span on this rank"
    hover = _one_hover({"name": "GPU.kernel.reshape_and_cache", "dur_ms": 0.1, "step_id": None, "lane": "device",
                        "grid": "(4,)", "num_tokens": 4})
    assert "outside every step" in hover and "outside every decoder layer" in hover and "—" not in hover, hover
    held = {"block_id": 5, "ref_cnt": 1, "owners": ["3"], "hash": None, "is_null": False}
    assert "no hash (only a full block is hashed, with prefix caching on)" in _cell(held, {}, [], False)
    null = {"block_id": 0, "ref_cnt": 0, "owners": [], "hash": None, "is_null": True}
    assert "no hash (the null block holds no tokens)" in _cell(null, {}, [], False)
    assert "hash —" not in _cell(held, {}, [], False) + _cell(null, {}, [], False)
