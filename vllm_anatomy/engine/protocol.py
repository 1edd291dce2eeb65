"""The records that cross the frontend <-> EngineCore boundary.

Mirrors vllm/v1/engine/__init__.py. These are msgspec Structs so that they go
over a ZMQ socket as msgpack (never pickle). `array_like=True` encodes a struct
as a positional array: smaller and faster, at the cost of field order mattering.
"""
from __future__ import annotations

import enum
import time

import msgspec

from vllm_anatomy.core.outputs import LogprobsLists, LogprobsTensors
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.spec_decode.metrics import SpecDecodingStats


class FinishReason(enum.IntEnum):
    """Why a request finished. An int on the wire; `str()` gives OpenAI's word."""
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return FINISH_REASON_STRINGS[self.value]


FINISH_REASON_STRINGS = ("stop", "length", "abort", "error", "repetition")


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    client_index: int = 0
    priority: int = 0
    # W3C trace context (traceparent / tracestate) carried across processes.
    trace_headers: dict[str, str] | None = None
    # The id the user gave; `request_id` may be made unique by the frontend.
    external_req_id: str | None = None


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped request state change, on the engine process' monotonic clock."""
    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: float | None = None) -> "EngineCoreEvent":
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    # The request's rows of the step's logprobs (LogprobsLists.slice_request):
    # row i belongs to new_token_ids[i]; columns [sampled, top-1, ..., top-k],
    # k the largest `logprobs` of that step's batch (the frontend keeps its own k).
    new_logprobs: LogprobsLists | None = None
    # With the first output token: the prompt's logprobs (row i: prompt token i + 1).
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    trace_headers: dict[str, str] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True, gc=False):
    """A snapshot of scheduler state after a step (v1/metrics/stats.py)."""
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0   # length of the "skipped waiting" queue
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    # Prefix cache stats for this step, counted in tokens (queries, hits).
    prefix_cache_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding: this step's drafts and acceptances (None without drafts).
    spec_decoding_stats: SpecDecodingStats | None = None
    # NOTE: no preemption count here (as in v0.27.1): preemptions are counted
    # by the frontend from each request's PREEMPTED event (IterationStats), so
    # they land with the outputs that carry them, whichever step scheduled them.


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Ids finished in the engine this step (incl. aborted ones).
    finished_requests: set[str] | None = None
    # Ours (not in vLLM, which traces no step): the W3C context of the last span that
    # handled these outputs (the step that made them, then each hop): the next hop's
    # span follows from it, in the step's trace (tracing/step_tracer.py). None untraced.
    trace_headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()
