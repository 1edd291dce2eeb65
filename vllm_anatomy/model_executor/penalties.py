"""Presence, frequency and repetition penalties: logits [R, V] -> penalized logits.

Mirrors vllm/v1/sample/ops/penalties.py (apply_all_penalties) with what it
calls: get_token_bin_counts_and_mask and apply_penalties from
vllm/model_executor/layers/utils.py, and the torch version of the
repetition-penalty op (vllm/_custom_ops.py, apply_repetition_penalties_torch;
vLLM runs a CUDA kernel of the same formula on a GPU).

For one row, with c[t] = how often token t appears in the row's *output* so
far and seen[t] = t appears in its *prompt or output*:

    repetition  (CTRL, transformers' RepetitionPenaltyLogitsProcessor):
                logit[t] = logit[t] / r   if seen[t] and logit[t] > 0
                logit[t] = logit[t] * r   if seen[t] and logit[t] <= 0
    frequency   (OpenAI):  logit[t] -= frequency_penalty * c[t]
    presence    (OpenAI):  logit[t] -= presence_penalty * (c[t] > 0)

in that order. r > 1 makes seen tokens less likely (a positive logit shrinks,
a negative one grows more negative); presence/frequency > 0 do the same for
output tokens only. A row whose penalties are 1.0 / 0.0 / 0.0 is unchanged.

Memory layout:
    logits               [R, V]  float32, modified in place and returned
    prompt_token_ids     [R, P]  int64, each row's prompt padded with V (P = longest prompt)
    output_token_ids     R lists of ints (the InputBatch's per-request lists; -1 = a
                                 placeholder under async scheduling, treated as padding)
    *_penalties          [R]     float32
The counts are [R, V + 1] (column V collects the padding) and cut to [R, V].
"""
from __future__ import annotations

import torch


def apply_all_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor,
                        presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor,
                        repetition_penalties: torch.Tensor, output_token_ids: list[list[int]]) -> torch.Tensor:
    """Penalize logits [R, V] in place with each row's prompt and output tokens; returns logits."""
    _, vocab_size = logits.shape
    output_tokens_t = _convert_to_tensors(output_token_ids, vocab_size, logits.device)    # [R, O]
    # NOTE: a -1 placeholder (async scheduling: a token not yet copied back)
    # must not index the counts; it becomes padding. The runner fills the
    # placeholders of rows that need them before sampling (vLLM does the same).
    output_tokens_t.masked_fill_(output_tokens_t == -1, vocab_size)
    return apply_penalties(logits, prompt_token_ids, output_tokens_t, presence_penalties,
                           frequency_penalties, repetition_penalties)


def _convert_to_tensors(output_token_ids: list[list[int]], vocab_size: int,
                        device: torch.device) -> torch.Tensor:
    """R lists of ids -> [R, longest] int64, padded with vocab_size (no token has that id)."""
    width = max((len(ids) for ids in output_token_ids), default=0)
    out = torch.full((len(output_token_ids), width), vocab_size, dtype=torch.int64)
    for i, ids in enumerate(output_token_ids):
        if ids:
            out[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out.to(device, non_blocking=True)


def get_token_bin_counts_and_mask(tokens: torch.Tensor, vocab_size: int,
                                  num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [R, L] (padded with vocab_size) -> counts [R, V] int64 and counts > 0."""
    bin_counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.long, device=tokens.device)
    bin_counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    bin_counts = bin_counts[:, :vocab_size]                   # drop the padding column
    return bin_counts, bin_counts > 0


def apply_penalties(logits: torch.Tensor, prompt_tokens_tensor: torch.Tensor,
                    output_tokens_tensor: torch.Tensor, presence_penalties: torch.Tensor,
                    frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor) -> torch.Tensor:
    """The three penalties on logits [R, V], in place (formulas at the top of this file)."""
    num_seqs, vocab_size = logits.shape
    _, prompt_mask = get_token_bin_counts_and_mask(prompt_tokens_tensor, vocab_size, num_seqs)
    output_bin_counts, output_mask = get_token_bin_counts_and_mask(output_tokens_tensor, vocab_size, num_seqs)
    apply_repetition_penalties(logits, prompt_mask, output_mask, repetition_penalties)
    # OpenAI's definition: https://platform.openai.com/docs/api-reference/parameter-details
    logits -= frequency_penalties.unsqueeze(dim=1) * output_bin_counts
    logits -= presence_penalties.unsqueeze(dim=1) * output_mask
    return logits


def apply_repetition_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_mask: torch.Tensor,
                               repetition_penalties: torch.Tensor) -> None:
    """Divide the positive logits of seen tokens by r, multiply the others by r (in place)."""
    penalties = torch.where(prompt_mask | output_mask, repetition_penalties.unsqueeze(dim=1), 1.0)   # [R, V]
    logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
