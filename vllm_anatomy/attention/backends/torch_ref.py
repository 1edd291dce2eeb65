"""The torch reference attention backend: paged attention in plain, readable torch.

Plays the role vLLM's FlashAttention / Triton backends play
(vllm/v1/attention/backends/flash_attn.py, triton_attn.py), with the same
contract: `do_kv_cache_update` scatters the new K/V into the paged cache
(vLLM: reshape_and_cache_flash), then `forward` computes attention reading
K/V *only from the cache*. It is the CPU default and the oracle the Triton
kernels are tested against, so it favours clarity over speed: one Python
loop over the requests of the flat batch. One concession to speed: all
decodes (query_len == 1) of a batch are computed together in a few batched
ops, since a per-request loop of tiny ops dominated a decode step on the CPU
(~0.25 ms per request per layer: 16 requests x 30 layers = 120 ms a step).

Per request i of the batch (R requests, T tokens in all):
    query tokens  query[query_start_loc[i] : query_start_loc[i + 1]]
    query_len     = query_start_loc[i + 1] - query_start_loc[i]
    seq_len       = seq_lens[i]                 (tokens whose K/V are in the cache)
    context_len   = seq_len - query_len         (tokens computed in earlier steps)
    query token j sits at position context_len + j and sees keys 0 .. context_len + j.
A decode is just query_len == 1; a prefill chunk is query_len > 1 with any
context_len — nothing here distinguishes the two.
"""
from __future__ import annotations

import torch

from vllm_anatomy.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
)
from vllm_anatomy.tracing.runner_tracer import NULL_KERNEL_TIMER


