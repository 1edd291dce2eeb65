"""compute_slot_mapping: where each scheduled token's K/V goes in the paged cache.

Mirrors the Triton kernel behind vllm/v1/worker/block_table.py
(BlockTable.compute_slot_mapping launches _compute_slot_mapping_kernel); the
worker here
computes the same thing in numpy on the CPU (vllm_anatomy/worker/block_table.py).

For token t of request r, at position p (its index in the whole sequence):

    slot_mapping[t] = block_table[r, p // block_size] * block_size + p % block_size

and slot_mapping[num_tokens : pad_to] = PAD_SLOT_ID (-1): tokens of a padded
batch (CUDA graphs) that must write nowhere.

Memory layout (all on one device):
    block_table     [max_num_reqs, max_num_blocks_per_req] int32, row r = batch row r
    query_start_loc [num_reqs + 1] int32, request r owns tokens qsl[r] .. qsl[r+1]-1
    positions       [>= num_tokens] int64 (or int32)
    slot_mapping    [>= pad_to] int64 (output)

Grid: (num_reqs + 1,). Program r < num_reqs handles the tokens of request r,
BLOCK_T at a time; the extra last program writes the -1 padding. num_tokens is
read on the device from query_start_loc[num_reqs], so the launch needs no
CPU<->GPU sync (vLLM does the same: the padding program exists for that reason).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.launch import check_launchable

PAD_SLOT_ID = -1


@triton.jit(do_not_specialize=["num_reqs", "pad_to"])   # per-step sizes: see launch.py
def _compute_slot_mapping_kernel(
    block_table_ptr,            # [max_num_reqs, max_num_blocks_per_req] int32
    block_table_stride,         # row stride of block_table, in elements
    query_start_loc_ptr,        # [num_reqs + 1] int32
    positions_ptr,              # [num_tokens] int
    slot_mapping_ptr,           # [pad_to] int64, output
    num_reqs,
    pad_to,                     # fill -1 from num_tokens up to here
    BLOCK_SIZE: tl.constexpr,   # KV-cache block size (tokens per block)
    BLOCK_T: tl.constexpr,      # tokens handled per loop iteration
    PAD_ID: tl.constexpr,       # PAD_SLOT_ID (a jit function may read only constexpr globals)
):
    req = tl.program_id(0)
    if req == num_reqs:
        # The padding program: everything after the last real token is -1.
        num_tokens = tl.load(query_start_loc_ptr + num_reqs)
        for start in range(num_tokens, pad_to, BLOCK_T):
            offs = start + tl.arange(0, BLOCK_T)
            tl.store(slot_mapping_ptr + offs, tl.full([BLOCK_T], PAD_ID, tl.int64),
                     mask=offs < pad_to)
        return

    start_tok = tl.load(query_start_loc_ptr + req)
    end_tok = tl.load(query_start_loc_ptr + req + 1)
    # NOTE: int64 row offset: req * stride fits int32 in practice, but the
    # product below (block id * block_size) must be int64 for caches with more
    # than 2**31 slots, so promote once, early.
    row_ptr = block_table_ptr + req.to(tl.int64) * block_table_stride
    for start in range(start_tok, end_tok, BLOCK_T):
        offs = start + tl.arange(0, BLOCK_T)
        mask = offs < end_tok
        pos = tl.load(positions_ptr + offs, mask=mask, other=0).to(tl.int64)
        block_id = tl.load(row_ptr + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
        slot = block_id * BLOCK_SIZE + pos % BLOCK_SIZE
        tl.store(slot_mapping_ptr + offs, slot, mask=mask)


def compute_slot_mapping(block_table: torch.Tensor, query_start_loc: torch.Tensor,
                         positions: torch.Tensor, block_size: int, num_reqs: int,
                         slot_mapping: torch.Tensor | None = None,
                         pad_to: int | None = None) -> torch.Tensor:
    """Fill (or allocate) slot_mapping[:pad_to]; see the module docstring.

    pad_to defaults to positions.numel() (the caller's padded token count).
    Launch-time arguments are Python ints only: no device value is read on the host.
    """
    if pad_to is None:
        pad_to = positions.numel()
    if slot_mapping is None:
        slot_mapping = torch.empty(pad_to, dtype=torch.int64, device=positions.device)
    assert slot_mapping.dtype == torch.int64 and slot_mapping.numel() >= pad_to
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    check_launchable(positions, _compute_slot_mapping_kernel)
    # NOTE: 64 tokens per iteration: enough to keep loads in flight on a GPU,
    # and few iterations in the interpreter (which pays per program, not per element).
    _compute_slot_mapping_kernel[(num_reqs + 1,)](
        block_table, block_table.stride(0), query_start_loc, positions, slot_mapping,
        num_reqs, pad_to, BLOCK_SIZE=block_size, BLOCK_T=64, PAD_ID=PAD_SLOT_ID)
    return slot_mapping


def compute_slot_mapping_ref(block_table: torch.Tensor, query_start_loc: torch.Tensor,
                             positions: torch.Tensor, block_size: int, num_reqs: int,
                             pad_to: int | None = None) -> torch.Tensor:
    """Plain torch: the same formula, one gather."""
    if pad_to is None:
        pad_to = positions.numel()
    qsl = query_start_loc[:num_reqs + 1].long()
    query_lens = qsl[1:] - qsl[:-1]                                            # [R]
    num_tokens = int(qsl[-1])
    req_indices = torch.repeat_interleave(torch.arange(num_reqs, device=qsl.device),
                                          query_lens)                          # [T]
    pos = positions[:num_tokens].long()
    block_ids = block_table[req_indices, pos // block_size].long()             # [T]
    out = torch.full((pad_to,), PAD_SLOT_ID, dtype=torch.int64, device=positions.device)
    out[:num_tokens] = block_ids * block_size + pos % block_size
    return out
