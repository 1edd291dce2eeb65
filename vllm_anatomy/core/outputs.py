"""What a worker returns to the scheduler after a step.

Mirrors vllm/v1/outputs.py. Crosses the worker -> EngineCore boundary, so it is
a msgspec Struct (msgpack on the wire, no pickle).
"""
from __future__ import annotations

import msgspec

from vllm_anatomy.engine.protocol import LogprobsLists


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    # [num_reqs] in InputBatch row order.
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # [num_reqs][num_generated_tokens]; an empty list for a partial prefill
    # chunk (its sampled token is discarded: the prompt is not finished).
    sampled_token_ids: list[list[int]]
    # Logprobs of the sampled tokens, one LogprobsLists row per request row
    # (each LogprobsLists holds one row per generated token); None when no
    # request in the batch asked for logprobs.
    logprobs: list[LogprobsLists | None] | None = None
    # Requests that failed in the worker this step (e.g. while joining the
    # persistent batch): not in req_ids; EngineCore finishes them with
    # FINISHED_ERROR. None (the usual case) when every request ran.
    error_req_ids: list[str] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


class DraftTokenIds(msgspec.Struct, array_like=True, gc=False):
    """Speculative decoding: the drafts the worker proposed after a step (vllm/v1/outputs.py).

    EngineCore fetches them with Executor.take_draft_token_ids once the step's
    output is processed, and hands them to Scheduler.update_draft_token_ids."""
    # [num_reqs] in InputBatch row order
    req_ids: list[str]
    # num_reqs x num_draft_tokens (a row may have fewer, or none)
    draft_token_ids: list[list[int]]


class AsyncModelRunnerOutput:
    """A step's output whose tokens are still on their way to the host (async scheduling).

    Mirrors vllm/v1/outputs.py. The worker returns it from sample_tokens
    without waiting; get_output() waits for the device-to-host copy (the
    step's sync point, now one step later) and returns the ModelRunnerOutput.
    NOTE: never crosses a process boundary: it wraps device tensors and events.
    """

    def get_output(self) -> ModelRunnerOutput:
        raise NotImplementedError
