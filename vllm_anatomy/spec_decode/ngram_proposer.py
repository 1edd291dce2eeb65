"""NgramProposer: draft tokens from the request's own text (prompt lookup decoding).

Mirrors vllm/v1/spec_decode/ngram_proposer.py. After a step's tokens are
sampled, each request's context (prompt + outputs, `token_ids_cpu`) is
searched for an earlier occurrence of its last n tokens, for the longest n in
[prompt_lookup_min, prompt_lookup_max]; the k tokens that followed that
occurrence become the drafts:

    context  ... the cat sat on the mat . the cat sat [on]        suffix "the cat sat" (n = 3)
    match    ... [the cat sat] on the mat ...                      first occurrence
    drafts   on the mat                                            (k = 3)

Nothing runs on the device: it is a CPU search, run after the step's tokens
are on the host. It costs no forward pass, and pays off where outputs repeat
their input (code edits, extraction, summaries that quote).

Which occurrence: the longest match wins (capped at prompt_lookup_max), and
among matches of that length the *earliest* in the context, as vLLM's KMP
search picks it (_find_longest_matched_ngram_and_propose_tokens). vLLM runs
that search compiled with numba; here numpy compares the suffix against every
earlier window at once, n by n (the same answer: tests/unit/test_ngram_proposer.py
checks it against a transcription of vLLM's KMP loop), and batch_propose does the
same for all rows at once.
"""
from __future__ import annotations

import numpy as np

from vllm_anatomy.config import VllmConfig


class NgramProposer:

    def __init__(self, vllm_config: VllmConfig) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None and spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        # Minimum and maximum length of the n-gram to match.
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max
        # Tokens proposed after a match (fewer if the context ends sooner).
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len

    def propose(self, num_speculative_tokens: int, sampled_token_ids: list[list[int]],
                num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray) -> list[list[int]]:
        """Drafts per batch row ([] for a row that sampled nothing: a partial prefill chunk).

        num_tokens_no_spec [R]: each row's known tokens; token_ids_cpu [R, max_model_len]."""
        assert num_speculative_tokens <= self.k
        # NOTE: no drafts for a row that sampled nothing, or that reached max_model_len.
        valid_ngram_requests = [i for i, sampled_ids in enumerate(sampled_token_ids)
                                if sampled_ids and num_tokens_no_spec[i] < self.max_model_len]
        return self.batch_propose(len(sampled_token_ids), valid_ngram_requests, num_tokens_no_spec, token_ids_cpu,
                                  num_speculative_tokens)

    def batch_propose(self, num_requests: int, valid_ngram_requests: list[int], num_tokens_no_spec: np.ndarray,
                      token_ids_cpu: np.ndarray, k: int) -> list[list[int]]:
        """The search for every valid row at once (vLLM: numba, a thread per row).

        NOTE: the same answer as _find_longest_matched_ngram_and_propose_tokens
        row by row, in a fixed number of numpy operations per step rather than
        per row: at batch 64 the per-row loop cost milliseconds a step, more
        than a GPU decode step. Candidates are the positions holding the
        context's last token; each round keeps those whose next token to the
        left also matches the suffix, up to max_n."""
        drafts: list[list[int]] = [[] for _ in range(num_requests)]
        rows = np.asarray(valid_ngram_requests, dtype=np.int64)
        if not len(rows):
            return drafts
        num_tokens = num_tokens_no_spec[rows].astype(np.int64)                            # [P]
        width = int(num_tokens.max())
        ctx = token_ids_cpu[rows, :width]                                                  # [P, W]
        last = ctx[np.arange(len(rows)), num_tokens - 1]                                   # [P]
        # n = 1: every earlier position holding the last token (an occurrence ends at e < N - 1).
        cand_row, cand_end = np.nonzero(ctx[:, :width - 1] == last[:, None])               # [C], [C]
        keep = cand_end < num_tokens[cand_row] - 1
        cand_row, cand_end = cand_row[keep], cand_end[keep]
        length = np.ones(len(cand_row), dtype=np.int64)                                    # matched n so far
        alive = np.ones(len(cand_row), dtype=bool)
        for j in range(1, self.max_n):
            left = cand_end - j
            ok = alive & (left >= 0)
            r = cand_row[ok]
            ok[ok] = ctx[r, left[ok]] == ctx[r, num_tokens[r] - 1 - j]
            length += ok
            alive = ok
        # Per row: the longest match, then the earliest occurrence of it.
        order = np.lexsort((cand_end, -length, cand_row))
        first_of_row = np.unique(cand_row[order], return_index=True)[1]
        best = order[first_of_row]
        for r, n, end in zip(cand_row[best].tolist(), length[best].tolist(), cand_end[best].tolist()):
            total = int(num_tokens[r])
            count = min(k, self.max_model_len - total, total - (end + 1))
            if n >= self.min_n and count > 0:
                drafts[int(rows[r])] = ctx[r, end + 1:end + 1 + count].tolist()
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        pass    # no model


def _find_longest_matched_ngram_and_propose_tokens(origin_tokens: np.ndarray, min_ngram: int, max_ngram: int,
                                                   max_model_len: int, k: int) -> np.ndarray:
    """The k tokens after the earliest occurrence of the context's longest suffix n-gram
    (min_ngram <= n <= max_ngram); empty if none occurs earlier."""
    total_token = origin_tokens.shape[0]
    # No drafts past max_model_len, nor from a context shorter than the n-gram.
    k = min(k, max_model_len - total_token)
    if total_token < min_ngram or k <= 0:
        return origin_tokens[:0]
    # NOTE: an occurrence ends at `end` < total_token - 1 (not the suffix itself).
    # matched[end] stays True while tokens[end - j] == tokens[total - 1 - j] for
    # every j so far: after j = n - 1 it says "the n-gram ending at `end` equals the suffix".
    ends = np.arange(total_token - 1)                                       # [total - 1] candidate ends
    matched = np.ones(total_token - 1, dtype=bool)
    longest, position = 0, -1
    for n in range(1, min(max_ngram, total_token - 1) + 1):
        j = n - 1
        valid = ends >= j
        matched &= valid
        matched[valid] &= origin_tokens[ends[valid] - j] == origin_tokens[total_token - 1 - j]
        hits = np.flatnonzero(matched)
        if len(hits) == 0:
            break           # no longer n-gram can match where this one did not
        longest, position = n, int(hits[0])     # the earliest occurrence of the longest match
    if longest < min_ngram:
        return origin_tokens[:0]
    start = position + 1
    return origin_tokens[start:start + min(k, total_token - start)]
