"""What a worker returns to the scheduler after a step, and the logprobs it carries.

Mirrors vllm/v1/outputs.py (LogprobsLists, LogprobsTensors, ModelRunnerOutput,
AsyncModelRunnerOutput). ModelRunnerOutput crosses the worker -> EngineCore
boundary, so it is a msgspec Struct (msgpack on the wire, no pickle): numpy
arrays and CPU tensors travel as raw bytes (engine/serial_utils.py).

Logprobs are batched, as in v0.27.1: one LogprobsLists for the whole step,
one row per generated token (a row per request here: one token per step),
each row [sampled token, top-1, ..., top-k] with k the batch's largest
`logprobs`; the scheduler cuts each request's rows out with slice_request().
NOTE: cu_num_generated_tokens is for speculative decoding, where requests
generate different numbers of tokens per step (None: one row per request).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import numpy as np

if TYPE_CHECKING:
    from torch import Tensor
else:
    # NOTE: the pure core (the scheduler reads these types) does not import
    # torch: at run time a tensor field is typed Any, and a tensor crosses the
    # wire as a msgpack extension the decoders rebuild (engine/serial_utils.py).
    Tensor = Any


class LogprobsLists(NamedTuple):
    """Logprobs on the host. Rows: generated tokens; columns: [sampled, top-1..top-k]."""
    # [num_reqs x num_generated_tokens, max_num_logprobs + 1]
    logprob_token_ids: np.ndarray
    # [num_reqs x num_generated_tokens, max_num_logprobs + 1]
    logprobs: np.ndarray
    # [num_reqs x num_generated_tokens]: the sampled token's rank (1 = the most likely)
    sampled_token_ranks: np.ndarray
    # [num_reqs]: where each request's rows start (None: row i is request i)
    cu_num_generated_tokens: list[int] | None = None

    def slice_request(self, req_idx: int, num_positions: int) -> LogprobsLists:
        """The rows of request req_idx (its first num_positions generated tokens)."""
        if self.cu_num_generated_tokens is not None:
            req_idx = self.cu_num_generated_tokens[req_idx]
        end_idx = req_idx + num_positions
        return LogprobsLists(self.logprob_token_ids[req_idx:end_idx], self.logprobs[req_idx:end_idx],
                             self.sampled_token_ranks[req_idx:end_idx], None)


class LogprobsTensors(NamedTuple):
    """Logprobs as tensors (on the device while the sampler makes them; on the host
    for prompt logprobs, which cross the wire this way)."""
    # [num_positions, num_logprobs + 1]
    logprob_token_ids: Tensor
    # [num_positions, num_logprobs + 1]
    logprobs: Tensor
    # [num_positions]
    selected_token_ranks: Tensor
    cu_num_generated_tokens: list[int] | None = None

    def tolists(self, cu_num_generated_tokens: list[int] | None = None) -> LogprobsLists:
        """On the host, as numpy (a device tensor is copied: a sync)."""
        return LogprobsLists(self.logprob_token_ids.cpu().numpy(), self.logprobs.cpu().numpy(),
                             self.selected_token_ranks.cpu().numpy(),
                             cu_num_generated_tokens if cu_num_generated_tokens is not None
                             else self.cu_num_generated_tokens)

    def to_cpu_nonblocking(self) -> LogprobsTensors:
        """Host copies enqueued behind the current stream (the caller syncs before reading)."""
        if self.logprob_token_ids.device.type == "cpu":
            return self
        return LogprobsTensors(self.logprob_token_ids.to("cpu", non_blocking=True),
                               self.logprobs.to("cpu", non_blocking=True),
                               self.selected_token_ranks.to("cpu", non_blocking=True),
                               self.cu_num_generated_tokens)

    def filter(self, mask: Tensor) -> LogprobsTensors:
        """The rows where mask is True."""
        assert self.cu_num_generated_tokens is None, "filter can't be used with cu_num_generated_tokens"
        return LogprobsTensors(self.logprob_token_ids[mask], self.logprobs[mask], self.selected_token_ranks[mask])

    @staticmethod
    def cat(tensors: Sequence[LogprobsTensors], cu_num_generated_tokens: list[int] | None = None) -> LogprobsTensors:
        """Rows of several LogprobsTensors, one after the other (all of the same width)."""
        import torch
        assert tensors
        assert cu_num_generated_tokens is not None or all(t.cu_num_generated_tokens is None for t in tensors)
        if len(tensors) == 1:
            tensor = tensors[0]
            return tensor if cu_num_generated_tokens is None \
                else tensor._replace(cu_num_generated_tokens=cu_num_generated_tokens)
        return LogprobsTensors(logprob_token_ids=torch.cat([t.logprob_token_ids for t in tensors]),
                               logprobs=torch.cat([t.logprobs for t in tensors]),
                               selected_token_ranks=torch.cat([t.selected_token_ranks for t in tensors]),
                               cu_num_generated_tokens=cu_num_generated_tokens)

    @staticmethod
    def empty_cpu(num_positions: int, num_tokens_per_position: int) -> LogprobsTensors:
        """Host tensors to fill chunk by chunk (a chunked prompt's prompt logprobs)."""
        import torch
        logprob_token_ids = torch.empty((num_positions, num_tokens_per_position), dtype=torch.int32, device="cpu")
        return LogprobsTensors(logprob_token_ids=logprob_token_ids,
                               logprobs=torch.empty_like(logprob_token_ids, dtype=torch.float32),
                               selected_token_ranks=torch.empty(num_positions, dtype=torch.int32, device="cpu"))


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    # [num_reqs] in InputBatch row order.
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # [num_reqs][num_generated_tokens]; an empty list for a partial prefill
    # chunk (its sampled token is discarded: the prompt is not finished).
    sampled_token_ids: list[list[int]] = []
    # The step's logprobs, every row (None when no request asked for logprobs).
    logprobs: LogprobsLists | None = None
    # req_id -> its prompt's logprobs, for requests that asked (prompt_logprobs)
    # and whose prompt completed this step.
    prompt_logprobs_dict: dict[str, LogprobsTensors | None] = {}
    # NOTE: what vLLM's pooling models, KV connectors, encoder-cache
    # connectors, NaN checks, CUDA-graph stats and MoE expert capture return;
    # none here, always None.
    pooler_output: None = None
    kv_connector_output: None = None
    ec_connector_output: None = None
    num_nans_in_logits: dict[str, int] | None = None
    cudagraph_stats: None = None
    routed_experts: None = None
    # Ours: requests that failed in the worker this step (e.g. while joining
    # the persistent batch): not in req_ids; EngineCore finishes them with
    # FINISHED_ERROR. None (the usual case) when every request ran.
    error_req_ids: list[str] | None = None
    # Ours: async speculative decoding: the drafts each row verified this step
    # ([num_reqs][num_drafts]). The scheduler scheduled -1 placeholders for them;
    # EngineCore puts these in their place (Scheduler.update_draft_token_ids_in_output)
    # for the step's records. None otherwise.
    verified_draft_token_ids: list[list[int]] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={})


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

    The worker returns it from sample_tokens without waiting; get_output()
    waits for the device-to-host copy (the step's sync point, now one step
    later) and returns the ModelRunnerOutput.
    NOTE: never crosses a process boundary: it wraps device tensors and events.
    """

    def get_output(self) -> ModelRunnerOutput:
        raise NotImplementedError
