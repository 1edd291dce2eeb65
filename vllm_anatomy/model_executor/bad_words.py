"""bad_words: forbid the token that would complete a banned word.

Mirrors vllm/v1/sample/ops/bad_words.py. A bad word is a token sequence
(SamplingParams.bad_words, tokenized by SamplingParams.update_from_tokenizer).
For a sequence [a, b, c], token c is forbidden (its logit set to -inf) in a
row whose output so far ends with [a, b]; a one-token word is always
forbidden. Only the output tokens count, not the prompt (as in vLLM).
"""
from __future__ import annotations

import torch

_SMALLEST_LOGIT = float("-inf")


def _apply_bad_words_single_batch(logits: torch.Tensor, bad_words_token_ids: list[list[int]],
                                  past_tokens_ids: list[int]) -> None:
    """logits [V] of one row, modified in place."""
    for bad_word_ids in bad_words_token_ids:
        if len(bad_word_ids) > len(past_tokens_ids) + 1:
            continue                     # the output is too short to end with the word's prefix
        prefix_length = len(bad_word_ids) - 1
        actual_prefix = past_tokens_ids[-prefix_length:] if prefix_length > 0 else []
        if actual_prefix == bad_word_ids[:prefix_length]:
            last_token_id = bad_word_ids[-1]
            # NOTE: written as a slice assignment, as vLLM does ("to avoid
            # cpu->gpu sync"): a fill kernel, no scalar sent to the device.
            logits[last_token_id:last_token_id + 1] = _SMALLEST_LOGIT


def apply_bad_words(logits: torch.Tensor, bad_words_token_ids: dict[int, list[list[int]]],
                    past_tokens_ids: list[list[int]]) -> None:
    """logits [R, V] in place; bad_words_token_ids: batch row -> that request's banned sequences;
    past_tokens_ids: each row's output tokens so far."""
    for i, bad_words_ids in bad_words_token_ids.items():
        _apply_bad_words_single_batch(logits[i], bad_words_ids, past_tokens_ids[i])


def apply_bad_words_with_drafts(logits: torch.Tensor, bad_words_token_ids: dict[int, list[list[int]]],
                                past_tokens_ids: list[list[int]], num_draft_tokens: list[int]) -> None:
    """Speculative decoding: logits [T, V] has one row per draft position (request
    after request, num_draft_tokens[i] rows for batch row i), in place.
    past_tokens_ids has one list per draft position too: the output so far
    followed by the drafts before that position (RejectionSampler's
    _combine_outputs_with_spec_tokens), so a draft that would complete a bad word
    with the drafts before it is forbidden like a sampled token would be."""
    start_idx = 0
    remaining = len(bad_words_token_ids)
    for i, n in enumerate(num_draft_tokens):
        bad_words_ids = bad_words_token_ids.get(i)
        if bad_words_ids is not None:
            for draft_idx in range(start_idx, start_idx + n):
                _apply_bad_words_single_batch(logits[draft_idx], bad_words_ids, past_tokens_ids[draft_idx])
            remaining -= 1
            if not remaining:
                break                    # no later row has bad words
        start_idx += n
