"""Shared test helpers: build paged-attention batches by hand (and `interrupt_nth_add`, below).

`build_attn_metadata` does, for a list of requests, what
GPUModelRunner._prepare_inputs does for a real step (positions, query_start_loc,
seq_lens, block_table, slot_mapping). `PagedSequences` is a toy stand-in for
scheduler + KV cache manager + runner: it hands out blocks from a *shuffled*
free list (so block tables are non-contiguous, as in a long-running server)
and runs the model on a flat batch of chunks. Tests use it to drive a model
step by step without the engine.
"""
from __future__ import annotations

import importlib.util
import itertools
import random
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Hashable, Iterator, Sequence

import torch

from vllm_anatomy.attention.backends.abstract import PAD_SLOT_ID, AttentionMetadata


def build_attn_metadata(query_lens: Sequence[int], seq_lens: Sequence[int],
                        block_tables: Sequence[Sequence[int]], block_size: int,
                        num_padded_tokens: int | None = None,
                        device: str | torch.device = "cpu") -> tuple[torch.Tensor, AttentionMetadata]:
    """Metadata for requests whose last query_lens[i] of seq_lens[i] tokens are new.

    Returns (positions [T_padded] long, AttentionMetadata). Padding tokens (up to
    num_padded_tokens) get position 0 and slot -1.
    """
    num_tokens = sum(query_lens)
    num_padded_tokens = num_padded_tokens or num_tokens
    positions, slot_mapping = [], []
    for query_len, seq_len, blocks in zip(query_lens, seq_lens, block_tables):
        assert len(blocks) * block_size >= seq_len, "not enough blocks for the sequence"
        for pos in range(seq_len - query_len, seq_len):
            positions.append(pos)
            slot_mapping.append(blocks[pos // block_size] * block_size + pos % block_size)
    pad = num_padded_tokens - num_tokens
    positions += [0] * pad
    slot_mapping += [PAD_SLOT_ID] * pad
    max_blocks = max((len(b) for b in block_tables), default=0)
    block_table = [list(b) + [0] * (max_blocks - len(b)) for b in block_tables]
    query_start_loc = [0]
    for query_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)
    query_start_loc_cpu = torch.tensor(query_start_loc, dtype=torch.int32)
    seq_lens_cpu = torch.tensor(list(seq_lens), dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=len(query_lens),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc=query_start_loc_cpu.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_table=torch.tensor(block_table, dtype=torch.int32, device=device).reshape(
            len(block_tables), max_blocks),                  # [R, max_blocks], 0-padded
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc_cpu,
        _seq_lens_cpu=seq_lens_cpu,
        seq_lens_cpu_upper_bound=seq_lens_cpu,
    )
    return torch.tensor(positions, dtype=torch.long, device=device), metadata


def allocate_kv_caches(model, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    """One zeroed cache per layer, in the layout of the model's attention backend."""
    shape = model.attn_backend.get_kv_cache_shape(num_blocks, block_size, model.num_kv_heads,
                                                  model.head_dim)
    weight = model.lm_head.weight
    return [torch.zeros(shape, dtype=weight.dtype, device=weight.device)
            for _ in range(model.num_layers)]


class PagedSequences:
    """Sequences sharing one paged KV cache; `step` runs one flat batch of chunks."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_ids: dict[Hashable, list[int]] = {}
        self.num_computed_tokens: dict[Hashable, int] = {}

    def step(self, chunks: Sequence[tuple[Hashable, Sequence[int]]]) -> list[torch.Tensor]:
        """chunks: (seq_id, new token ids) per request, in batch order.

        Each chunk continues its sequence where the previous step left it (its
        context is already in the cache). Returns each chunk's logits
        [len(chunk), V] (float32) — every position, not just the last one.
        """
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        token_ids_flat: list[int] = []
        for seq_id, token_ids in chunks:
            num_computed = self.num_computed_tokens.get(seq_id, 0)
            seq_len = num_computed + len(token_ids)
            blocks = self.block_ids.setdefault(seq_id, [])
            while len(blocks) * self.block_size < seq_len:
                blocks.append(self.free_blocks.pop())
            query_lens.append(len(token_ids))
            seq_lens.append(seq_len)
            block_tables.append(blocks)
            token_ids_flat.extend(token_ids)
            self.num_computed_tokens[seq_id] = seq_len
        device = self.kv_caches[0].device
        positions, metadata = build_attn_metadata(query_lens, seq_lens, block_tables,
                                                  self.block_size, device=device)
        input_ids = torch.tensor(token_ids_flat, dtype=torch.long, device=device)   # [T]
        with torch.inference_mode():
            hidden_states = self.model(input_ids, positions, self.kv_caches, metadata)
            logits = self.model.compute_logits(hidden_states)       # [T, V]
        return list(logits.split(query_lens))


@contextmanager
def imported_from(folder: str, module_names: Sequence[str]) -> Iterator[None]:
    """`folder` on sys.path and `module_names` imported afresh while the block runs (scripts
    such as bench/*.py, which import each other by bare name); afterwards the path and the
    modules of those names are what they were before."""
    saved_path = list(sys.path)
    saved_modules = {name: sys.modules.pop(name) for name in module_names if name in sys.modules}
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in module_names:
            sys.modules.pop(name, None)
        sys.modules.update(saved_modules)


def module_from_file(name: str, path: str) -> ModuleType:
    """The Python file at `path` run as a fresh module `name` (not put in sys.modules): a
    lesson or a script that is no importable module."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path} is not a Python file"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def interrupt_nth_add(monkeypatch, engine_core_client, n: int) -> None:
    """Ctrl-C lands in the n-th EngineCoreClient.add_request from now on (1-based): the
    calls before it go through, the n-th raises KeyboardInterrupt (monkeypatch.undo() restores)."""
    add, calls = engine_core_client.add_request, itertools.count(1)

    def interrupted_add(request):
        if next(calls) == n:
            raise KeyboardInterrupt
        add(request)
    monkeypatch.setattr(engine_core_client, "add_request", interrupted_add)


def count_calls(monkeypatch, fused_module, fused_name: str) -> dict[str, int]:
    """Calls of a fused KV-write kernel's wrapper (fused_module.fused_name) and of reshape_and_cache,
    counted from here on (the engine tests of the RoPE + KV-cache fusions)."""
    from vllm_anatomy.kernels import reshape_and_cache as rc
    calls = {"fused": 0, "reshape_and_cache": 0}

    def count(name, real):
        def wrapped(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return wrapped
    monkeypatch.setattr(fused_module, fused_name, count("fused", getattr(fused_module, fused_name)))
    monkeypatch.setattr(rc, "reshape_and_cache", count("reshape_and_cache", rc.reshape_and_cache))
    return calls
