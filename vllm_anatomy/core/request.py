"""Request: the engine core's live object for one generation, and its state machine.

Mirrors vllm/v1/request.py. An EngineCoreRequest is flat data that crossed a
process boundary; a Request is what the scheduler mutates step after step
(status, num_computed_tokens, output tokens, block hashes).

Structured output: a request with SamplingParams.structured_outputs carries a
StructuredOutputRequest (its constraint and its grammar, compiling) and starts
in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR instead of WAITING.

Simplified: no pooling, LoRA, multimodal, prompt embeds, KV transfer or
streaming-input sessions: vLLM's arguments for those are accepted only in
their "none" value (pooling_params=None, mm_features empty, lora_request=None,
...). Async scheduling keeps vLLM's num_output_placeholders,
num_in_flight_tokens and num_stale_output_tokens (see core/sched/async_scheduler.py).
"""
from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from vllm_anatomy.engine.protocol import (EngineCoreEvent, EngineCoreEventType, EngineCoreRequest,
                                          FinishReason)
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from vllm_anatomy.core.kv_cache_utils import BlockHash, RequestBlockHasher

T = TypeVar("T")


class ConstantList(Sequence[T]):
    """A read-only view of a list (vllm/v1/utils.py).

    NOTE: output tokens must only grow through append_output_token_ids, which
    also extends block_hashes; handing out the raw list would let a caller
    append behind the hasher's back.
    """
    __slots__ = ("_x",)

    def __init__(self, x: list[T]) -> None:
        self._x = x

    def __getitem__(self, item):
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self) -> Iterator[T]:
        return iter(self._x)

    def __repr__(self) -> str:
        return f"ConstantList({self._x})"


class RequestStatus(enum.IntEnum):
    """Status of a request. NOTE: the order matters: see is_finished()."""
    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()  # its grammar is still compiling
    WAITING_FOR_REMOTE_KVS = enum.auto()                 # unused here: no KV connector
    WAITING_FOR_STREAMING_REQ = enum.auto()              # unused here: no streaming input
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # NOTE: anything after PREEMPTED is a finished status.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASON_MAP.get(status)


# The finish reason the frontend (OpenAI API) sees for each terminal status.
_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # NOTE: a prompt longer than the model's context: OpenAI calls that "length".
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
    # NOTE: vLLM maps this non-finished status too: a streaming-input chunk ends with "stop".
    RequestStatus.WAITING_FOR_STREAMING_REQ: FinishReason.STOP,
}
_PREEMPTED = RequestStatus.PREEMPTED    # the last unfinished status (see Request.is_finished)


