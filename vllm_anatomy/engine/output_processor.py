"""OutputProcessor: EngineCoreOutputs -> RequestOutputs, on the frontend.

Mirrors vllm/v1/engine/output_processor.py. Per request it keeps a
RequestState (detokenizer, logprobs, timestamps). `process_outputs` is the one
per-batch Python loop of the frontend: detokenize the new tokens, check stop
strings, build RequestOutputs, and collect the ids to abort in the engine
(requests that a stop string finished here but that the engine still runs).

With AsyncLLM each request also has a RequestOutputCollector (its `queue`):
outputs are put there instead of being returned. `process_outputs` also fills
an IterationStats (vllm_anatomy/metrics/stats.py) for the stat loggers, and
tells the request tracer (tracing/request_tracer.py; a no-op one when tracing
is off) what changed for a request: its engine events, its first token, its
finish (vLLM: OutputProcessor.do_tracing, at the finish).

Parallel sampling (n > 1): each child request has its own RequestState, with
the ParentRequest (engine/parallel_sampling.py) that turns the children's
outputs into the parent's: its `request_index` is the CompletionOutput's
index, and the parent decides what goes out (every child output as it comes
when streaming; one RequestOutput with all n at the end for FINAL_ONLY). The
children of one parent share one collector.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from vllm_anatomy.engine.detokenizer import IncrementalDetokenizer
from vllm_anatomy.core.outputs import LogprobsLists, LogprobsTensors
from vllm_anatomy.engine.parallel_sampling import ParentRequest
from vllm_anatomy.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_anatomy.metrics.stats import IterationStats, RequestStateStats
from vllm_anatomy.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from vllm_anatomy.sampling_params import RequestOutputKind
from vllm_anatomy.tracing.request_tracer import NULL_REQUEST_TRACER, NullRequestTracer, RequestTracer

# NOTE: read per request per step in process_outputs: a module-level name, not
# RequestOutputKind.FINAL_ONLY (an Enum class attribute read costs ~0.13 us on
# Python 3.11; see Request.is_finished).
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


class RequestOutputCollector:
    """Single-slot mailbox between the output handler and one generate() call.

    NOTE: `put` never blocks and never queues up: if the consumer has not taken
    the pending output yet, the new one is merged into it (DELTA: text, token
    ids and logprobs concatenated; otherwise the newer output replaces it). A
    slow consumer thus gets coalesced outputs and the producer, which serves
    every request, never waits for one of them. An exception replaces the slot.
    """

    def __init__(self, output_kind: RequestOutputKind, request_id: str) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.request_id = request_id
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            _merge_request_output(self.output, output, self.aggregate)
        # else: an exception is pending; it wins over later outputs.

    async def get(self) -> RequestOutput:
        while (output := self.output) is None:
            await self.ready.wait()
        return self._take(output)

    def get_nowait(self) -> RequestOutput | None:
        output = self.output
        return None if output is None else self._take(output)

    def _take(self, output: RequestOutput | Exception) -> RequestOutput:
        self.output = None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


def _merge_request_output(pending: RequestOutput, new: RequestOutput, aggregate: bool) -> None:
    """Fold `new` into the not-yet-consumed `pending` (vLLM: RequestOutput.add).

    NOTE: outputs are matched by their index, not their position: with n > 1
    each child's outputs arrive on their own, so `new` may carry child 2's
    output while `pending` holds child 0's (then it is appended)."""
    pending.finished |= new.finished
    pending.metrics = new.metrics
    pending.num_cached_tokens = new.num_cached_tokens
    for completion in new.outputs:
        i = next((i for i, old in enumerate(pending.outputs) if old.index == completion.index), None)
        if i is None:
            pending.outputs.append(completion)
            continue
        if not aggregate:
            pending.outputs[i] = completion
            continue
        old = pending.outputs[i]
        old.text += completion.text
        old.token_ids = old.token_ids + completion.token_ids
        if completion.logprobs is not None:
            old.logprobs = (old.logprobs or []) + completion.logprobs
        old.cumulative_logprob = completion.cumulative_logprob
        old.finish_reason = completion.finish_reason
        old.stop_reason = completion.stop_reason


