"""The rejection sampler's three loops as Triton kernels (vLLM's, vllm/v1/sample/rejection_sampler.py).

The reference is the torch code of the same names in
vllm_anatomy/model_executor/rejection_sampler.py (what a CPU runs); each
launcher here takes the same arguments and fills the same outputs, so
RejectionSampler switches between them by module (tests/kernel_tests/
test_rejection_sampler_kernels.py: the same tokens from the same random numbers).

    rejection_greedy_sample   grid (B,): one program per request; greedy rows only
    rejection_random_sample   grid (B,): one program per request; random rows only
    sample_recovered_tokens   grid (B, max_spec_len): one program per draft position,
                              a loop over the vocabulary in BLOCK_SIZE tiles

Memory layout (T = drafts in the batch, B = requests, V = vocabulary, W = max_spec_len + 1):
    output_token_ids   [B, W]  int32, -1 prefilled; a program writes its row's outputs
    cu_num_draft_tokens[B]     int32 cumulative drafts: request b owns [cu[b-1], cu[b])
    draft_token_ids    [T]     int32
    target_argmax      [T]     int64       target_probs [T, V] fp32   draft_probs [T, V] fp32 or None
    bonus_token_ids    [B]     int64       uniform_probs [T] fp64    inv_q [B, V] fp32
    is_greedy          [B]     bool, or None (every row greedy)
    recovered          [T]     NEW int32

NOTE: the loops over a request's drafts have a data-dependent trip count (its
number of drafts) and stop writing after the first rejection: a scalar
`rejected` flag carried through the loop, as in vLLM. max_spec_len is not
specialized (do_not_specialize, see launch.py): one compiled variant whatever K.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.launch import check_launchable

# Vocabulary tile of sample_recovered_tokens_kernel (vLLM's value).
BLOCK_SIZE = 8192


@triton.jit
def _request_drafts(cu_num_draft_tokens_ptr, req_idx):
    """(first index, number) of request req_idx's drafts in the flat draft lists."""
    start_idx = (tl.zeros([], dtype=cu_num_draft_tokens_ptr.dtype.element_ty) if req_idx == 0
                 else tl.load(cu_num_draft_tokens_ptr + req_idx - 1))
    return start_idx, tl.load(cu_num_draft_tokens_ptr + req_idx) - start_idx


@triton.jit(do_not_specialize=["max_spec_len"])
def rejection_greedy_sample_kernel(
    output_token_ids_ptr,       # [B, max_spec_len + 1]
    cu_num_draft_tokens_ptr,    # [B]
    draft_token_ids_ptr,        # [T]
    target_argmax_ptr,          # [T]
    bonus_token_ids_ptr,        # [B]
    is_greedy_ptr,              # [B] or None
    max_spec_len,
):
    req_idx = tl.program_id(0)
    is_greedy = True if is_greedy_ptr is None else tl.load(is_greedy_ptr + req_idx)
    if not is_greedy:
        return      # a random row: rejection_random_sample_kernel's
    start_idx, num_draft_tokens = _request_drafts(cu_num_draft_tokens_ptr, req_idx)

    # Walk the drafts while they equal the target's argmax. The target's own token
    # is written at every position walked: the draft when they agree, the
    # recovered token at the first position where they do not.
    rejected = False
    for pos in range(num_draft_tokens):
        if not rejected:
            target_argmax_id = tl.load(target_argmax_ptr + start_idx + pos).to(tl.int32)
            tl.store(output_token_ids_ptr + req_idx * (max_spec_len + 1) + pos, target_argmax_id)
            rejected = tl.load(draft_token_ids_ptr + start_idx + pos) != target_argmax_id
    if not rejected:
        bonus_token_id = tl.load(bonus_token_ids_ptr + req_idx)
        tl.store(output_token_ids_ptr + req_idx * (max_spec_len + 1) + num_draft_tokens, bonus_token_id)


@triton.jit(do_not_specialize=["max_spec_len"])
def rejection_random_sample_kernel(
    output_token_ids_ptr,       # [B, max_spec_len + 1]
    cu_num_draft_tokens_ptr,    # [B]
    draft_token_ids_ptr,        # [T]
    draft_probs_ptr,            # [T, V] or None
    target_probs_ptr,           # [T, V]
    bonus_token_ids_ptr,        # [B]
    recovered_token_ids_ptr,    # [T]
    uniform_probs_ptr,          # [T]
    is_greedy_ptr,              # [B]
    max_spec_len,
    vocab_size,
    NO_DRAFT_PROBS: tl.constexpr,
):
    req_idx = tl.program_id(0)
    is_greedy = tl.load(is_greedy_ptr + req_idx)
    if is_greedy:
        return      # a greedy row: rejection_greedy_sample_kernel's
    start_idx, num_draft_tokens = _request_drafts(cu_num_draft_tokens_ptr, req_idx)

    rejected = False
    for pos in range(num_draft_tokens):
        if not rejected:
            draft_token_id = tl.load(draft_token_ids_ptr + start_idx + pos)
            uniform_prob = tl.load(uniform_probs_ptr + start_idx + pos)
            if draft_token_id < 0:
                accepted = False        # -1: a padded draft
            else:
                if NO_DRAFT_PROBS:
                    draft_prob = 1
                else:
                    draft_prob = tl.load(draft_probs_ptr + (start_idx + pos) * vocab_size + draft_token_id)
                target_prob = tl.load(target_probs_ptr + (start_idx + pos) * vocab_size + draft_token_id)
                # NOTE: a draft probability of 0 should not happen; reject rather than divide by it.
                accepted = draft_prob > 0 and target_prob / draft_prob >= uniform_prob
            if accepted:
                token_id = draft_token_id
            else:
                rejected = True
                token_id = tl.load(recovered_token_ids_ptr + start_idx + pos)
            tl.store(output_token_ids_ptr + req_idx * (max_spec_len + 1) + pos, token_id)
    if not rejected:
        bonus_token_id = tl.load(bonus_token_ids_ptr + req_idx)
        tl.store(output_token_ids_ptr + req_idx * (max_spec_len + 1) + num_draft_tokens, bonus_token_id)


