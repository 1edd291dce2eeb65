"""NgramProposer: the drafts vLLM's prompt-lookup search would propose.

The reference is a transcription of v0.27.1's numba loop
(_find_longest_matched_ngram_and_propose_tokens: KMP over the reversed context,
the longest match capped at max_ngram, the earliest occurrence among the longest);
ours compares windows with numpy. They must agree on every context, including
overlapping matches, ties, caps at max_model_len and contexts shorter than the n-gram.
"""
from __future__ import annotations

import numpy as np
import pytest

from vllm_anatomy.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm_anatomy.spec_decode.ngram_proposer import NgramProposer, _find_longest_matched_ngram_and_propose_tokens


def vllm_kmp(origin_tokens: np.ndarray, min_ngram: int, max_ngram: int, max_model_len: int, k: int) -> list[int]:
    """v0.27.1's algorithm, line by line (vllm/v1/spec_decode/ngram_proposer.py), without numba."""
    total_token = origin_tokens.shape[0]
    if total_token < min_ngram:
        return []
    k = min(k, max_model_len - total_token)
    if k <= 0:
        return []
    tokens = origin_tokens[::-1]
    lps = np.zeros(max_ngram, dtype=np.int32)
    longest_ngram = position = prev_lps = 0
    i = 1
    while i < total_token:
        if tokens[prev_lps] == tokens[i]:
            prev_lps += 1
            if prev_lps >= longest_ngram:
                longest_ngram, position = prev_lps, i
            if i < max_ngram:
                lps[i] = prev_lps
            if prev_lps == max_ngram:
                prev_lps = lps[max_ngram - 1]
            i += 1
        elif prev_lps != 0:
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest_ngram < min_ngram:
        return []
    start_position = total_token - 1 - position + longest_ngram
    k = min(k, total_token - start_position)
    return origin_tokens[start_position:start_position + k].tolist()


CASES = [
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 3, [4, 1, 2]),          # "1 2 3" occurred at 0: what followed
    ([5, 6, 7, 5, 6, 7, 5, 6], 2, 2, 4, [7, 5, 6, 7]),    # the earliest occurrence of "5 6"
    ([1, 2, 3], 1, 5, 3, []),                               # the suffix occurs nowhere earlier
    ([9, 9, 9, 9], 1, 3, 2, [9]),                           # overlapping: "9 9 9" at 0, one token after it
    ([4], 1, 1, 3, []),                                     # shorter than any earlier window
]


@pytest.mark.parametrize("tokens,lo,hi,k,expected", CASES)
def test_examples(tokens, lo, hi, k, expected):
    arr = np.array(tokens, dtype=np.int32)
    assert _find_longest_matched_ngram_and_propose_tokens(arr, lo, hi, 1024, k).tolist() == expected
    assert vllm_kmp(arr, lo, hi, 1024, k) == expected


def test_drafts_stop_at_max_model_len():
    arr = np.array([1, 2, 3, 4, 1, 2], dtype=np.int32)
    assert _find_longest_matched_ngram_and_propose_tokens(arr, 1, 2, max_model_len=8, k=5).tolist() == [3, 4]
    assert _find_longest_matched_ngram_and_propose_tokens(arr, 1, 2, max_model_len=6, k=5).tolist() == []


def test_matches_vllm_on_random_contexts():
    rng = np.random.default_rng(0)
    for trial in range(3000):
        vocab = int(rng.integers(2, 6))           # small vocabularies: many (and overlapping) matches
        tokens = rng.integers(0, vocab, int(rng.integers(1, 40))).astype(np.int32)
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        max_len = len(tokens) + int(rng.integers(0, 4))
        ours = _find_longest_matched_ngram_and_propose_tokens(tokens, lo, hi, max_len, k).tolist()
        assert ours == vllm_kmp(tokens, lo, hi, max_len, k), (trial, tokens.tolist(), lo, hi, k, max_len)


def test_propose_skips_rows_that_sampled_nothing_or_are_full():
    config = VllmConfig(ModelConfig(model="fake", max_model_len=8), CacheConfig(), SchedulerConfig(max_model_len=8),
                        speculative_config=SpeculativeConfig(num_speculative_tokens=2, method="ngram",
                                                             prompt_lookup_min=1, prompt_lookup_max=2))
    proposer = NgramProposer(config)
    token_ids = np.zeros((3, 8), dtype=np.int32)
    token_ids[0, :5] = [1, 2, 3, 1, 2]
    token_ids[1, :5] = [1, 2, 3, 1, 2]
    token_ids[2, :8] = [1, 2, 1, 2, 1, 2, 1, 2]
    drafts = proposer.propose(2, [[2], [], [2]], np.array([5, 5, 8]), token_ids)
    assert drafts == [[3, 1], [], []]      # row 1: a partial prefill chunk; row 2: at max_model_len


def test_speculative_config_defaults_and_errors():
    c = SpeculativeConfig(num_speculative_tokens=3, model="ngram")
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 5)
    assert SpeculativeConfig(num_speculative_tokens=3, method="ngram", prompt_lookup_max=4).prompt_lookup_min == 4
    assert SpeculativeConfig(num_speculative_tokens=1, model="/some/dir").method == "draft_model"
    with pytest.raises(ValueError, match="prompt_lookup_min=4 must be <= prompt_lookup_max=2"):
        SpeculativeConfig(num_speculative_tokens=3, method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="greater than zero"):
        SpeculativeConfig(num_speculative_tokens=0, method="ngram")
    with pytest.raises(ValueError, match="without speculative model"):
        SpeculativeConfig(num_speculative_tokens=2, method="draft_model")
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig(num_speculative_tokens=2, method="eagle", model="x")


def test_batch_propose_equals_one_row_at_a_time():
    rng = np.random.default_rng(3)
    for trial in range(200):
        lo = int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 5))
        max_len = 48
        config = VllmConfig(ModelConfig(model="fake", max_model_len=max_len), CacheConfig(),
                            SchedulerConfig(max_model_len=max_len),
                            speculative_config=SpeculativeConfig(num_speculative_tokens=k, method="ngram",
                                                                 prompt_lookup_min=lo, prompt_lookup_max=hi))
        proposer = NgramProposer(config)
        rows = int(rng.integers(1, 9))
        token_ids = rng.integers(0, int(rng.integers(2, 6)), (rows, max_len)).astype(np.int32)
        num_tokens = rng.integers(1, max_len + 1, rows)
        sampled = [[1] if rng.random() < 0.8 else [] for _ in range(rows)]
        got = proposer.propose(k, sampled, num_tokens, token_ids)
        want = [_find_longest_matched_ngram_and_propose_tokens(token_ids[i, :num_tokens[i]], lo, hi, max_len, k).tolist()
                if sampled[i] and num_tokens[i] < max_len else [] for i in range(rows)]
        assert got == want, (trial, got, want)

