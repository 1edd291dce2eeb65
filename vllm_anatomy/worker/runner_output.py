"""make_model_runner_output: a step's sampled ids and logprobs, on the host, as ModelRunnerOutput.

The last thing both paths of GPUModelRunner.sample_tokens do: synchronously
in _bookkeeping_sync, or one step later in AsyncGPUModelRunnerOutput.get_output
(async scheduling). vLLM builds the same object in _bookkeeping_sync and fills
its tokens in get_output.
"""
from __future__ import annotations

from vllm_anatomy.core.outputs import ModelRunnerOutput
from vllm_anatomy.engine.protocol import LogprobsLists


def make_model_runner_output(req_ids: list[str], sampled: list[int], invalid_req_indices: list[int],
                             num_logprobs: dict[str, int], host_logprobs: list[list] | None,
                             error_req_ids: list[str] | None = None) -> ModelRunnerOutput:
    """One token per row ([] for a discarded row) and, for rows that asked,
    the sampled token's logprob and the top-n.

    host_logprobs: the sampler's (token ids, logprobs, ranks) as lists, or None."""
    valid = [[token] for token in sampled]
    for i in invalid_req_indices:
        valid[i] = []
    logprobs = None
    if host_logprobs is not None:
        token_ids, token_logprobs, ranks = host_logprobs
        logprobs = []
        for i, req_id in enumerate(req_ids):
            n = num_logprobs.get(req_id)
            logprobs.append(LogprobsLists([token_ids[i][:n + 1]], [token_logprobs[i][:n + 1]], [ranks[i]])
                            if n is not None and valid[i] else None)
    # (req_id_to_index: {r: i for i, r in enumerate(req_ids)}, as one C-level pass)
    return ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index=dict(zip(req_ids, range(len(req_ids)))),
                             sampled_token_ids=valid, logprobs=logprobs, error_req_ids=error_req_ids)
