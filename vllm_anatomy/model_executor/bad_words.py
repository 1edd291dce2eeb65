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
    """Speculative decoding (vLLM: the same name): logits [T, V], one row per draft
    position, batch row after batch row (num_draft_tokens[i] rows for row i), in place.

    past_tokens_ids has one list per draft position: the output so far, then the
    drafts before that position (RejectionSampler._combine_outputs_with_spec_tokens).
    So with output [.., a] and drafts [b, c], the word [a, b, c] forbids c at
    position 1 (past [.., a, b]), exactly as it would after sampling a, b one by one."""
    first_position = 0
    for row, n in enumerate(num_draft_tokens):
        words = bad_words_token_ids.get(row)
        if words:
            for position in range(first_position, first_position + n):
                _apply_bad_words_single_batch(logits[position], words, past_tokens_ids[position])
        first_position += n
