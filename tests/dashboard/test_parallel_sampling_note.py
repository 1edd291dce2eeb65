"""The KV tab's parallel-sampling note: sibling requests "{i}_{parent}" found in a step's
block tables, with the blocks they share and the ones each holds alone; a child request's row
names its parent (no Streamlit run)."""
from __future__ import annotations

from dashboard.components.parallel_sampling import describe, sibling_groups


def kv(tables: dict[str, list[int]]) -> dict:
    ref: dict[int, int] = {}
    for ids in tables.values():
        for b in ids:
            ref[b] = ref.get(b, 0) + 1
    return {"req_to_block_ids": tables, "blocks": [{"block_id": b, "ref_cnt": n} for b, n in ref.items()]}


def test_sibling_groups_need_two_children_of_one_parent():
    ids = ["2_cmpl-a-0-x", "0_cmpl-a-0-x", "1_cmpl-a-0-x", "7_alone", "P2", "0_b", "1_c"]
    assert sibling_groups(ids) == {"cmpl-a-0-x": ["0_cmpl-a-0-x", "1_cmpl-a-0-x", "2_cmpl-a-0-x"]}
    assert sibling_groups(["P1", "P2"]) == {}


def test_describe_names_shared_and_own_blocks():
    (line,) = describe(kv({"0_P7": [1, 2, 5, 3], "1_P7": [1, 2, 5, 13], "2_P7": [1, 2, 5, 12], "P8": [4]}))
    assert "`P7`: 3 of its samples" in line and "share blocks [1, 2, 5] (ref_cnt 3" in line
    assert "`0_P7` [3]; `1_P7` [13]; `2_P7` [12]" in line
    # One child finished: two remain, on the same blocks, ref_cnt 2.
    (line,) = describe(kv({"1_P7": [1, 2, 5, 13], "2_P7": [1, 2, 5, 12]}))
    assert "2 of its samples" in line and "(ref_cnt 2" in line
    assert describe(kv({"P1": [1, 2], "P2": [1, 3]})) == []


def test_request_rows_name_their_parent():
    """The Request journey's table: a child's row names its parent and index (n > 1), a plain one neither."""
    from types import SimpleNamespace

    from dashboard.spans import _request_row
    child = SimpleNamespace(request_id="1_7", start_ns=0, end_ns=5, events=[],
                            attributes={"vllm_anatomy.parent_request_id": "7", "vllm_anatomy.child_index": 1})
    plain = SimpleNamespace(request_id="8", start_ns=0, end_ns=5, events=[], attributes={})
    assert (_request_row(child)["parent_request_id"], _request_row(child)["child_index"]) == ("7", 1)
    assert (_request_row(plain)["parent_request_id"], _request_row(plain)["child_index"]) == (None, None)


def test_describe_says_why_siblings_share_nothing():
    """Siblings that share no block (prefix caching off: a child finds the prompt's KV only through it) were
    described as sharing "blocks [] (ref_cnt —: one copy of the prompt's KV ...)": the note says they share
    none, and why."""
    off = {**kv({"0_P7": [1, 2], "1_P7": [3, 4]}), "enable_caching": False}
    (line,) = describe(off)
    assert "They share no block (prefix caching is off in this run" in line and "`0_P7` [1, 2]; `1_P7` [3, 4]" in line
    assert "—" not in line and "[]" not in line and "A shared block returns" not in line
    (line,) = describe({**off, "enable_caching": True})
    assert "They share no block (no block of the prompt was found in the prefix cache" in line
