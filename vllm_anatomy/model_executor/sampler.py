"""Sampler: logits of the batch's last tokens -> one new token id per row.

Mirrors vllm/v1/sample/sampler.py (Sampler), with the top-k/top-p step of
vllm/v1/sample/ops/topk_topp_sampler.py. The order of operations is vLLM's:

    1. raw logprobs, if any row asked for logprobs (before anything changes the logits)
    2. logits -> float32
    2a. allowed_token_ids: every other token -> -inf
    2b. bad words: a token that would complete a banned word -> -inf (bad_words.py)
    2c. logits processors: min_tokens (stop tokens masked for rows that may
        not stop yet) and logit_bias (added to the biased tokens' logits)
    2d. penalties: repetition, frequency, presence (penalties.py)
    3. greedy rows: argmax; if every row is greedy, done
    4. temperature
    5. min-p
    6. top-k / top-p
    7. sample (seeded rows with their own generator)
    8. gather the logprobs of the sampled token and of the top-n tokens, with its rank

Steps 2a-2d run before the greedy argmax: they change which token is the
most likely (vLLM: apply_logits_processors). Simplified here: no custom
logits processors; the structured-output bitmask is applied by the runner
before the Sampler. With speculative decoding the RejectionSampler
(rejection_sampler.py) calls this Sampler for each request's bonus token, with
the request's drafts appended to its output tokens (vLLM: predict_bonus_token).

NOTE: the fused sampling path (a performance seam; the steps above are the
idea). On CUDA, a batch that uses temperature and nothing else (no top-k/p,
min-p, min_tokens, logit_bias or per-request seeds) runs steps 2-7 as one
Triton kernel (vllm_anatomy/kernels/sampling.py, gumbel_sample): one read of the logits in
their own dtype, argmax(logits / T - log E) with E ~ Exp(1) per token. That is
random_sample's exponential race in log space (the Gumbel-max trick), so the
same token wins with the same probability, without the [R, V] float32 copy,
softmax, noise and division (~6 % of a 256-sequence run's GPU time on an
H200). The draws themselves differ (Philox keyed by one int64 per step from
torch's generator, so torch.manual_seed still reproduces a run): seeded
requests always take the torch path, as does any batch with penalties, allowed_token_ids or bad
words. Off: VLLM_ANATOMY_FUSED_SAMPLING=0.
vLLM v0.27.1's Sampler has no such path (FlashInfer's serves top-k/top-p
batches only); the kernel mirrors its second GPU runner's gumbel_sample
(vllm/v1/worker/gpu/sample/gumbel.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from vllm_anatomy import envs
from vllm_anatomy.core.outputs import LogprobsTensors
from vllm_anatomy.model_executor.bad_words import apply_bad_words
from vllm_anatomy.model_executor.penalties import apply_all_penalties
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata
from vllm_anatomy.sampling_params import _SAMPLING_EPS

# The fused sampling seam (see the NOTE at the top); the lead's A/B switch.
USE_FUSED_SAMPLING: bool = envs.VLLM_ANATOMY_FUSED_SAMPLING
# Devices it runs on (Triton kernels need CUDA; tests add "cpu" under TRITON_INTERPRET=1).
FUSED_SAMPLING_DEVICES = ("cuda",)


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor    # [R] int64
    logprobs_tensors: LogprobsTensors | None


class Sampler(nn.Module):

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """logits [R, V] (not modified) -> SamplerOutput."""
        num_logprobs = sampling_metadata.max_num_logprobs
        # NOTE: vLLM's default logprobs mode is "raw": the model's own
        # distribution, before temperature / top-k / top-p reshape it.
        raw_logprobs = self.compute_logprobs(logits) if num_logprobs is not None else None
        if fused_sampling_applies(logits, sampling_metadata):
            assert sampling_metadata.temperature is not None
            sampled = fused_sample(logits, sampling_metadata.temperature)
        else:
            logits = self.apply_logits_processors(logits.to(torch.float32), sampling_metadata)
            sampled = self.sample(logits, sampling_metadata)
        logprobs_tensors = None
        if raw_logprobs is not None and num_logprobs is not None:
            logprobs_tensors = self.gather_logprobs(raw_logprobs, num_logprobs, sampled)
        return SamplerOutput(sampled, logprobs_tensors)

    def apply_logits_processors(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Steps 2a-2d, each skipped when no row of the batch uses it. logits [R, V] float32.

        NOTE: `logits.to(float32)` is a new tensor only for bf16/fp16 logits;
        for fp32 ones (the CPU) it is the runner's own tensor. Each step here
        therefore returns a new tensor before anything is written in place, so
        the caller's logits are never modified.
        """
        if md.allowed_token_ids_mask is not None:
            logits = logits.masked_fill(md.allowed_token_ids_mask, float("-inf"))
        if md.bad_words_token_ids:
            logits = logits.clone()
            apply_bad_words(logits, md.bad_words_token_ids, md.output_token_ids)
        if md.min_tokens:
            logits = apply_min_tokens(logits, md.min_tokens)
        if md.logit_bias is not None:
            logits = apply_logit_bias(logits, md.logit_bias)
        if not md.no_penalties:
            assert md.prompt_token_ids is not None and md.frequency_penalties is not None
            assert md.presence_penalties is not None and md.repetition_penalties is not None
            logits = apply_all_penalties(logits.clone(), md.prompt_token_ids, md.presence_penalties,
                                         md.frequency_penalties, md.repetition_penalties, md.output_token_ids)
        return logits

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1, dtype=torch.float32)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy_sampled = None if md.all_random else logits.argmax(dim=-1)     # [R]
        if md.all_greedy:
            assert greedy_sampled is not None
            return greedy_sampled
        assert md.temperature is not None
        logits = self.apply_temperature(logits, md.temperature)   # a new tensor from here on
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1, dtype=torch.float32)                   # [R, V]
        random_sampled = random_sample(probs, md.generators)
        if greedy_sampled is None:
            return random_sampled
        # Mixed batch: both were computed for every row; each row keeps its own kind.
        return torch.where(md.temperature < _SAMPLING_EPS, greedy_sampled, random_sampled)

    @staticmethod
    def apply_temperature(logits: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
        # Greedy rows carry temperature 0; divide them by 1 instead (their
        # random sample is discarded anyway) to avoid inf/nan.
        temp = torch.where(temp < _SAMPLING_EPS, 1.0, temp)
        return logits / temp.unsqueeze(1)                                     # [R, V]

    @staticmethod
    def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                        token_ids: torch.Tensor) -> LogprobsTensors:
        """logprobs [R, V], token_ids [R] -> the sampled token's logprob and rank + the top-n."""
        token_ids = token_ids.long().unsqueeze(-1)                            # [R, 1]
        token_logprobs = logprobs.gather(-1, token_ids)                       # [R, 1]
        # Rank = how many tokens are at least as likely as the sampled one
        # (1 = the most likely), counted the way vLLM counts it.
        ranks = (logprobs >= token_logprobs).sum(dim=-1)                      # [R]
        topk_logprobs, topk_ids = logprobs.topk(num_logprobs, dim=-1)         # [R, n]
        return LogprobsTensors(torch.cat([token_ids, topk_ids], dim=1),
                               torch.cat([token_logprobs, topk_logprobs], dim=1),
                               ranks)


