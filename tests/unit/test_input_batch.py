"""InputBatch / BlockTable: rows stay consistent through add, remove, condense, swap."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.worker.block_table import BlockTable
from vllm_anatomy.worker.gpu_input_batch import CachedRequestState, InputBatch

BLOCK_SIZE = 4
MAX_REQS = 8
MAX_LEN = 64
VOCAB = 100


def make_batch() -> InputBatch:
    return InputBatch(max_num_reqs=MAX_REQS, max_model_len=MAX_LEN, max_num_batched_tokens=256,
                      device="cpu", pin_memory=False, vocab_size=VOCAB, block_size=BLOCK_SIZE)


def make_state(req_id: str, num_prompt: int, num_output: int, first_block: int,
               seed: int | None = None, **sp) -> CachedRequestState:
    rng = np.random.default_rng(zlib.crc32(req_id.encode()))
    prompt = rng.integers(0, VOCAB, num_prompt).tolist()
    output = rng.integers(0, VOCAB, num_output).tolist()
    n = num_prompt + num_output
    num_blocks = -(-n // BLOCK_SIZE)
    # Scattered, non-contiguous block ids, as a real pool hands out.
    block_ids = [first_block + 7 * j for j in range(num_blocks)]
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return CachedRequestState(req_id, prompt, SamplingParams(seed=seed, **sp), gen,
                              (block_ids,), num_computed_tokens=max(n - 1, 0),
                              output_token_ids=output)


def check_consistent(batch: InputBatch, states: dict[str, CachedRequestState]) -> None:
    """Everything indexed by row agrees with the requests' own states."""
    assert batch.num_reqs == len(states)
    assert sorted(batch.req_ids) == sorted(states)            # dense prefix after condense
    assert len(batch._req_ids) == batch.num_reqs
    for req_id, state in states.items():
        row = batch.req_id_to_index[req_id]
        assert batch._req_ids[row] == req_id
        n = state.num_tokens
        assert batch.num_tokens_no_spec[row] == n
        assert batch.num_prompt_tokens[row] == state.num_prompt_tokens
        assert batch.token_ids_cpu[row, :n].tolist() == [state.get_token_id(i) for i in range(n)]
        assert batch.num_computed_tokens_cpu[row] == state.num_computed_tokens
        nb = batch.block_table.num_blocks_per_row[row]
        assert batch.block_table.block_table_np[row, :nb].tolist() == state.block_ids[0]
        assert batch.temperature_cpu[row] == pytest.approx(state.sampling_params.temperature)
        assert batch.generators.get(row) is state.generator


def check_slots(batch: InputBatch, states: dict[str, CachedRequestState]) -> None:
    """slot_mapping from the (moved) block-table rows == slots computed from block ids."""
    req_indices, positions, expected = [], [], []
    for req_id in batch.req_ids:
        state = states[req_id]
        for pos in range(state.num_tokens):
            req_indices.append(batch.req_id_to_index[req_id])
            positions.append(pos)
            blocks = state.block_ids[0]
            expected.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    bt = batch.block_table
    bt.commit_block_table(batch.num_reqs)
    rows = np.array(req_indices, dtype=np.int64)
    query_start_loc = torch.tensor(np.searchsorted(rows, np.arange(batch.num_reqs + 1)), dtype=torch.int32)
    bt.compute_slot_mapping(batch.num_reqs, query_start_loc, torch.tensor(positions, dtype=torch.int64))
    t = len(expected)
    assert bt.slot_mapping[:t].tolist() == expected
    assert (bt.slot_mapping[t:] == -1).all()


def test_add_reuses_lowest_freed_row_and_condense_moves_last_into_smallest_hole():
    batch = make_batch()
    states = {r: make_state(r, 5, 2, 10 * i) for i, r in enumerate("abcdef")}
    for s in states.values():
        batch.add_request(s)
    assert batch.req_ids == list("abcdef")
    batch.remove_request("b")
    batch.remove_request("d")
    del states["b"], states["d"]
    g = make_state("g", 3, 0, 90)
    assert batch.add_request(g) == 1          # the lowest hole, not the end
    states["g"] = g
    moves = batch.condense()
    assert moves == [(5, 3)]                  # f (last row) fills hole 3
    assert batch.req_ids == ["a", "g", "c", "f", "e"]
    check_consistent(batch, states)
    check_slots(batch, states)