class TorchReferenceImpl(AttentionImpl):

    def do_kv_cache_update(self, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kernel_timer=NULL_KERNEL_TIMER) -> None:
        """key, value: [T, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, nkv, hd]."""
        num_tokens = key.shape[0]
        # NOTE: slot_mapping may be longer than key (padded batch); and padding
        # tokens carry slot -1, which must not be written: slot -1 would wrap
        # around to the last slot of the cache and corrupt another request.
        slots = slot_mapping[:num_tokens]
        valid = slots >= 0
        slots = slots[valid]
        key_cache, value_cache = kv_cache.unbind(0)          # [num_blocks, block_size, nkv, hd] each
        # A slot indexes the flattened (block, offset) grid: slot = block * block_size + offset.
        key_cache.flatten(0, 1)[slots] = key[valid].to(kv_cache.dtype)      # [num_slots, nkv, hd]
        value_cache.flatten(0, 1)[slots] = value[valid].to(kv_cache.dtype)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                output: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, num_heads, head_dim] -> output [T, num_heads, head_dim] (written in place;
        K/V read from the cache only: key / value are unused)."""
        # NOTE: rows past num_actual_tokens are padding (e.g. a CUDA-graph-sized
        # batch); they stay zero, as vLLM's kernels leave them untouched.
        output.zero_()
        key_cache, value_cache = kv_cache.unbind(0)
        block_size = key_cache.shape[1]
        # The loop bounds must be Python ints: read the host copies (no device sync).
        # NOTE: exact lengths, never seq_lens_cpu_upper_bound: they mask the keys. Where
        # the host has no exact copy (the padded drafter batch's decode forwards), the
        # seq_lens_cpu property reads the device once per forward and keeps the copy.
        query_start_loc = _host(attn_metadata.query_start_loc_cpu, attn_metadata.query_start_loc)
        seq_lens = attn_metadata.seq_lens_cpu.tolist()
        decode_reqs = [i for i in range(attn_metadata.num_reqs)
                       if query_start_loc[i + 1] - query_start_loc[i] == 1]
        if decode_reqs:
            q_idx = [query_start_loc[i] for i in decode_reqs]
            output[q_idx] = self._attend_decodes(query[q_idx], key_cache, value_cache,
                                                 attn_metadata.block_table[decode_reqs],
                                                 [seq_lens[i] for i in decode_reqs])
        for i in range(attn_metadata.num_reqs):
            q_start, q_end = query_start_loc[i], query_start_loc[i + 1]
            query_len, seq_len = q_end - q_start, seq_lens[i]
            if query_len <= 1:      # nothing to do, or a decode done above
                continue
            num_blocks = -(-seq_len // block_size)                      # cdiv
            block_ids = attn_metadata.block_table[i, :num_blocks].long()
            # Gather this request's blocks, in logical order, then drop the unused
            # tail of the last block: [num_blocks, block_size, nkv, hd] -> [seq_len, nkv, hd]
            key = key_cache[block_ids].flatten(0, 1)[:seq_len]
            value = value_cache[block_ids].flatten(0, 1)[:seq_len]
            output[q_start:q_end] = self._attend(query[q_start:q_end], key, value,
                                                 context_len=seq_len - query_len)
        return output

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                context_len: int) -> torch.Tensor:
        """query [q, nh, hd], key/value [s, nkv, hd] -> [q, nh, hd]; causal with an offset."""
        query_len, seq_len = query.shape[0], key.shape[0]
        # GQA: query head h reads kv head h // (num_heads // num_kv_heads).
        num_queries_per_kv = self.num_heads // self.num_kv_heads
        key = key.repeat_interleave(num_queries_per_kv, dim=1)          # [s, nh, hd]
        value = value.repeat_interleave(num_queries_per_kv, dim=1)      # [s, nh, hd]
        # NOTE: scores and softmax in fp32 whatever the cache dtype, as the real
        # kernels accumulate in fp32; only the output is cast back.
        scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * self.scale
        query_pos = context_len + torch.arange(query_len, device=query.device)   # [q]
        key_pos = torch.arange(seq_len, device=query.device)                    # [s]
        causal = key_pos[None, :] <= query_pos[:, None]                         # [q, s]
        scores = scores.masked_fill(~causal, float("-inf"))                      # [nh, q, s]
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, value.float())                # [q, nh, hd]
        return out.to(query.dtype)


    def _attend_decodes(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """D decode tokens at once: query [D, nh, hd] -> [D, nh, hd].

        Each token sees every key of its own sequence (it is the last one), so
        the only mask is the sequence's length within the padded gather."""
        num_decodes, block_size = query.shape[0], key_cache.shape[1]
        max_len = max(seq_lens)
        num_blocks = -(-max_len // block_size)
        block_ids = block_table[:, :num_blocks].long()                         # [D, nb]
        key = key_cache[block_ids].flatten(1, 2)[:, :max_len].float()          # [D, L, nkv, hd]
        value = value_cache[block_ids].flatten(1, 2)[:, :max_len].float()      # [D, L, nkv, hd]
        # GQA without copying K/V: view the query heads as [nkv, g] groups,
        # query head h = kv_head * g + j reads kv head h // g.
        group = self.num_heads // self.num_kv_heads
        q = query.float().view(num_decodes, self.num_kv_heads, group, self.head_dim)  # [D, nkv, g, hd]
        scores = torch.einsum("dkgh,dlkh->dkgl", q, key) * self.scale                 # [D, nkv, g, L]
        lens = torch.tensor(seq_lens, device=query.device)
        valid = torch.arange(max_len, device=query.device)[None, :] < lens[:, None]  # [D, L]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("dkgl,dlkh->dkgh", probs, value)                           # [D, nkv, g, hd]
        return out.reshape(num_decodes, self.num_heads, self.head_dim).to(query.dtype)


def _host(cpu_copy: torch.Tensor | None, tensor: torch.Tensor) -> list[int]:
    # NOTE: falling back to tensor.tolist() on a GPU tensor would be a hidden
    # CPU<->GPU sync; the runner and the drafter fill query_start_loc_cpu, so this never happens there.
    return (cpu_copy if cpu_copy is not None else tensor).tolist()


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchReferenceImpl
