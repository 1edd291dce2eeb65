"""RejectionSampler: verify a step's draft tokens against the target model's logits.

Mirrors vllm/v1/sample/rejection_sampler.py, which follows the algorithm of
Leviathan et al., "Fast Inference from Transformers via Speculative Decoding"
(arXiv 2211.17192). Names as in vLLM:

    accepted tokens   drafts kept: position j survives if every earlier one did and
                      (random)  u_j <= p(d_j) / q(d_j),  u_j ~ U[0, 1)
                      (greedy)  d_j == argmax p
    recovered token   at the first rejected position: a sample from
                      norm(max(p - q, 0)) (greedy: argmax p), instead of the draft
    bonus token       if all k drafts are accepted: one more token, sampled by the
                      ordinary Sampler from the logits after the last draft
    output tokens     accepted + (recovered | bonus): 1 to k + 1 tokens per request

p is the target's distribution at a draft's position (temperature, top-k and
top-p applied, as the Sampler would), q the drafter's. vLLM's drafters here
are deterministic (ngram, and a draft model sampled greedily: vLLM's default
draft_sample_method "greedy"), so q is one-hot at the draft (draft_probs is
None): a draft is accepted with probability p(d), and the recovered token is
sampled from p with d removed. Either way the output token at every position
is distributed exactly as the target's own sample would be: speculation
changes how many forward passes it takes, never the distribution
(tests/unit/test_rejection_sampler.py checks this with a chi-square test).

Output: [batch_size, max_spec_len + 1] int32, PLACEHOLDER_TOKEN_ID (-1) after
each request's last output token; parse_output turns it into lists.

Two implementations of the three loops (greedy rows, random rows, recovered
tokens): the plain torch ones below, which run on a CPU and are the
reference, and vLLM's Triton kernels (vllm_anatomy/kernels/rejection_sampler.py),
which run on a GPU; tests/kernel_tests/test_rejection_sampler_kernels.py checks that
they give the same tokens from the same random numbers. The random numbers
(u, and the exponential noise of the recovered-token sample) are drawn by torch
outside either, per request and from its own generator when it is seeded.

The Sampler's logits processors apply at every draft position too
(apply_logits_processors, as v0.27.1): a position is penalized and masked as
if the drafts before it had already been sampled, since that is what the
target would have seen there without speculation.

    request: output so far [o1, o2], drafts [d1, d2, d3]
    target row 0 (verifies d1)   past tokens [o1, o2]
    target row 1 (verifies d2)   past tokens [o1, o2, d1]
    target row 2 (verifies d3)   past tokens [o1, o2, d1, d2]
    bonus row                    past tokens [o1, o2, d1, d2, d3]   (by the Sampler)

  penalties          presence / frequency / repetition over those past tokens
                     (and the prompt), the row's parameters repeated per position
                     (repeat_indices: [0, 0, 0, 1, 2, 2] for num_draft_tokens [3, 1, 2])
  allowed_token_ids  the row's mask, repeated per position
  bad_words          a draft that would complete a banned word after the drafts
                     before it is forbidden (apply_bad_words_with_drafts)
  min_tokens         stop tokens masked at the positions before min_tokens

So a greedy request with a repetition penalty gets, with speculation, exactly
the tokens it gets without (tests/integration/test_spec_decode.py checks it
against transformers).

Simplified: min_p and logit_bias are refused with speculative decoding, as in
v0.27.1; no synthetic or block rejection methods, logprobs mode "raw" only.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from vllm_anatomy.model_executor.bad_words import apply_bad_words_with_drafts
from vllm_anatomy.model_executor.penalties import apply_all_penalties
from vllm_anatomy.model_executor.sampler import LogprobsTensors, Sampler, SamplerOutput, apply_top_k_top_p
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata
from vllm_anatomy.spec_decode.metadata import SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1
GREEDY_TEMPERATURE = 0
# Maximum number of speculative draft tokens allowed per request in a single step.
MAX_SPEC_LEN = 128


class RejectionSampler(nn.Module):

    def __init__(self, sampler: Sampler, use_triton: bool | None = None) -> None:
        """use_triton: the Triton kernels (None: on CUDA tensors)."""
        super().__init__()
        self.sampler = sampler
        self.use_triton = use_triton

    def forward(self, metadata: SpecDecodeMetadata, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                sampling_metadata: SamplingMetadata,
                min_tokens_remaining: dict[int, tuple[int, list[int]]] | None = None) -> SamplerOutput:
        """logits [num_tokens + batch_size, V]: the rows of logits_indices (drafts and bonus rows).

        min_tokens_remaining: row -> (outputs still needed before a stop token may
        come, the stop token ids), for the rows below their min_tokens.
        Returns SamplerOutput with sampled_token_ids [batch_size, max_spec_len + 1]."""
        assert metadata.max_spec_len <= MAX_SPEC_LEN
        # The bonus tokens, by the ordinary Sampler, one row per request.
        # NOTE: at the bonus position a request has `num_draft_tokens` more outputs
        # than now: min_tokens masks it only if that is still too few (vLLM masks it
        # whenever the request is below min_tokens now).
        bonus_logits = logits[metadata.bonus_logits_indices]                          # [B, V]
        bonus_min_tokens = {row: stop_ids for row, (remaining, stop_ids) in (min_tokens_remaining or {}).items()
                            if remaining > metadata.num_draft_tokens[row]}
        # NOTE: the bonus token comes after every draft: its penalties and bad
        # words see them all (vLLM: Sampler(predict_bonus_token=True)).
        bonus_metadata = dataclasses.replace(sampling_metadata, max_num_logprobs=None, min_tokens=bonus_min_tokens,
                                             output_token_ids=self._bonus_output_token_ids(sampling_metadata))
        bonus_token_ids = self.sampler(bonus_logits, bonus_metadata).sampled_token_ids          # [B]

        # The target's distribution at every draft position.
        target_logits = logits[metadata.target_logits_indices].to(torch.float32)      # [T, V], a copy
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata,
                                                     min_tokens_remaining or {})
        target_logits = apply_sampling_constraints(target_logits, metadata, sampling_metadata)
        output_token_ids = rejection_sample(metadata, draft_probs, target_logits, bonus_token_ids,
                                            sampling_metadata, self._use_triton(logits))
        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs_tensors = self._get_logprobs_tensors(sampling_metadata.max_num_logprobs, metadata, logits,
                                                          output_token_ids)
        return SamplerOutput(output_token_ids, logprobs_tensors)

    def apply_logits_processors(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                                metadata: SpecDecodeMetadata,
                                min_tokens_remaining: dict[int, tuple[int, list[int]]]) -> torch.Tensor:
        """The Sampler's logits processors at each draft position, logits [T, V] in place
        (the table at the top of this file). Each step is skipped when no row uses it."""
        has_penalties = not sampling_metadata.no_penalties
        output_token_ids = sampling_metadata.output_token_ids
        if has_penalties or sampling_metadata.bad_words_token_ids:
            # [T] lists: each position's past tokens (the output, then the drafts before it).
            output_token_ids = self._combine_outputs_with_spec_tokens(output_token_ids,
                                                                      sampling_metadata.spec_token_ids)
        if has_penalties or sampling_metadata.allowed_token_ids_mask is not None:
            # [T]: the batch row of each draft position, to repeat the rows' parameters.
            # (built on the host, where num_draft_tokens is, and copied: no device sync)
            repeat_indices = torch.arange(len(metadata.num_draft_tokens)).repeat_interleave(
                torch.tensor(metadata.num_draft_tokens, dtype=torch.long)).to(logits.device, non_blocking=True)
            if has_penalties:
                logits = self.apply_penalties(logits, sampling_metadata, repeat_indices, output_token_ids)
            if sampling_metadata.allowed_token_ids_mask is not None:
                logits.masked_fill_(sampling_metadata.allowed_token_ids_mask[repeat_indices], float("-inf"))
        if sampling_metadata.bad_words_token_ids:
            apply_bad_words_with_drafts(logits, sampling_metadata.bad_words_token_ids, output_token_ids,
                                        metadata.num_draft_tokens)
        return apply_min_tokens_with_spec_decode(logits, metadata.num_draft_tokens, min_tokens_remaining)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, sampling_metadata: SamplingMetadata, repeat_indices: torch.Tensor,
                        output_token_ids: list[list[int]]) -> torch.Tensor:
        """Presence, frequency and repetition penalties at each draft position: the
        rows' prompts and parameters repeated per position [T, ...], with each
        position's own past tokens (output_token_ids, [T] lists)."""
        md = sampling_metadata
        assert md.prompt_token_ids is not None and md.presence_penalties is not None
        assert md.frequency_penalties is not None and md.repetition_penalties is not None
        return apply_all_penalties(logits, md.prompt_token_ids[repeat_indices], md.presence_penalties[repeat_indices],
                                   md.frequency_penalties[repeat_indices], md.repetition_penalties[repeat_indices],
                                   output_token_ids)

    @staticmethod
    def _combine_outputs_with_spec_tokens(output_token_ids: list[list[int]],
                                          spec_token_ids: list[list[int]] | None) -> list[list[int]]:
        """Per batch row, one list per draft position: the output, then the drafts before
        that position. [[o], [o2]] with drafts [[a, b], []] -> [[o], [o, a]] (a row
        without drafts has no draft positions)."""
        assert spec_token_ids is not None, "a step with drafts carries them in SamplingMetadata.spec_token_ids"
        result: list[list[int]] = []
        for out, spec in zip(output_token_ids, spec_token_ids):
            for i in range(len(spec)):
                result.append([*out, *spec[:i]])
        return result

    @staticmethod
    def _bonus_output_token_ids(sampling_metadata: SamplingMetadata) -> list[list[int]]:
        """The past tokens of each row's bonus position: its output and all its drafts
        (only built when penalties or bad words read them)."""
        md = sampling_metadata
        if (md.no_penalties and not md.bad_words_token_ids) or md.spec_token_ids is None:
            return md.output_token_ids
        return [[*out, *spec] if spec else out for out, spec in zip(md.output_token_ids, md.spec_token_ids)]

    def _use_triton(self, logits: torch.Tensor) -> bool:
        return self.use_triton if self.use_triton is not None else logits.device.type == "cuda"

    def _get_logprobs_tensors(self, max_num_logprobs: int, metadata: SpecDecodeMetadata, logits: torch.Tensor,
                              output_token_ids: torch.Tensor) -> LogprobsTensors:
        """Raw logprobs (the model's own distribution, as the Sampler's) of every output
        position, [batch_size * (max_spec_len + 1)] rows; rejected positions are
        filtered out by parse_output."""
        batch_size, width = output_token_ids.shape
        starts = metadata.cu_num_sampled_tokens.long() - torch.tensor(metadata.num_draft_tokens,
                                                                      device=logits.device) - 1   # [B]
        rows = (starts.unsqueeze(1) + torch.arange(width, device=logits.device)).flatten()      # [B * W]
        rows.clamp_(max=logits.shape[0] - 1)
        tokens = output_token_ids.flatten().long()
        tokens = torch.where(tokens == PLACEHOLDER_TOKEN_ID, 0, tokens)
        return self.sampler.gather_logprobs(self.sampler.compute_logprobs(logits[rows]), max_num_logprobs, tokens)

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor | list[list[int]], vocab_size: int,
                     discard_req_indices: list[int] | tuple = ()) -> tuple[list[list[int]], list]:
        """[B, max_spec_len + 1] (on the host, or its rows as lists) -> each request's output
        tokens, and a mask of kept positions [B][W] (for the logprobs rows). Discarded rows
        (partial prefill chunks) get []."""
        rows = output_token_ids.tolist() if isinstance(output_token_ids, torch.Tensor) else output_token_ids
        discard = set(discard_req_indices)
        keep = [[0 <= t < vocab_size and i not in discard for t in row] for i, row in enumerate(rows)]
        return [[t for t, k in zip(row, mask) if k] for row, mask in zip(rows, keep)], keep


