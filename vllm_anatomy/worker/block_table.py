"""BlockTable: each batch row's list of physical KV-cache blocks, and slot_mapping.

Mirrors vllm/v1/worker/block_table.py (BlockTable; MultiGroupBlockTable is not
needed: we have a single KV-cache group, full attention).

Row r of `block_table` holds the block ids of the request in InputBatch row r:
logical block j of that request lives in physical block `block_table[r, j]`.
From it comes `slot_mapping`: for every token scheduled this step, the flat
slot of the paged KV cache its key/value must be written to:

    slot = block_table[req, pos // block_size] * block_size + pos % block_size

NOTE: block ids arrive from the scheduler as plain integers (SchedulerOutput);
the worker never sees KVCacheBlock objects. The scheduler owns *which* blocks a
request has; this table only mirrors that, indexed by batch row.

Simplified here: no context parallelism (DCP/PCP interleaving), no hybrid
groups, no 128-token width rounding. As in vLLM, slot_mapping is computed
on the GPU by a Triton kernel (`compute_slot_mapping`, from the block table and
positions already on the device); on a CPU the same method computes the same
formula in numpy.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_anatomy.attention.backends.abstract import PAD_SLOT_ID


class BlockTable:

    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 max_num_batched_tokens: int, device: torch.device | str,
                 pin_memory: bool = False) -> None:
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(device)

        # [max_num_reqs, max_num_blocks_per_req] int32, on the device (read by kernels)
        # and on the CPU (edited here), with a numpy view of the CPU tensor.
        shape = (max_num_reqs, max_num_blocks_per_req)
        self.block_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.block_table_cpu = torch.zeros(shape, dtype=torch.int32, device="cpu",
                                           pin_memory=pin_memory)
        self.block_table_np = self.block_table_cpu.numpy()
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

        # [max_num_batched_tokens] int64: one slot per scheduled token, written
        # where the kernels read it (it has no host copy: see compute_slot_mapping).
        self.slot_mapping = torch.full((max_num_batched_tokens,), PAD_SLOT_ID,
                                       dtype=torch.int64, device=self.device)

    # -- row edits (CPU only; the device copy is refreshed by commit_block_table) --
    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        """Add newly allocated blocks to the end of a row."""
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row_idx])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"row {row_idx}: {end} blocks exceed max_num_blocks_per_req="
                             f"{self.max_num_blocks_per_req}")
        self.block_table_np[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        """Start a row afresh (a new or re-added request)."""
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        self.num_blocks_per_row[row_idx] = 0
        self.block_table_np[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row `src` into row `tgt` and empty `src` (InputBatch.condense)."""
        n = int(self.num_blocks_per_row[src])
        self.block_table_np[tgt, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[tgt] = n
        self.clear_row(src)

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange two rows (InputBatch.swap_states)."""
        self.num_blocks_per_row[[src, tgt]] = self.num_blocks_per_row[[tgt, src]]
        # NOTE: fancy indexing on the right makes a copy, so this is a true swap.
        self.block_table_np[[src, tgt]] = self.block_table_np[[tgt, src]]

    # -- CPU -> device --------------------------------------------------------
    def commit_block_table(self, num_reqs: int) -> None:
        """Copy the first `num_reqs` rows to the device.

        NOTE: called first in _prepare_inputs so that this host-to-device copy
        (non_blocking, from pinned memory on CUDA) overlaps the numpy work that
        follows; nothing waits for it on the CPU.
        """
        self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs], non_blocking=True)

    def compute_slot_mapping(self, num_reqs: int, query_start_loc: torch.Tensor,
                             positions: torch.Tensor) -> None:
        """slot_mapping for this step's tokens, PAD_SLOT_ID (-1) for the rest of the buffer.

        query_start_loc [R + 1] and positions [T] are the step's inputs where
        the kernels read them, after commit_block_table. NOTE: the whole tail
        is -1 (as vLLM's kernel writes it), so whatever padding the CUDA-graph
        dispatcher decides on later (a graph of N >= T tokens) writes into no
        real slot: the KV write skips -1.
        On a GPU this is the Triton kernel (vLLM's _compute_slot_mapping_kernel);
        on a CPU, numpy on the same tensors."""
        pad_to = self.slot_mapping.shape[0]
        if self.device.type == "cuda":
            from vllm_anatomy.kernels.slot_mapping import compute_slot_mapping
            compute_slot_mapping(self.block_table, query_start_loc, positions, self.block_size, num_reqs,
                                 self.slot_mapping, pad_to)
            return
        positions_np = positions.numpy()                                       # [T]
        num_tokens = positions_np.shape[0]
        req_indices = np.repeat(np.arange(num_reqs), np.diff(query_start_loc.numpy()[:num_reqs + 1]))  # [T]
        # Index into the flattened table: row r, logical block b -> r * width + b.
        block_table_indices = (req_indices * self.max_num_blocks_per_req
                               + positions_np // self.block_size)             # [T]
        block_numbers = self.block_table.numpy().ravel()[block_table_indices]  # [T]
        block_offsets = positions_np % self.block_size                        # [T]
        slot_mapping = self.slot_mapping.numpy()
        np.add(block_numbers.astype(np.int64) * self.block_size, block_offsets, out=slot_mapping[:num_tokens])
        slot_mapping[num_tokens:pad_to] = PAD_SLOT_ID

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        return self.block_table[:num_reqs]                    # [R, max_num_blocks_per_req]

    def row_lists(self, num_rows: int) -> list[list[int]]:
        """The block ids of rows [0, num_rows), one list per row (for snapshots)."""
        table = self.block_table_np
        # NOTE: the row lengths as Python ints (one tolist): slicing with numpy
        # scalars, one at a time, costs more than the slice itself.
        return [table[row, :n].tolist() for row, n in enumerate(self.num_blocks_per_row[:num_rows].tolist())]

    def snapshot(self, num_reqs: int | None = None) -> dict:
        """Plain data: each row's block ids (rows [0, num_reqs), default all non-empty rows)."""
        if num_reqs is None:
            nonzero = np.nonzero(self.num_blocks_per_row)[0]
            num_reqs = int(nonzero[-1]) + 1 if len(nonzero) else 0
        return {"block_size": self.block_size,
                "max_num_blocks_per_req": self.max_num_blocks_per_req,
                "rows": self.row_lists(num_reqs)}