def fused_sampling_applies(logits: torch.Tensor, md: SamplingMetadata) -> bool:
    """True when gumbel_sample gives exactly the torch path's distribution (NOTE at the top).

    All-greedy batches stay on the torch path: it is one argmax already, and
    they draw no random numbers there."""
    return (USE_FUSED_SAMPLING and logits.device.type in FUSED_SAMPLING_DEVICES
            and not md.all_greedy and md.temperature is not None
            and md.top_k is None and md.top_p is None and md.min_p is None
            and not md.generators and not md.min_tokens and md.logit_bias is None
            and md.no_penalties and md.allowed_token_ids_mask is None and not md.bad_words_token_ids)


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (any float dtype), temperature [R] -> sampled ids [R] int64, in one kernel."""
    # NOTE: imported here, not at the top: the kernels pick compiled or
    # interpreted Triton at import, and CPU runs never need them.
    from vllm_anatomy.kernels.sampling import gumbel_sample
    # The step's Philox key, from torch's generator of this device: on the
    # device (no host sync), and reproducible under torch.manual_seed.
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=logits.device)
    return gumbel_sample(logits, temperature, seed)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x (the row's top probability)."""
    probs = logits.softmax(dim=-1)                                            # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)         # [R, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None,
                      p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k most likely tokens, then the smallest prefix holding mass p.

    k [R] (vocab_size = off), p [R] (1.0 = off); None skips the step for all rows.
    """
    if k is None and p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)          # [R, V]
    if k is not None:
        col = torch.arange(logits.shape[-1], device=logits.device)            # [V]
        sorted_logits = sorted_logits.masked_fill(col >= k.unsqueeze(1).long(), float("-inf"))
    if p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Mass of the tokens ranked *before* each one (0 for the top token).
        mass_before = probs.cumsum(dim=-1) - probs
        top_p_mask = mass_before >= p.unsqueeze(1)
        # NOTE: keep at least the top token, whatever p is (vLLM: "at least
        # one"). A tiny top_p (1e-50) is 0.0 in float32, which would mask
        # every token; softmax of an all -inf row is NaN, and the sample garbage.
        top_p_mask[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(top_p_mask, float("-inf"))
    # Undo the sort: put every (possibly -inf) logit back at its token id.
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row from probs [R, V] -> [R].

    NOTE: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token i with
    probability probs[i] (the "exponential race": the winner of independent
    exponential clocks with rates probs[i]). It needs no cumsum/searchsorted
    and, crucially, each row's noise can come from that row's own generator:
    a seeded request draws exactly V numbers from its generator per step,
    whatever else is in the batch and whichever row it occupies, so its
    samples are reproducible across batch compositions.
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()                          # unseeded rows: the global RNG
    for i, generator in generators.items():
        q[i].exponential_(generator=generator)    # seeded rows: their own stream
    return probs.div(q).argmax(dim=-1)                                        # [R]


def apply_min_tokens(logits: torch.Tensor, rows: dict[int, list[int]]) -> torch.Tensor:
    """Forbid stop tokens for rows with fewer than min_tokens outputs.

    NOTE: the scheduler's check_stop also ignores EOS before min_tokens, but
    only masking here keeps EOS out of the text (vLLM: MinTokensLogitsProcessor)."""
    logits = logits.clone()
    for row, stop_ids in rows.items():
        logits[row, stop_ids] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                     ) -> torch.Tensor:
    """Add each request's biases to its tokens' logits (vLLM: LogitBiasLogitsProcessor).

    logit_bias: (rows [B], token ids [B], biases [B]), one entry per biased token.
    """
    rows, token_ids, biases = logit_bias
    return logits.index_put((rows, token_ids), biases, accumulate=True)