def test_condense_two_holes_and_trailing_hole():
    batch = make_batch()
    states = {r: make_state(r, 6, 1, 10 * i) for i, r in enumerate("abcdef")}
    for s in states.values():
        batch.add_request(s)
    for r in "afb":                           # holes 0, 1 and the last row 5
        batch.remove_request(r)
        del states[r]
    assert batch.condense() == [(4, 0), (3, 1)]
    assert batch.req_ids == ["e", "d", "c"]
    assert batch.snapshot()["condense_moves"] == [[4, 0], [3, 1]]
    # The vacated rows' block-table entries were cleared.
    assert batch.block_table.num_blocks_per_row[3:].tolist() == [0] * (MAX_REQS - 3)
    check_consistent(batch, states)
    check_slots(batch, states)


def test_swap_states_keeps_everything_together():
    batch = make_batch()
    states = {"a": make_state("a", 9, 3, 1, seed=7, temperature=0.5),
              "b": make_state("b", 2, 0, 50, temperature=0.0)}
    for s in states.values():
        batch.add_request(s)
    batch.swap_states(0, 1)
    assert batch.req_ids == ["b", "a"]
    check_consistent(batch, states)
    check_slots(batch, states)


def test_refresh_metadata_defaults_are_none():
    batch = make_batch()
    batch.add_request(make_state("a", 3, 0, 1, temperature=0.0))
    md = batch.refresh_metadata()
    assert md.all_greedy and not md.all_random
    assert md.temperature is None and md.top_p is None and md.top_k is None and md.min_p is None
    assert md.max_num_logprobs is None
    batch.add_request(make_state("b", 3, 0, 20, seed=3, temperature=0.7, top_k=5, logprobs=2))
    md = batch.refresh_metadata()
    assert not md.all_greedy and not md.all_random
    assert md.temperature.tolist() == pytest.approx([0.0, 0.7])
    assert md.top_k.tolist() == [VOCAB, 5]     # vocab_size = "no top-k" for row 0
    assert md.top_p is None and md.min_p is None
    assert set(md.generators) == {1}
    assert md.max_num_logprobs == 2


def test_block_table_append_move_and_overflow():
    bt = BlockTable(block_size=2, max_num_reqs=3, max_num_blocks_per_req=3,
                    max_num_batched_tokens=8, device="cpu")
    bt.add_row([4, 9], 0)
    bt.append_row([1], 0)
    bt.add_row([6], 2)
    bt.move_row(2, 1)
    assert bt.snapshot(3)["rows"] == [[4, 9, 1], [6], []]
    with pytest.raises(ValueError):
        bt.append_row([3], 0)
    bt.commit_block_table(2)
    assert bt.get_device_tensor(2).tolist() == [[4, 9, 1], [6, 0, 0]]
    # Row 0 positions 0..4 -> blocks 4,4,9,9,1; row 1 position 1 -> block 6 offset 1.
    bt.compute_slot_mapping(2, torch.tensor([0, 5, 6], dtype=torch.int32), torch.tensor([0, 1, 2, 3, 4, 1]))
    assert bt.slot_mapping.tolist() == [8, 9, 18, 19, 2, 13, -1, -1]


ops = st.lists(st.tuples(st.sampled_from(["add", "add", "remove", "swap", "condense"]),
                         st.integers(0, 10**6)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_add_remove_sequences(op_list):
    batch = make_batch()
    states: dict[str, CachedRequestState] = {}
    next_id = 0
    for op, r in op_list:
        if op == "add" and batch.num_reqs < MAX_REQS:
            req_id = f"r{next_id}"
            next_id += 1
            s = make_state(req_id, 1 + r % 20, r % 7, 1 + r % 40,
                           seed=r if r % 3 == 0 else None, temperature=(r % 4) * 0.5)
            batch.add_request(s)
            states[req_id] = s
        elif op == "remove" and states:
            req_id = sorted(states)[r % len(states)]
            batch.remove_request(req_id)
            del states[req_id]
        elif op == "swap" and batch.num_reqs >= 2:
            batch.condense()                  # swapping is only meaningful on a dense batch
            batch.swap_states(r % batch.num_reqs, (r // 7) % batch.num_reqs)
        elif op == "condense":
            moves = batch.condense()
            assert all(src > dst for src, dst in moves)
    batch.condense()
    check_consistent(batch, states)
    check_slots(batch, states)
