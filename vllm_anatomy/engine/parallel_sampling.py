"""ParentRequest: one request with n > 1 becomes n child requests, and their outputs one answer.

Mirrors vllm/v1/engine/parallel_sampling.py. Parallel sampling lives entirely
on the frontend: AsyncLLM / LLMEngine fan the request out, the OutputProcessor
folds the children's outputs back in. The engine never hears of a parent:

    EngineCoreRequest "r" (n=3)
        -> "0_r", "1_r", "2_r": three ordinary requests, n=1, the same prompt
    scheduler: the first child allocates the prompt's blocks and caches the full
        ones; the others find them by hash (a prefix-cache hit), so the prompt's
        full blocks get ref_cnt 3 and are computed once. Each child then writes
        its own last, partial prompt block and its own output blocks.
    a shared block returns to the free queue only when its last holder frees it
        (ref_cnt 3 -> 2 -> 1 -> 0), whichever child finishes last.

NOTE: the sharing is the prefix cache's doing, not a special case: with
prefix caching off each child computes and holds its own copy of the prompt.
The children are added back to back, so the first one's blocks are cached
(hashed at allocation, before they are computed) by the time the next child
is scheduled, usually in the same step: those children read KV that the same
forward pass writes (every layer writes the step's keys and values before
its attention reads them).

Outputs: a child's CompletionOutput carries its index (0..n-1). Streaming
(CUMULATIVE / DELTA), each child's output goes out as it comes, in a
RequestOutput that is `finished` once every child is; FINAL_ONLY (LLM.generate,
a non-streamed HTTP answer), one RequestOutput with all n outputs, when the
last child finishes.

Seeds (vLLM's rule): with SamplingParams.seed = s, child i samples with seed
s + i, so the n samples differ from each other and a rerun repeats them all.
"""
from __future__ import annotations

import copy

from vllm_anatomy.engine.protocol import EngineCoreRequest
from vllm_anatomy.outputs import CompletionOutput
from vllm_anatomy.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """The fan-out of one n > 1 request: its children's ids, params and outputs."""

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request_id = request.request_id
        # NOTE: the caller's id, which every RequestOutput of the children reports.
        self.external_req_id = request.external_req_id or request.request_id
        self.sampling_params = request.sampling_params
        # Children that have not finished yet (by request id).
        self.child_requests: set[str] = set()
        # FINAL_ONLY: slot i holds child i's final output; the list goes out once all are in.
        self.output_aggregator: list[CompletionOutput | None] = (
            [None] * self.n if self.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY else [])
        # Without a seed every child's params are the same object (made once).
        self.cached_child_sampling_params: SamplingParams | None = None

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """Child `index`'s request id ("{index}_{parent id}", vLLM's form) and its params."""
        child_req_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_req_id)
        return child_req_id, self._get_child_sampling_params(index)

    def _get_child_sampling_params(self, index: int) -> SamplingParams:
        if self.cached_child_sampling_params is not None:
            return self.cached_child_sampling_params
        params = copy.copy(self.sampling_params)
        params.n = 1
        seed = self.sampling_params.seed
        if seed is None:
            self.cached_child_sampling_params = params
        else:
            # NOTE: one seed per child: the same seed would make n identical samples.
            params.seed = seed + index
        return params

    def get_outputs(self, child_request_id: str,
                    completion_output: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """One child's new output -> (the outputs to send now, whether the parent is finished)."""
        already_finished_and_returned = False
        if completion_output.finished():
            if child_request_id in self.child_requests:
                self.child_requests.remove(child_request_id)
            else:
                # Its final output went out in an earlier step (e.g. an abort after a stop).
                already_finished_and_returned = True
        if self.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            outputs = [] if already_finished_and_returned else [completion_output]
        else:
            self.output_aggregator[completion_output.index] = completion_output
            outputs = [] if self.child_requests else [o for o in self.output_aggregator if o is not None]
        return outputs, not self.child_requests


def fan_out(request: EngineCoreRequest) -> list[tuple[ParentRequest | None, int, EngineCoreRequest]]:
    """(parent, index, child request) for each request to add: itself when n == 1, else its n children.

    NOTE: as in vLLM, the last child reuses the parent's EngineCoreRequest
    object and the others are shallow copies: the prompt token list is shared,
    not copied n times.
    """
    n = request.sampling_params.n
    if n == 1:
        return [(None, 0, request)]
    parent = ParentRequest(request)
    children: list[tuple[ParentRequest | None, int, EngineCoreRequest]] = []
    for index in range(n):
        child_req_id, child_params = parent.get_child_info(index)
        child = request if index == n - 1 else copy.copy(request)
        child.request_id = child_req_id
        child.sampling_params = child_params
        children.append((parent, index, child))
    return children