class Request:
    """One request inside the engine core (plain class, mutated in place)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        pooling_params: None = None,
        client_index: int = 0,
        arrival_time: float | None = None,
        prompt_embeds: None = None,
        prompt_is_token_ids: None = None,
        mm_features: list | None = None,
        lora_request: None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
        block_hasher: RequestBlockHasher | None = None,
        resumable: bool = False,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
        abort_immediately: bool = False,
    ) -> None:
        # NOTE: vLLM's pooling models (embeddings), prompt embeddings, images
        # (mm_features), LoRA adapters, streaming-input sessions (resumable),
        # reasoning parsers and KV connectors' abort-at-once requests have no
        # counterpart here: only their "none" values are accepted.
        if pooling_params is not None or prompt_embeds is not None or prompt_is_token_ids is not None \
                or mm_features or lora_request is not None or resumable or abort_immediately:
            raise NotImplementedError("pooling, prompt embeddings, multimodal inputs, LoRA and streaming "
                                      "input are not implemented here")
        if sampling_params is None:
            raise ValueError("sampling_params and pooling_params can't both be unset")
        self.request_id = request_id
        self.client_index = client_index
        # Lower is scheduled first under the priority policy (then arrival_time).
        self.priority = priority
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.lora_request = lora_request
        self.structured_output_request = StructuredOutputRequest.from_sampling_params(sampling_params)
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        # NOTE: a structured request cannot be scheduled before its grammar exists.
        self.status = (RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                       if self.structured_output_request is not None else RequestStatus.WAITING)
        self.events: list[EngineCoreEvent] = []
        self.stop_reason: int | str | None = None
        # NOTE: P/D disaggregation's per-request KV transfer parameters; none here.
        self.kv_transfer_params: dict[str, Any] | None = None
        # NOTE: the frontend fills max_tokens (max_model_len - prompt) when the
        # user gives none; None here means "no cap but max_model_len".
        self.max_tokens = sampling_params.max_tokens
        self.cache_salt = cache_salt
        self.trace_headers = trace_headers
        self.mm_features: list = []
        self.prompt_embeds = prompt_embeds
        self.resumable = resumable
        # A request asking for prompt logprobs computes every prompt token:
        # it must not start from cached blocks (KVCacheManager.get_computed_blocks).
        self.skip_reading_prefix_cache = self.get_skip_reading_prefix_cache()

        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)
        # NOTE: vLLM's num_tokens and num_output_tokens are properties over
        # len(); here they are counters that append_output_token_ids (the only
        # way tokens are added) keeps equal to those lengths. The scheduler
        # reads them several times per request per step, and on Python 3.11 a
        # property read costs ~0.1 us, ten times an attribute read.
        self.num_tokens = len(self._all_token_ids)
        self.num_output_tokens = 0
        # Speculative decoding: the draft tokens to verify next step (set by
        # Scheduler.update_draft_token_ids; emptied when scheduled or preempted).
        self.spec_token_ids: list[int] = []
        # How many of all_token_ids have KV in the cache (advanced optimistically by the scheduler).
        self.num_computed_tokens = 0
        # Prefix-cache hit at first admission (-1 until first scheduled).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # True when the last scheduled chunk ended before the prompt's end.
        self.is_prefill_chunk = False
        # Async scheduling: tokens already scheduled whose values the scheduler
        # has not seen yet (their steps are still in flight).
        self.num_output_placeholders = 0
        # Tokens scheduled in steps whose output update_from_output has not
        # processed yet (0 between steps without async scheduling).
        self.num_in_flight_tokens = 0
        # Async scheduling: the share of num_in_flight_tokens scheduled before
        # the request was preempted. Their sampled tokens are still delivered
        # (they are real samples), but must not touch the reset counters; the
        # request is not readmitted until they have all arrived.
        self.num_stale_output_tokens = 0
        # ... unless the preemption dropped them (reset_prefix_cache with running
        # requests resumes them at once: a late token would land out of order).
        self.drop_stale_output = False
        # NOTE: hybrid models mark a shared prefix worth keeping cached (see
        # KVCacheManager.get_computed_blocks); always 0 here.
        self.shared_prefix_boundary = 0
        # NaNs the model produced in this request's logits (vLLM counts them
        # with VLLM_COMPUTE_NANS_IN_LOGITS); not counted here.
        self.num_nans_in_logits = 0

        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        # How many tokens complete the next block (set by update_block_hashes).
        self._num_tokens_next_full_block = 0
        self.update_block_hashes()

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, block_hasher: RequestBlockHasher | None
    ) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            arrival_time=request.arrival_time,
            client_index=request.client_index,
            priority=request.priority,
            cache_salt=request.cache_salt,
            trace_headers=request.trace_headers,
            block_hasher=block_hasher,
        )

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
            # (the lengths below, counted: these lists change only here)
            self.num_tokens += 1
            self.num_output_tokens += 1
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
            self.num_tokens = len(self._all_token_ids)
            self.num_output_tokens = len(self._output_token_ids)
        # NOTE: hash every block the new tokens completed, right now, so that
        # the KV manager can cache it without recomputing anything. An append
        # that completes no block cannot add a hash and skips the hasher (a
        # decode appends one token: block_size - 1 times out of block_size).
        if self.num_tokens >= self._num_tokens_next_full_block:
            self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))
            self._num_tokens_next_full_block = (len(self.block_hashes) + 1) * self._block_hasher.block_size

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def num_encoder_inputs(self) -> int:
        return len(self.mm_features)

    @property
    def has_encoder_inputs(self) -> bool:
        """NOTE: images / audio a multimodal model encodes first; never here."""
        return self.num_encoder_inputs > 0

    def get_skip_reading_prefix_cache(self) -> bool:
        skip = self.sampling_params.skip_reading_prefix_cache
        return skip if skip is not None else False

    # NOTE: both run for every request every step. They read module-level
    # names rather than RequestStatus.X: on Python 3.11 each attribute read on
    # an Enum class costs ~0.13 us (EnumType.__getattr__ defeats the attribute
    # cache; ~0.04 us on 3.12), as much as the rest of the call.
    def is_finished(self) -> bool:
        return self.status > _PREEMPTED     # RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISHED_REASON_MAP.get(self.status)    # RequestStatus.get_finished_reason

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        self.events.append(EngineCoreEvent.new_event(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """Return and clear the recorded events (None if there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def snapshot(self, block_ids: list[int] | None = None) -> dict[str, Any]:
        """Plain data for the dashboard (teaching extra, not in vLLM).

        NOTE: built for every queued request every step at trace level full,
        hence `_name_` (a plain attribute; `.name` is a property).
        """
        return {
            "request_id": self.request_id,
            "status": self.status._name_,
            "num_tokens": self.num_tokens,
            "num_computed_tokens": self.num_computed_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_output_placeholders": self.num_output_placeholders,
            "num_stale_output_tokens": self.num_stale_output_tokens,
            "num_preemptions": self.num_preemptions,
            "num_cached_tokens": self.num_cached_tokens,
            "block_ids": block_ids if block_ids is not None else [],
            "spec_token_ids": list(self.spec_token_ids),
        }

    def __lt__(self, other: Request) -> bool:
        """The priority policy's order: lower priority value, then earlier arrival,
        then request id (then identity: a strict order for the heap)."""
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return id(self) < id(other)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")