@dataclass
class RequestState:
    request_id: str
    external_req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    num_logprobs: int | None
    metrics: RequestMetrics
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # The prompt's logprobs (SamplingParams.prompt_logprobs), once they arrive with the first token.
    prompt_logprobs: PromptLogprobs | None = None
    sent_prompt_logprobs: bool = False
    cumulative_logprob: float = 0.0
    sent_text_len: int = 0
    sent_token_len: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    queue: RequestOutputCollector | None = None      # AsyncLLM only
    max_tokens_param: int | None = None
    is_prefilling: bool = True                        # until the first token arrives
    stats: RequestStateStats = field(default_factory=RequestStateStats)
    # Parallel sampling: the parent of this child request, and its index among the n.
    parent_req: ParentRequest | None = None
    request_index: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]


class OutputProcessor:

    def __init__(self, tokenizer, request_tracer: RequestTracer | NullRequestTracer = NULL_REQUEST_TRACER) -> None:
        self.tokenizer = tokenizer
        self.request_tracer = request_tracer
        self.request_states: dict[str, RequestState] = {}
        # The caller's id -> the engine's ids made from it (InputProcessor.assign_request_id).
        self.external_req_ids: dict[str, list[str]] = {}
        # Parents of n > 1 requests (by the parent's request id), while a child is unfinished.
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(self, request: EngineCoreRequest, prompt: str | None,
                    queue: RequestOutputCollector | None = None, parent_req: ParentRequest | None = None,
                    request_index: int = 0) -> None:
        """Start following one request (with n > 1: one child, its parent and its index)."""
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id} already running.")
        params = request.sampling_params
        # NOTE: a child reports its parent's caller id (the offline LLMEngine sets none: the parent's own).
        external_req_id = parent_req.external_req_id if parent_req is not None else \
            (request.external_req_id or request.request_id)
        self.external_req_ids.setdefault(external_req_id, []).append(request.request_id)
        self.request_states[request.request_id] = RequestState(
            request_id=request.request_id,
            external_req_id=external_req_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=params.output_kind,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
            num_logprobs=params.logprobs,
            metrics=RequestMetrics(arrival_time=time.monotonic()),
            queue=queue,
            max_tokens_param=params.max_tokens,
            stats=RequestStateStats(arrival_time=request.arrival_time),
            parent_req=parent_req,
            request_index=request_index,
        )
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req

    def abort_requests(self, request_ids: list[str], trace_reason: str = "abort") -> list[str]:
        """Forget these requests; returns the engine ids that were known.

        An id is the engine's (internal) id, the caller's (external) one,
        which aborts every request made from it (vLLM: `internal=False`), or
        an n > 1 parent's id, which aborts its unfinished children.
        NOTE: a request with a collector gets a last output, finish_reason
        "abort", so that a generate() waiting on it ends instead of hanging.
        trace_reason: the finish reason its trace records ("error": refused, or the engine died).
        """
        aborted = []
        for rid in self._internal_ids(request_ids):
            state = self._pop_state(rid)
            if state is None:
                continue
            aborted.append(rid)
            self.request_tracer.finish(rid, trace_reason, state.metrics.num_generation_tokens)
            state.finish_reason = str(FinishReason.ABORT)
            state.metrics.finished_time = time.monotonic()
            # NOTE: built even without a collector: a child's parent must see it end.
            out = self._make_request_output(state)
            if out is not None and state.queue is not None:
                state.queue.put(out)
            self._release_parent(state)
        return aborted

    def _internal_ids(self, request_ids: list[str]) -> list[str]:
        ids: list[str] = []
        for rid in request_ids:
            if rid in self.request_states:
                ids.append(rid)
            elif (parent := self.parent_requests.get(rid)) is not None:
                ids.extend(c for c in sorted(parent.child_requests) if c in self.request_states)
            else:
                ids.extend(self.external_req_ids.get(rid, ()))
        return ids

    def _release_parent(self, state: RequestState) -> None:
        """Forget a child's parent once none of its children is followed any more."""
        parent = state.parent_req
        if parent is not None and not any(c in self.request_states for c in parent.child_requests):
            self.parent_requests.pop(parent.request_id, None)

    def _pop_state(self, request_id: str) -> RequestState | None:
        state = self.request_states.pop(request_id, None)
        if state is not None:
            siblings = self.external_req_ids.get(state.external_req_id, [])
            if request_id in siblings:
                siblings.remove(request_id)
            if not siblings:
                self.external_req_ids.pop(state.external_req_id, None)
        return state

    def propagate_error(self, e: Exception) -> None:
        """Hand an error (e.g. EngineDeadError) to every waiting generate()."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.put(e)

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput],
                        engine_core_timestamp: float | None = None,
                        iteration_stats: IterationStats | None = None) -> OutputProcessorOutput:
        """Detokenize, stop-check and deliver one batch; the frontend's only per-batch loop.

        Outputs of requests with a collector are put there; the others are returned.
        """
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        now = time.monotonic()
        engine_core_timestamp = now if engine_core_timestamp is None else engine_core_timestamp
        request_states, tracer = self.request_states, self.request_tracer
        for eco in engine_core_outputs:
            state = request_states.get(eco.request_id)
            if state is None:   # aborted by the user while in flight
                continue
            new_token_ids = eco.new_token_ids
            # 1) Stats and timestamps (and the trace, where something changed).
            if iteration_stats is not None:
                iteration_stats.update_from_output(eco, engine_core_timestamp, state.is_prefilling,
                                                   len(state.prompt_token_ids), state.stats)
            if eco.events:
                tracer.on_engine_events(eco.request_id, eco.events)
            if new_token_ids:
                self._update_metrics(state, eco, now)
            # 2) Detokenize, check stop strings.
            finish_reason = eco.finish_reason
            stop_reason = eco.stop_reason
            stop_terminated = finish_reason is not None and finish_reason == FinishReason.STOP
            stop_str = state.detokenizer.update(new_token_ids, stop_terminated)
            if stop_str is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_str
                # NOTE: the stop string may end before the last new token; keep
                # token_ids consistent with the text as vLLM does (trim surplus).
                self._trim_tokens_after_stop(state)
            if eco.new_logprobs is not None:
                self._append_logprobs(state, eco.new_logprobs)
            if eco.new_prompt_logprobs_tensors is not None:
                self._set_prompt_logprobs(state, eco.new_prompt_logprobs_tensors)
            if finish_reason is None:
                if state.output_kind == _FINAL_ONLY:
                    continue    # LLM.generate(): nothing to build before the request finishes
            else:
                self._finish_request(state, eco, finish_reason, stop_reason, now, iteration_stats, reqs_to_abort)
            # 3) The RequestOutput: into the request's collector, or returned.
            out = self._make_request_output(state)
            if finish_reason is not None:
                self._release_parent(state)
            if out is None:
                continue
            if state.queue is not None:
                state.queue.put(out)
            else:
                request_outputs.append(out)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def _finish_request(self, state: RequestState, eco: EngineCoreOutput, finish_reason: FinishReason,
                        stop_reason: int | str | None, now: float, iteration_stats: IterationStats | None,
                        reqs_to_abort: list[str]) -> None:
        state.finish_reason = str(finish_reason)
        state.stop_reason = stop_reason
        state.metrics.finished_time = now
        self._pop_state(state.request_id)
        self.request_tracer.finish(state.request_id, state.finish_reason, state.metrics.num_generation_tokens)
        if not eco.finished:  # finished here (stop string), engine still runs it
            reqs_to_abort.append(state.request_id)
        if iteration_stats is not None:
            iteration_stats.update_from_finished_request(
                state.finish_reason, len(state.prompt_token_ids), state.max_tokens_param,
                state.stats, state.num_cached_tokens)

    def _update_metrics(self, state: RequestState, eco: EngineCoreOutput, now: float) -> None:
        """A new token arrived: the request is no longer prefilling; its timestamps move."""
        m = state.metrics
        if state.is_prefilling:
            self.request_tracer.on_first_token(state.request_id)
            state.is_prefilling = False
            m.first_token_time = now
            state.num_cached_tokens = eco.num_cached_tokens
        m.last_token_time = now
        m.num_generation_tokens += len(eco.new_token_ids)

    @staticmethod
    def _trim_tokens_after_stop(state: RequestState) -> None:
        det = state.detokenizer
        # Keep the shortest token prefix whose decoding still covers the kept text.
        text_len = len(det.output_text)
        for n in range(1, len(det.token_ids) + 1):
            if len(det.tokenizer.decode(det.token_ids[:n], skip_special_tokens=det.skip_special_tokens)) >= text_len:
                del det.token_ids[n:]
                return

    def _logprob_entry(self, ids: list[int], vals: list[float], rank: int) -> dict[int, Logprob]:
        """One position: the scored token (its rank) then the top-n (ranks 1..n)."""
        entry: dict[int, Logprob] = {}
        for i, (tid, val) in enumerate(zip(ids, vals)):
            if tid in entry:
                continue
            entry[tid] = Logprob(val, rank if i == 0 else i, self.tokenizer.decode([tid]))
        return entry

    def _append_logprobs(self, state: RequestState, lp: LogprobsLists) -> None:
        # NOTE: the step's rows are as wide as the batch's largest `logprobs`:
        # keep this request's own top-n (+1: the sampled token).
        assert state.num_logprobs is not None
        width = state.num_logprobs + 1
        ids_rows, val_rows = lp.logprob_token_ids[:, :width].tolist(), lp.logprobs[:, :width].tolist()
        for ids, vals, rank in zip(ids_rows, val_rows, lp.sampled_token_ranks.tolist()):
            state.logprobs.append(self._logprob_entry(ids, vals, rank))
            state.cumulative_logprob += vals[0]

    def _set_prompt_logprobs(self, state: RequestState, tensors: LogprobsTensors) -> None:
        """All of the prompt's logprobs at once (they come with the first output token)."""
        ids_rows, val_rows = tensors.logprob_token_ids.tolist(), tensors.logprobs.tolist()
        state.prompt_logprobs = [None] + [self._logprob_entry(ids, vals, rank) for ids, vals, rank
                                          in zip(ids_rows, val_rows, tensors.selected_token_ranks.tolist())]

    def _make_request_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finished
        kind = state.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        det = state.detokenizer
        text = det.get_next_output_text(finished, delta, state.sent_text_len)
        token_ids = det.token_ids[state.sent_token_len:] if delta else list(det.token_ids)
        logprobs = state.logprobs[state.sent_token_len:] if delta else list(state.logprobs)
        state.sent_text_len = state.sent_text_len + len(text) if delta else len(text)
        state.sent_token_len = len(det.token_ids)
        completion = CompletionOutput(
            index=state.request_index, text=text, token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob if state.num_logprobs is not None else None,
            logprobs=logprobs if state.num_logprobs is not None else None,
            finish_reason=state.finish_reason, stop_reason=state.stop_reason)
        # (a delta stream carries the prompt's logprobs once, in the first output that has them)
        prompt_logprobs = state.prompt_logprobs
        if delta and state.sent_prompt_logprobs:
            prompt_logprobs = None
        outputs = [completion]
        if state.parent_req is not None:
            outputs, finished = state.parent_req.get_outputs(state.request_id, completion)
            if not outputs:
                return None
        state.sent_prompt_logprobs |= prompt_logprobs is not None
        return RequestOutput(request_id=state.external_req_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, prompt_logprobs=prompt_logprobs,
                             outputs=outputs,
                             finished=finished, num_cached_tokens=state.num_cached_tokens,
                             metrics=state.metrics)
