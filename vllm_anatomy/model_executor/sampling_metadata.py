"""SamplingMetadata: the batch's sampling parameters as tensors, one entry per row.

Mirrors vllm/v1/sample/metadata.py. Built by InputBatch.refresh_metadata() from
its persistent per-row arrays and read by the Sampler.

NOTE: a tensor is None when no row of the batch uses that feature ("all
default"), so the Sampler can skip the whole operation instead of running it
with neutral values (top_p = 1.0 everywhere still costs a full sort).

Simplified here: no custom logits processors or prompt logprobs. min_p,
min_tokens and logit_bias are fields (as in older vLLM), not logits processors.

NOTE: every token id held here was checked against the vocabulary when its
request joined the batch (InputBatch._check_request): the Sampler indexes
logits with them for the whole batch at once, so one bad id would fail every
request in it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    # [R] float32; 0.0 for greedy rows. None when every row is greedy.
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [R] float32 in (0, 1]; None when no row uses top-p (1.0 = off for a row).
    top_p: torch.Tensor | None
    # [R] int32; vocab_size for rows without top-k. None when no row uses it.
    top_k: torch.Tensor | None
    # [R] float32 in [0, 1]; None when no row uses min-p (0.0 = off for a row).
    min_p: torch.Tensor | None
    # batch row -> that request's own torch.Generator (requests with a seed).
    generators: dict[int, torch.Generator]
    # Largest `logprobs` asked for in the batch; None when nobody asked.
    max_num_logprobs: int | None
    # row -> stop token ids (EOS, stop_token_ids) it may not sample yet because
    # it has fewer than min_tokens outputs. Empty for most batches.
    min_tokens: dict[int, list[int]] = field(default_factory=dict)
    # (rows [B], token ids [B], biases [B]) for every biased (row, token) of
    # the batch; None when no request asked for logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # Penalties (model_executor/penalties.py). no_penalties: no row uses any,
    # and then the tensors below are None and output_token_ids may be empty.
    no_penalties: bool = True
    # [R, longest prompt] int64, padded with vocab_size; None unless a row has penalties.
    prompt_token_ids: torch.Tensor | None = None
    # [R] float32 each (0.0, 0.0, 1.0 = off for a row).
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # Each row's output tokens so far (the InputBatch's lists, shared, not
    # copied); only filled when penalties or bad words need them, else [].
    output_token_ids: list[list[int]] = field(default_factory=list)
    # [R, V] bool, True = token NOT allowed for that row; None when no row uses allowed_token_ids.
    allowed_token_ids_mask: torch.Tensor | None = None
    # batch row -> that request's banned token sequences (model_executor/bad_words.py).
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    # Speculative decoding: each row's draft tokens this step ([] for a row without
    # any); None in a step without drafts. The RejectionSampler reads them to
    # penalize each draft position as if the drafts before it had been sampled.
    spec_token_ids: list[list[int]] | None = None