@triton.jit
def sample_recovered_tokens_kernel(
    output_token_ids_ptr,       # [T]
    cu_num_draft_tokens_ptr,    # [B]
    draft_token_ids_ptr,        # [T]
    draft_probs_ptr,            # [T, V] or None
    target_probs_ptr,           # [T, V]
    inv_q_ptr,                  # [B, V]
    vocab_size,
    BLOCK_SIZE: tl.constexpr,
    NO_DRAFT_PROBS: tl.constexpr,
):
    req_idx = tl.program_id(0)
    start_idx, num_draft_tokens = _request_drafts(cu_num_draft_tokens_ptr, req_idx)
    pos = tl.program_id(1)
    if pos >= num_draft_tokens:
        return      # this request has fewer drafts than the grid's max_spec_len
    token_idx = start_idx + pos
    draft_token_id = tl.load(draft_token_ids_ptr + token_idx)

    max_val = tl.full((), float("-inf"), tl.float32)
    recovered_id = 0
    for v in range(0, vocab_size, BLOCK_SIZE):
        vocab_offset = v + tl.arange(0, BLOCK_SIZE)
        vocab_mask = vocab_offset < vocab_size
        if NO_DRAFT_PROBS:
            # q is one-hot at the draft: p without the draft token.
            prob = tl.load(target_probs_ptr + token_idx * vocab_size + vocab_offset,
                           mask=vocab_mask & (vocab_offset != draft_token_id), other=0.0)
        else:
            draft_prob = tl.load(draft_probs_ptr + token_idx * vocab_size + vocab_offset, mask=vocab_mask,
                                 other=0.0)
            target_prob = tl.load(target_probs_ptr + token_idx * vocab_size + vocab_offset, mask=vocab_mask,
                                  other=0.0)
            prob = tl.maximum(target_prob - draft_prob, 0.0)     # (no need to normalize for an argmax)
        inv_q = tl.load(inv_q_ptr + req_idx * vocab_size + vocab_offset, mask=vocab_mask, other=0.0)
        # Past the vocabulary: -inf, so the tail of the last tile can never win.
        score = tl.where(vocab_mask, prob * inv_q, float("-inf"))
        local_max, local_id = tl.max(score, axis=0, return_indices=True)
        if local_max > max_val:         # strict: ties go to the earlier tile, as torch.argmax
            max_val = local_max
            recovered_id = v + local_id
    recovered_id = tl.minimum(recovered_id, vocab_size - 1)
    tl.store(output_token_ids_ptr + token_idx, recovered_id)


# -- launchers: the torch reference's signatures ----------------------------------------------------
def rejection_greedy_sample(output_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                            draft_token_ids: torch.Tensor, target_argmax: torch.Tensor,
                            bonus_token_ids: torch.Tensor, is_greedy: torch.Tensor | None,
                            max_spec_len: int) -> None:
    check_launchable(output_token_ids, rejection_greedy_sample_kernel)
    rejection_greedy_sample_kernel[(output_token_ids.shape[0],)](
        output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids, is_greedy,
        max_spec_len)


def rejection_random_sample(output_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                            draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                            target_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                            recovered_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                            is_greedy: torch.Tensor, max_spec_len: int) -> None:
    check_launchable(output_token_ids, rejection_random_sample_kernel)
    assert target_probs.is_contiguous() and (draft_probs is None or draft_probs.is_contiguous())
    rejection_random_sample_kernel[(output_token_ids.shape[0],)](
        output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, bonus_token_ids,
        recovered_token_ids, uniform_probs, is_greedy, max_spec_len, target_probs.shape[-1],
        NO_DRAFT_PROBS=draft_probs is None)


def sample_recovered_tokens(cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                            draft_probs: torch.Tensor | None, target_probs: torch.Tensor, inv_q: torch.Tensor,
                            max_spec_len: int) -> torch.Tensor:
    check_launchable(target_probs, sample_recovered_tokens_kernel)
    assert target_probs.is_contiguous() and inv_q.is_contiguous()
    recovered_token_ids = torch.empty_like(draft_token_ids)
    sample_recovered_tokens_kernel[(cu_num_draft_tokens.shape[0], max_spec_len)](
        recovered_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, inv_q,
        target_probs.shape[-1], BLOCK_SIZE=BLOCK_SIZE, NO_DRAFT_PROBS=draft_probs is None)
    return recovered_token_ids