def apply_min_tokens_with_spec_decode(logits: torch.Tensor, num_draft_tokens: list[int],
                                      min_tokens_remaining: dict[int, tuple[int, list[int]]]) -> torch.Tensor:
    """Mask the stop tokens at each draft position that comes before min_tokens
    (vLLM: MinTokensLogitsProcessor.apply_with_spec_decode). logits [T, V], in place."""
    start = 0
    for row, n in enumerate(num_draft_tokens):
        remaining, stop_ids = min_tokens_remaining.get(row, (0, []))
        num_masked = min(max(remaining, 0), n)
        if num_masked:
            logits[start:start + num_masked, stop_ids] = float("-inf")
        start += n
    return logits


def apply_sampling_constraints(logits: torch.Tensor, metadata: SpecDecodeMetadata,
                               sampling_metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, then top-k and top-p, each request's own, at each of its draft
    positions (all-greedy batches: untouched). logits [T, V], in place where possible."""
    if sampling_metadata.all_greedy:
        return logits
    assert sampling_metadata.temperature is not None
    num_tokens = logits.shape[0]
    # Greedy rows divide by 1 (their random result is not used).
    temperature = expand_batch_to_tokens(sampling_metadata.temperature, metadata, num_tokens,
                                         replace_from=GREEDY_TEMPERATURE, replace_to=1)
    logits.div_(temperature.unsqueeze(-1))
    top_k = None if sampling_metadata.top_k is None else \
        expand_batch_to_tokens(sampling_metadata.top_k, metadata, num_tokens)
    top_p = None if sampling_metadata.top_p is None else \
        expand_batch_to_tokens(sampling_metadata.top_p, metadata, num_tokens)
    return apply_top_k_top_p(logits, top_k, top_p)


def expand_batch_to_tokens(x: torch.Tensor, metadata: SpecDecodeMetadata, num_tokens: int,
                           replace_from: float = 0, replace_to: float = 0) -> torch.Tensor:
    """[a, b, c] with num_draft_tokens [2, 3, 1] -> [a, a, b, b, b, c] (replace_from -> replace_to).

    NOTE: vLLM launches a small Triton kernel (expand_kernel); repeat_interleave
    with output_size does the same without a host sync."""
    repeats = torch.tensor(metadata.num_draft_tokens, device=x.device)
    expanded = x.repeat_interleave(repeats, output_size=num_tokens)
    if replace_from != replace_to:
        expanded = torch.where(expanded == replace_from, torch.tensor(replace_to, dtype=x.dtype, device=x.device),
                               expanded)
    return expanded


def rejection_sample(metadata: SpecDecodeMetadata, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                     bonus_token_ids: torch.Tensor, sampling_metadata: SamplingMetadata,
                     use_triton: bool) -> torch.Tensor:
    """Accept or reject every draft, per request: [B, max_spec_len + 1] int32, -1 padded."""
    batch_size = len(metadata.num_draft_tokens)
    num_tokens = metadata.draft_token_ids.shape[0]
    device = target_logits.device
    assert target_logits.shape[0] == num_tokens
    ops = _kernels() if use_triton else _TORCH_OPS
    output_token_ids = torch.full((batch_size, metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                                  dtype=torch.int32, device=device)
    is_greedy: torch.Tensor | None = None
    if not sampling_metadata.all_greedy:
        assert sampling_metadata.temperature is not None
        is_greedy = sampling_metadata.temperature == GREEDY_TEMPERATURE                       # [B]
    if not sampling_metadata.all_random:
        # Greedy requests: keep drafts while they equal the target's argmax.
        target_argmax = target_logits.argmax(dim=-1)                                       # [T]
        ops.rejection_greedy_sample(output_token_ids, metadata.cu_num_draft_tokens, metadata.draft_token_ids,
                                    target_argmax, bonus_token_ids, is_greedy, metadata.max_spec_len)
        if sampling_metadata.all_greedy:
            return output_token_ids
    assert is_greedy is not None
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)                      # [T, V]
    uniform_probs = generate_uniform_probs(num_tokens, metadata.num_draft_tokens,
                                           sampling_metadata.generators, device)           # [T]
    inv_q = exponential_noise_inverse(batch_size, target_probs.shape[-1], metadata.num_draft_tokens,
                                      sampling_metadata.generators, device)              # [B, V]
    recovered_token_ids = ops.sample_recovered_tokens(metadata.cu_num_draft_tokens, metadata.draft_token_ids,
                                                      draft_probs, target_probs, inv_q, metadata.max_spec_len)
    ops.rejection_random_sample(output_token_ids, metadata.cu_num_draft_tokens, metadata.draft_token_ids,
                                draft_probs, target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                                is_greedy, metadata.max_spec_len)
    return output_token_ids


def generate_uniform_probs(num_tokens: int, num_draft_tokens: list[int], generators: dict[int, torch.Generator],
                           device: torch.device) -> torch.Tensor:
    """u ~ U[0, 1) per draft token [T], float64 (float32 rounds to exactly 0.0 too
    often: pytorch#16706); a seeded request draws its own from its generator.
    NOTE: a request without drafts draws nothing (its generator stays where it was)."""
    uniform_probs = torch.rand((num_tokens,), dtype=torch.float64, device=device)
    start = 0
    for row, n in enumerate(num_draft_tokens):
        if n == 0:
            continue
        generator = generators.get(row)
        if generator is not None:
            uniform_probs[start:start + n].uniform_(generator=generator)
        start += n
    return uniform_probs


def exponential_noise_inverse(batch_size: int, vocab_size: int, num_draft_tokens: list[int],
                              generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """1 / q with q ~ Exp(1), one row per request [B, V] (the recovered token is
    argmax(prob / q): the exponential race, as the Sampler's random_sample).
    NOTE: one row per request, not per position: a request recovers at most one token."""
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=device)
    q.exponential_()
    for row, generator in generators.items():
        if num_draft_tokens[row] > 0:
            q[row].exponential_(generator=generator)
    return q.reciprocal()


def _kernels():
    # NOTE: imported on first use: the kernels pick compiled or interpreted
    # Triton at import, and a CPU run never needs them.
    from vllm_anatomy.kernels import rejection_sampler as kernels
    return kernels


# -- the torch reference of the three loops (the Triton kernels' contract) -----------------------
def _request_spans(cu_num_draft_tokens: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each request's drafts in the flat draft list."""
    ends = cu_num_draft_tokens.tolist()
    return list(zip([0] + ends[:-1], ends))


def rejection_greedy_sample(output_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                            draft_token_ids: torch.Tensor, target_argmax: torch.Tensor,
                            bonus_token_ids: torch.Tensor, is_greedy: torch.Tensor | None,
                            max_spec_len: int) -> None:
    """Greedy rows of output_token_ids [B, max_spec_len + 1], in place: the target's argmax
    at each position while the drafts match it; after the first mismatch, nothing
    more; the bonus token when every draft matched."""
    drafts, argmax, bonus = draft_token_ids.tolist(), target_argmax.tolist(), bonus_token_ids.tolist()
    greedy = [True] * len(bonus) if is_greedy is None else is_greedy.tolist()
    for req, (start, end) in enumerate(_request_spans(cu_num_draft_tokens)):
        if not greedy[req]:
            continue
        out = []
        for pos in range(start, end):
            out.append(argmax[pos])                 # the target's own token, accepted or not
            if drafts[pos] != argmax[pos]:
                break                               # rejected: the argmax is the recovered token
        else:
            out.append(bonus[req])                  # every draft accepted
        output_token_ids[req, :len(out)] = torch.tensor(out, dtype=output_token_ids.dtype)


def rejection_random_sample(output_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                            draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                            target_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                            recovered_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                            is_greedy: torch.Tensor, max_spec_len: int) -> None:
    """Random rows, in place: draft j is accepted if u_j <= p(d_j) / q(d_j) (q(d_j) = 1
    without draft_probs); the first rejected position gets the recovered token."""
    num_tokens = draft_token_ids.shape[0]
    drafts = draft_token_ids.long()
    safe = drafts.clamp(min=0)                                             # (-1 = a padded draft: rejected)
    index = torch.arange(num_tokens, device=target_probs.device)
    target_p = target_probs[index, safe].tolist()                          # p(d_j)
    draft_p = [1.0] * num_tokens if draft_probs is None else draft_probs[index, safe].tolist()
    u, recovered = uniform_probs.tolist(), recovered_token_ids.tolist()
    draft_list, bonus, greedy = drafts.tolist(), bonus_token_ids.tolist(), is_greedy.tolist()
    for req, (start, end) in enumerate(_request_spans(cu_num_draft_tokens)):
        if greedy[req]:
            continue
        out = []
        for pos in range(start, end):
            # NOTE: a draft probability of 0 should not happen; reject rather than divide by it.
            accepted = draft_list[pos] >= 0 and draft_p[pos] > 0 and target_p[pos] / draft_p[pos] >= u[pos]
            if not accepted:
                out.append(recovered[pos])
                break
            out.append(draft_list[pos])
        else:
            out.append(bonus[req])
        output_token_ids[req, :len(out)] = torch.tensor(out, dtype=output_token_ids.dtype)


def sample_recovered_tokens(cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                            draft_probs: torch.Tensor | None, target_probs: torch.Tensor, inv_q: torch.Tensor,
                            max_spec_len: int) -> torch.Tensor:
    """The token each draft position would emit if rejected [T]: a sample from
    max(p - q, 0) (unnormalized: argmax does not care), by the exponential race
    argmax(prob * inv_q) with the request's noise row."""
    spans = _request_spans(cu_num_draft_tokens)
    req_of_token = torch.tensor([req for req, (s, e) in enumerate(spans) for _ in range(s, e)],
                                dtype=torch.long, device=target_probs.device)              # [T]
    if draft_probs is None:
        # q is one-hot at the draft: p without the draft token.
        prob = target_probs.clone()
        drafts = draft_token_ids.long()
        has_draft = drafts >= 0                                            # (-1: a padded draft)
        prob[torch.arange(prob.shape[0], device=prob.device)[has_draft], drafts[has_draft]] = 0
    else:
        prob = (target_probs - draft_probs).clamp_min(0)
    return (prob * inv_q[req_of_token]).argmax(dim=-1).to(draft_token_ids.dtype)           # [T]


class _TorchOps:
    """The reference implementations, under the names the kernels module uses."""
    rejection_greedy_sample = staticmethod(rejection_greedy_sample)
    rejection_random_sample = staticmethod(rejection_random_sample)
    sample_recovered_tokens = staticmethod(sample_recovered_tokens)


_TORCH_OPS = _TorchOps()
