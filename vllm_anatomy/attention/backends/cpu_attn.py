"""The CPU attention backend: the reference backend's contract, in as few torch ops as it takes.

Plays the role of vLLM's CPU_ATTN backend (vllm/v1/attention/backends/cpu_attn.py,
CPUAttentionBackend with its metadata builder). It is the CPU's fast path, beside
the torch reference backend (torch_ref.py), which stays the readable one and the
oracle: same cache layout, same `do_kv_cache_update` + `forward` contract, same
results (tests/unit/test_cpu_attention.py checks them against each other).

NOTE: what it replaces, and why it is faster. On a CPU with two cores a tiny
torch op costs little by itself, but every op big enough to run on both OpenMP
threads (the gathers, the two attention matmuls and the softmax of the
reference's decode path: five per layer) waits for the second thread to wake
up; on a machine shared with other processes that wait dominated a decode
step. Here each layer runs one index_copy_ per cache half to write, one
index_select per half to read, and one `F.scaled_dot_product_attention` call
(PyTorch's fused CPU flash-attention kernel, the one transformers calls too):
  - the per-step index work (which rows are decodes, which cache blocks each
    request reads, the masks) is planned once per forward pass, not once per
    layer (`_StepPlan`: the part vLLM's CPUAttentionMetadataBuilder.build does);
  - decodes are batched into one fused attention call, keys padded to the
    longest sequence and masked;
  - prefill chunks run one fused call each, causal with the chunk's offset;
  - an attention call with little work (every decode step of a small batch,
    a short prefill) runs on one thread (`_intra_op_threads`). On two cores
    shared with other processes, a multi-threaded op right after an MKL
    matmul was measured hundreds of times slower than the same op on one
    thread: its second thread has to wait for a core. The matmuls, where two
    threads pay off, keep every thread.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from vllm_anatomy.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
)


@dataclass
class _Prefill:
    """One request with query_len > 1."""
    q_start: int
    q_end: int
    block_ids: torch.Tensor              # [num_blocks] long, the request's blocks in order
    seq_len: int
    causal_mask: torch.Tensor | None     # [q, s] bool; None = plain causal (no earlier context)


@dataclass
class _StepPlan:
    """What every layer of one forward pass needs, computed from attn_metadata once."""
    num_reqs: int
    only_decodes: bool                   # one token per request, no padding: output rows = request rows
    decode_token_idx: torch.Tensor | None   # [D] long, query row of each decode
    decode_block_ids: torch.Tensor | None   # [D * nb] long, each decode's nb blocks, flattened
    decode_num_blocks: int
    decode_max_len: int
    decode_mask: torch.Tensor | None     # [D, 1, 1, L] bool; None when every decode has length L
    prefills: list[_Prefill]


# Attention work (query tokens x keys x heads x head_dim) below which one call
# runs on one thread: ~4M multiply-adds, about a millisecond on one core.
_SERIAL_ATTENTION_WORK = 1 << 22


@contextlib.contextmanager
def _intra_op_threads(num_threads: int) -> Iterator[None]:
    """Run the block with torch's intra-op thread count set to num_threads (at most)."""
    saved = torch.get_num_threads()
    if saved <= num_threads:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class CPUAttentionImpl(AttentionImpl):

    # NOTE: one plan per forward pass, shared by every layer's impl: the
    # metadata object is the same for all layers of a step, so identity tells
    # whether the plan is still current.
    _plan_cache: tuple[AttentionMetadata, _StepPlan] | None = None

    def do_kv_cache_update(self, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kernel_timer=None) -> None:
        """key, value: [T, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, nkv, hd]."""
        num_tokens = key.shape[0]
        slots = slot_mapping[:num_tokens]
        # NOTE: slot -1 (a padding token) must not be written; a CPU batch is
        # never padded, so the filtering ops run only when one is there.
        if num_tokens and int(slots.min()) < 0:
            valid = slots >= 0
            slots, key, value = slots[valid], key[valid], value[valid]
        key_cache, value_cache = kv_cache.flatten(1, 2).unbind(0)   # [num_slots, nkv, hd] each
        key_cache.index_copy_(0, slots, key.to(kv_cache.dtype))
        value_cache.index_copy_(0, slots, value.to(kv_cache.dtype))

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                output: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, num_heads, head_dim] -> output [T, num_heads, head_dim] (written in place;
        K/V read from the cache only: key / value are unused)."""
        plan = self._plan(attn_metadata, block_size=kv_cache.shape[2])
        key_cache, value_cache = kv_cache.unbind(0)        # [num_blocks, block_size, nkv, hd] each
        if plan.only_decodes and query.shape[0] == plan.num_reqs:
            return output.copy_(self._attend_decodes(query, key_cache, value_cache, plan))
        # NOTE: rows past the requests' tokens are padding: they stay zero.
        output.zero_()
        if plan.decode_token_idx is not None:
            output[plan.decode_token_idx] = self._attend_decodes(
                query[plan.decode_token_idx], key_cache, value_cache, plan)
        for p in plan.prefills:
            output[p.q_start:p.q_end] = self._attend_prefill(query[p.q_start:p.q_end], key_cache,
                                                             value_cache, p)
        return output

    def _attend_decodes(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        plan: _StepPlan) -> torch.Tensor:
        """D decode tokens at once: query [D, nh, hd] -> [D, nh, hd]."""
        num_decodes, max_len = query.shape[0], plan.decode_max_len
        assert plan.decode_block_ids is not None, "called with decodes planned"
        with self._threads_for(num_decodes * max_len):
            key = _gather(key_cache, plan.decode_block_ids, num_decodes, max_len)   # [D, nkv, L, hd]
            value = _gather(value_cache, plan.decode_block_ids, num_decodes, max_len)
            out = F.scaled_dot_product_attention(query.unsqueeze(2), key, value,    # [D, nh, 1, hd]
                                                 attn_mask=plan.decode_mask, scale=self.scale,
                                                 enable_gqa=True)
        return out.view(num_decodes, self.num_heads, self.head_dim)

    def _attend_prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        p: _Prefill) -> torch.Tensor:
        """One request's chunk: query [q, nh, hd] -> [q, nh, hd], causal with its context offset."""
        with self._threads_for(query.shape[0] * p.seq_len):
            key = _gather(key_cache, p.block_ids, 1, p.seq_len)                   # [1, nkv, s, hd]
            value = _gather(value_cache, p.block_ids, 1, p.seq_len)
            out = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), key, value,
                                                 attn_mask=p.causal_mask, is_causal=p.causal_mask is None,
                                                 scale=self.scale, enable_gqa=True)   # [1, nh, q, hd]
        return out[0].transpose(0, 1)

    def _threads_for(self, query_key_pairs: int) -> contextlib.AbstractContextManager:
        work = query_key_pairs * self.num_heads * self.head_dim
        return _intra_op_threads(1) if work < _SERIAL_ATTENTION_WORK else contextlib.nullcontext()

    @classmethod
    def _plan(cls, md: AttentionMetadata, block_size: int) -> _StepPlan:
        cached = cls._plan_cache
        if cached is not None and cached[0] is md:
            return cached[1]
        plan = _build_plan(md, block_size)
        cls._plan_cache = (md, plan)
        return plan


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, seq_len: int) -> torch.Tensor:
    """cache [num_blocks, block_size, nkv, hd], block_ids [num_seqs * nb] -> [num_seqs, nkv, seq_len, hd].

    NOTE: index_select of whole blocks (rows of block_size * nkv * hd values)
    copies them with memcpy, on one thread while there are few."""
    blocks = cache.index_select(0, block_ids)                      # [num_seqs * nb, block_size, nkv, hd]
    seqs = blocks.view(num_seqs, -1, *cache.shape[2:])[:, :seq_len]   # [num_seqs, L, nkv, hd]
    return seqs.transpose(1, 2)


