"""Prompt logprobs: how likely the model found each prompt token, given the ones before it.

Mirrors GPUModelRunner._get_prompt_logprobs_dict in vllm/v1/worker/gpu_model_runner.py,
as a mixin of GPUModelRunner (like worker/model_runner_startup.py). A request
with SamplingParams.prompt_logprobs = k gets, for prompt positions 1..P-1,
the logprob and rank of the actual next prompt token and the top-k
alternatives: the logits at position i score prompt token i + 1.

Why it is separate work: a step computes logits only at each request's last
scheduled token (logits_indices). Prompt logprobs need them at every prompt
position of the request, so this recomputes compute_logits on those hidden
states, for the requests that asked (rare: scoring, evaluation harnesses).

Chunked prefill: the prompt arrives chunk by chunk. Each chunk's rows are
written into host tensors sized for the whole prompt (in_progress_prompt_logprobs_cpu);
the filled tensors are returned once, in the step whose chunk completes the
prompt (the step that also samples the first output token), as
ModelRunnerOutput.prompt_logprobs_dict[req_id]. Such a request never reads the
prefix cache (Request.skip_reading_prefix_cache): every prompt token must be computed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_anatomy.core.outputs import LogprobsTensors

if TYPE_CHECKING:
    from vllm_anatomy.model_executor.sampler import Sampler
    from vllm_anatomy.worker.cpu_gpu_buffer import CpuGpuBuffer
    from vllm_anatomy.worker.gpu_input_batch import CachedRequestState, InputBatch


class PromptLogprobsMixin:
    # The runner's state these methods read (made by GPUModelRunner.__init__).
    requests: dict[str, CachedRequestState]
    input_batch: InputBatch
    query_start_loc: CpuGpuBuffer
    sampler: Sampler
    device: torch.device
    model: Any
    model_config: Any

    # req_id -> prompt logprobs asked for, until its prompt is complete
    # (vLLM: InputBatch.num_prompt_logprobs); req_id -> the rows so far
    # (vLLM: CachedRequestState.in_progress_prompt_logprobs_cpu).
    num_prompt_logprobs: dict[str, int]
    in_progress_prompt_logprobs_cpu: dict[str, LogprobsTensors]

    def _init_prompt_logprobs(self) -> None:
        self.num_prompt_logprobs = {}
        self.in_progress_prompt_logprobs_cpu = {}

    def _add_prompt_logprobs_request(self, req_id: str, prompt_logprobs: int | None) -> None:
        """A new request joined: remember what it asked for (-1: the whole vocabulary)."""
        if prompt_logprobs is not None:
            self.num_prompt_logprobs[req_id] = (self.model_config.hf_config["vocab_size"] if prompt_logprobs == -1
                                                else prompt_logprobs)

    def _remove_prompt_logprobs_request(self, req_id: str) -> None:
        self.num_prompt_logprobs.pop(req_id, None)
        self.in_progress_prompt_logprobs_cpu.pop(req_id, None)

    def _get_prompt_logprobs_dict(self, hidden_states: torch.Tensor,
                                  num_scheduled_tokens: dict[str, int]) -> dict[str, LogprobsTensors | None]:
        """hidden_states [T, H] of the step's tokens -> {req_id: its prompt logprobs}
        for each request whose prompt this step completes."""
        if not self.num_prompt_logprobs:
            return {}
        prompt_logprobs_dict: dict[str, LogprobsTensors | None] = {}
        completed: list[str] = []
        query_start_loc = self.query_start_loc.np
        for req_id, num_prompt_logprobs in self.num_prompt_logprobs.items():
            num_tokens = num_scheduled_tokens.get(req_id)
            row = self.input_batch.req_id_to_index.get(req_id)
            if num_tokens is None or row is None:
                continue                  # not in this step (preempted, or left out)
            request = self.requests[req_id]
            num_prompt_tokens = request.num_prompt_tokens
            logprobs_tensors = self.in_progress_prompt_logprobs_cpu.get(req_id)
            if logprobs_tensors is None:
                logprobs_tensors = LogprobsTensors.empty_cpu(num_prompt_tokens - 1, num_prompt_logprobs + 1)
                self.in_progress_prompt_logprobs_cpu[req_id] = logprobs_tensors
            # Position i scores prompt token i + 1: this chunk covers positions
            # start_idx.., up to the prompt's second-to-last token.
            start_idx = request.num_computed_tokens
            num_remaining_tokens = num_prompt_tokens - (start_idx + 1)
            if num_tokens <= num_remaining_tokens:
                num_logits = num_tokens   # a chunk: more of the prompt follows
            else:
                # NOTE: the chunk that reaches the prompt's last token completes
                # it; it is also the step that samples the first output token,
                # so the logprobs go out with that token (never before it).
                num_logits = num_remaining_tokens
                completed.append(req_id)
                prompt_logprobs_dict[req_id] = logprobs_tensors
            if num_logits <= 0:
                continue                  # the previous chunk ended exactly at the second-to-last token
            offset = int(query_start_loc[row])
            logits = self.model.compute_logits(hidden_states[offset:offset + num_logits])   # [n, V]
            targets = torch.as_tensor(np.asarray(request.prompt_token_ids[start_idx + 1:start_idx + 1 + num_logits]),
                                      device=self.device)                                   # [n]
            token_ids, logprobs, ranks, _ = self.sampler.gather_logprobs(
                self.sampler.compute_logprobs(logits), num_prompt_logprobs, targets)
            rows = slice(start_idx, start_idx + num_logits)
            logprobs_tensors.logprob_token_ids[rows].copy_(token_ids)
            logprobs_tensors.logprobs[rows].copy_(logprobs)
            logprobs_tensors.selected_token_ranks[rows].copy_(ranks)
        for req_id in completed:
            del self.num_prompt_logprobs[req_id]
            del self.in_progress_prompt_logprobs_cpu[req_id]
        return prompt_logprobs_dict
