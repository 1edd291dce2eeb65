"""SpecDecodeMetadata: where a step's draft tokens sit in the flat batch and in the logits.

Mirrors vllm/v1/spec_decode/metadata.py. GPUModelRunner builds it in
_prepare_inputs when the scheduler sent draft tokens
(SchedulerOutput.scheduled_spec_decode_tokens); the RejectionSampler reads it.

A request with k drafts is scheduled 1 + k tokens: its last verified token
and the k drafts. The forward computes logits at all 1 + k positions (one
forward for every draft position): row j (j < k) is the target's distribution
for draft j+1 ("target logits"), the last row the one after the last draft
(the "bonus" token, kept only if every draft is accepted). A request without
drafts has one logits row, its bonus row. Example (vLLM's):

    num_scheduled_tokens     [  4, 100,   3, 100,   2]    (a prefill of 100 has no drafts)
    num_draft_tokens         [  3,   0,   2,   0,   1]
    cu_num_draft_tokens      [  3,   3,   5,   5,   6]
    logits_indices           [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    target_logits_indices    [0, 1, 2, 5, 6, 9]        rows of logits[logits_indices]
    bonus_logits_indices     [3, 4, 7, 8, 10]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SpecDecodeMetadata:
    # [num_tokens] the drafts, flattened request after request (num_tokens = all drafts of the batch)
    draft_token_ids: torch.Tensor
    # [batch_size]
    num_draft_tokens: list[int]
    # [batch_size] cumulative drafts, int32
    cu_num_draft_tokens: torch.Tensor
    # [batch_size] cumulative sampled positions (drafts + 1), int32
    cu_num_sampled_tokens: torch.Tensor
    # [num_tokens] rows of the logits that verify a draft
    target_logits_indices: torch.Tensor
    # [batch_size] rows of the logits for each request's bonus token
    bonus_logits_indices: torch.Tensor
    # [num_tokens + batch_size] flat token indices whose hidden states get logits
    logits_indices: torch.Tensor

    def __post_init__(self) -> None:
        self.max_spec_len = max(self.num_draft_tokens)

    @classmethod
    def make_dummy(cls, draft_token_ids: list[list[int]], device: torch.device | str) -> SpecDecodeMetadata:
        """Metadata for a batch that is only drafts and bonus rows (tests; vLLM: warm-up)."""
        num_draft_tokens = [len(ids) for ids in draft_token_ids]
        num_sampled_tokens = np.array(num_draft_tokens, dtype=np.int32) + 1
        flat = [t for ids in draft_token_ids for t in ids]
        cu_num_sampled = np.cumsum(num_sampled_tokens, dtype=np.int32)
        starts = cu_num_sampled - num_sampled_tokens
        target = np.concatenate([np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, num_draft_tokens)]
                                or [np.empty(0, np.int32)])
        return cls(
            draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
            num_draft_tokens=num_draft_tokens,
            cu_num_draft_tokens=torch.tensor(np.cumsum(num_draft_tokens, dtype=np.int32), device=device),
            cu_num_sampled_tokens=torch.tensor(cu_num_sampled, device=device),
            target_logits_indices=torch.tensor(target, dtype=torch.int32, device=device),
            bonus_logits_indices=torch.tensor(cu_num_sampled - 1, device=device),
            logits_indices=torch.arange(int(cu_num_sampled[-1]), dtype=torch.int32, device=device),
        )