def _build_plan(md: AttentionMetadata, block_size: int) -> _StepPlan:
    # The loop bounds must be Python ints: read the host copies. The lengths must be
    # exact (they mask the keys): never seq_lens_cpu_upper_bound; the seq_lens_cpu
    # property copies them from the device when the host has none (once: the plan is kept).
    query_start_loc = (md.query_start_loc_cpu if md.query_start_loc_cpu is not None
                       else md.query_start_loc).tolist()
    seq_lens = md.seq_lens_cpu.tolist()
    num_reqs = md.num_reqs
    block_table = md.block_table
    decodes = [i for i in range(num_reqs) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    prefills = []
    for i in range(num_reqs):
        q_start, q_end = query_start_loc[i], query_start_loc[i + 1]
        query_len, seq_len = q_end - q_start, seq_lens[i]
        if query_len <= 1:
            continue
        num_blocks = -(-seq_len // block_size)
        context_len = seq_len - query_len
        mask = None
        if context_len:       # query j sees keys 0 .. context_len + j
            mask = torch.arange(seq_len)[None, :] <= torch.arange(context_len, seq_len)[:, None]
        prefills.append(_Prefill(q_start, q_end, block_table[i, :num_blocks].long(), seq_len, mask))
    only_decodes = (len(decodes) == num_reqs and md.num_actual_tokens == num_reqs
                    and md.slot_mapping.shape[0] == num_reqs)
    if not decodes:
        return _StepPlan(num_reqs, False, None, None, 0, 0, None, prefills)
    lens = [seq_lens[i] for i in decodes]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    block_ids = (block_table[decodes, :num_blocks] if len(decodes) < num_reqs
                 else block_table[:num_reqs, :num_blocks])
    mask = None
    if min(lens) != max_len:   # shorter sequences: keys past their length are another request's
        mask = (torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    token_idx = None if only_decodes else torch.tensor([query_start_loc[i] for i in decodes])
    return _StepPlan(num_reqs, only_decodes, token_idx, block_ids.reshape(-1).long(), num_blocks,
                     max_len, mask, prefills)


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CPUAttentionImpl
