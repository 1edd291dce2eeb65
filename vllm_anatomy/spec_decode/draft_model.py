"""DraftModelProposer: a small model of the same vocabulary guesses the next K tokens.

Mirrors vllm/v1/spec_decode/draft_model.py (DraftModelProposer) and its base,
vllm/v1/spec_decode/llm_base_proposer.py (SpecDecodeBaseProposer). After the target's step has
been verified and sampled, for every request that sampled a token:

  first pass   one forward of the draft model over the tokens the target
               computed this step whose KV is valid (its chunk, or its last
               token + the accepted drafts) and the token just sampled; greedy
               argmax at that last token = draft 1. This also fills the draft
               model's KV for every position the target computed, so that its
               cache keeps up with the target's.
  K - 1 loops  one token per request: draft j at its position -> draft j + 1.

    target step   [t, d1, d2, d3] verified: d1 accepted, d2 rejected -> outputs [d1, x]
    first pass    [t, d1, x]          positions p .. p+2   -> draft 1 (after x)
    loop          [draft 1] at p+3    -> draft 2;   [draft 2] at p+4 -> draft 3

The draft model has its own KV cache (one tensor per layer of its own), laid
out in the target's blocks: block b of the target's table is block b of the
draft's, so the scheduler's block table and slot mapping serve both (vLLM:
the draft layers join the target's KV-cache group). Every block therefore
costs the draft's bytes too (GPUModelRunner.get_kv_cache_bytes_per_block),
and the draft's writes past the verified tokens land in slots the scheduler
reserved ahead (num_lookahead_tokens = K in allocate_slots). A prefix-cache hit
gives both models their KV: whatever the target computed, the draft computed
in the same slots in the same step.

NOTE: vLLM keeps the rejected drafts in the first pass as padding (slot -1,
"padded drafter batch") so that nothing waits for the host; here the
accepted count is already on the host (the step's sync point was passed),
and the first pass simply leaves the rejected positions out. The drafts are
greedy (vLLM's default draft_sample_method "greedy"): the rejection sampler
treats them as certain (draft_probs None), which keeps sampling exact.
Runs eager (no CUDA graphs), on the target's attention backend.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_anatomy.attention.backends.abstract import PAD_SLOT_ID, AttentionMetadata
from vllm_anatomy.config import VllmConfig
from vllm_anatomy.model_executor.loader import get_model

if TYPE_CHECKING:
    from vllm_anatomy.model_executor.models.llama import LlamaForCausalLM
    from vllm_anatomy.worker.gpu_input_batch import InputBatch


class DraftModelProposer:

    def __init__(self, vllm_config: VllmConfig, device: torch.device, attn_backend: str) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.draft_model_config = spec.draft_model_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.block_size = vllm_config.cache_config.block_size
        self.device = device
        self.attn_backend = attn_backend
        self.model: LlamaForCausalLM
        self.kv_caches: list[torch.Tensor] = []

    def load_model(self, *args, **kwargs) -> None:
        self.model = get_model(self.draft_model_config, backend=self.attn_backend).to(self.device)

    def get_kv_cache_bytes_per_block(self) -> int:
        model = self.model
        shape = model.attn_backend.get_kv_cache_shape(1, self.block_size, model.num_kv_heads, model.head_dim)
        return math.prod(shape) * next(model.parameters()).element_size() * model.num_layers

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One tensor per draft layer, in the same blocks as the target's."""
        model = self.model
        shape = model.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, model.num_kv_heads,
                                                      model.head_dim)
        dtype = next(model.parameters()).dtype
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(model.num_layers)]

    @torch.inference_mode()
    def propose(self, sampled_token_ids: list[list[int]], num_scheduled_tokens: np.ndarray,
                num_draft_tokens: np.ndarray, input_batch: InputBatch) -> list[list[int]]:
        """Drafts per batch row, after the step's bookkeeping (token_ids_cpu and
        num_tokens_no_spec hold the accepted tokens; num_computed_tokens_cpu still
        says where the step's tokens started). [] for rows that sampled nothing."""
        num_reqs = len(sampled_token_ids)
        starts = input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)              # [R]
        num_sampled = np.array([len(t) for t in sampled_token_ids], dtype=np.int64)            # [R]
        # The positions with valid target KV (drafts rejected: left out), plus
        # the sampled token; a partial prefill chunk has no sampled token.
        ends = starts + num_scheduled_tokens[:num_reqs] - num_draft_tokens[:num_reqs] + num_sampled   # [R]
        proposing = np.flatnonzero((num_sampled > 0) & (ends < self.max_model_len))
        draft_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        rows = np.arange(num_reqs)
        drafts = self._first_pass(input_batch, rows, starts, ends, proposing)                   # [P]
        if drafts is None:
            return draft_token_ids
        proposed = [drafts]
        positions = ends[proposing]                                  # where draft 1 goes
        for _ in range(self.num_speculative_tokens - 1):
            drafts = self._decode_step(input_batch, proposing, positions, drafts)
            positions = positions + 1
            proposed.append(drafts)
        # [P, K] -> per row, cut at max_model_len (a draft's position must exist).
        table = torch.stack(proposed, dim=1).tolist()
        for row, ids, end in zip(proposing.tolist(), table, ends[proposing].tolist()):
            draft_token_ids[row] = ids[:self.max_model_len - end]
        return draft_token_ids

    def _first_pass(self, input_batch: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                    proposing: np.ndarray) -> torch.Tensor | None:
        """The draft model over each row's [start, end) tokens: its KV written, and
        draft 1 of the proposing rows (argmax at their last token) [P]; None if none propose."""
        query_lens = ends - starts                                                             # [R]
        keep = query_lens > 0
        rows, starts, ends, query_lens = rows[keep], starts[keep], ends[keep], query_lens[keep]
        if not len(rows):
            return None
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])          # [T]
        req_rows = np.repeat(rows, query_lens)                                                 # [T]
        token_ids = input_batch.token_ids_cpu[req_rows, positions]                             # [T]
        hidden = self._forward(input_batch, rows, token_ids, positions, query_lens, ends)      # [T, H]
        if not len(proposing):
            return None
        last = np.cumsum(query_lens) - 1                                                       # [R'] last token
        row_to_last = dict(zip(rows.tolist(), last.tolist()))
        sample_at = torch.tensor([row_to_last[r] for r in proposing.tolist()], device=self.device)
        return self.model.compute_logits(hidden[sample_at]).argmax(dim=-1)                     # [P]

    def _decode_step(self, input_batch: InputBatch, rows: np.ndarray, positions: np.ndarray,
                     token_ids: torch.Tensor) -> torch.Tensor:
        """One token per proposing row at `positions` -> the next draft [P]. A position
        at max_model_len or past it is clamped and writes nothing (its draft is cut)."""
        clamped = np.minimum(positions, self.max_model_len - 1)
        hidden = self._forward(input_batch, rows, token_ids, clamped, np.ones(len(rows), dtype=np.int64),
                               clamped + 1, no_write=positions >= self.max_model_len)
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def _forward(self, input_batch: InputBatch, rows: np.ndarray, token_ids, positions: np.ndarray,
                 query_lens: np.ndarray, seq_lens: np.ndarray, no_write: np.ndarray | None = None) -> torch.Tensor:
        """The draft model on a flat batch of the given batch rows, over its own KV cache
        (block table and slots: the target's rows)."""
        block_table = input_batch.block_table
        req_rows = np.repeat(rows, query_lens)
        slots = (block_table.block_table_np[req_rows, positions // self.block_size].astype(np.int64)
                 * self.block_size + positions % self.block_size)                                # [T]
        if no_write is not None:
            slots[no_write] = PAD_SLOT_ID
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        qsl_cpu = torch.from_numpy(query_start_loc)
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        metadata = AttentionMetadata(
            num_actual_tokens=len(positions), num_reqs=len(rows), max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()), query_start_loc=qsl_cpu.to(self.device),
            seq_lens=seq_lens_cpu.to(self.device),
            block_table=block_table.block_table[torch.from_numpy(rows).to(self.device)],
            slot_mapping=torch.from_numpy(slots).to(self.device),
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu)
        input_ids = token_ids if isinstance(token_ids, torch.Tensor) else torch.from_numpy(token_ids.astype(np.int64))
        return self.model(input_ids.to(self.device, torch.int64), torch.from_numpy(positions).to(self.device),
                          self.kv_caches, metadata)
