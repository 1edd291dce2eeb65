"""make_model_runner_output: a step's sampled ids and logprobs, on the host, as ModelRunnerOutput.

The last thing both paths of GPUModelRunner.sample_tokens do: synchronously
in _bookkeeping_sync, or one step later in AsyncGPUModelRunnerOutput.get_output
(async scheduling). vLLM builds the same object in _bookkeeping_sync and fills
its tokens in get_output.
"""
from __future__ import annotations

from vllm_anatomy.core.outputs import LogprobsLists, LogprobsTensors, ModelRunnerOutput


def make_model_runner_output(req_ids: list[str], valid_sampled_token_ids: list[list[int]],
                             invalid_req_indices: list[int], logprobs_lists: LogprobsLists | None,
                             prompt_logprobs_dict: dict[str, LogprobsTensors | None] | None = None,
                             error_req_ids: list[str] | None = None) -> ModelRunnerOutput:
    """valid_sampled_token_ids: [num_reqs][1] as _to_list returns them; the rows of
    invalid_req_indices (partial prefill chunks) are emptied here, in place.
    logprobs_lists: every row's logprobs (the scheduler slices out those that asked)."""
    for i in invalid_req_indices:
        valid_sampled_token_ids[i].clear()
    # (req_id_to_index: {r: i for i, r in enumerate(req_ids)}, as one C-level pass)
    return ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index=dict(zip(req_ids, range(len(req_ids)))),
                             sampled_token_ids=valid_sampled_token_ids, logprobs=logprobs_lists,
                             prompt_logprobs_dict=prompt_logprobs_dict or {}, error_req_ids=error_req_ids)
