"""SchedulerStepRecord: why schedule() did what it did, as plain data.

Teaching extra, not in vLLM (vLLM returns SchedulerOutput and SchedulerStats
only). The dashboard's step inspector draws the token-budget bar, the
per-request chunks and "why admission stopped" from this record; the scheduler
keeps the latest one as `scheduler.last_step_record`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm_anatomy.core.kv_cache_utils import KVCacheBlock
    from vllm_anatomy.core.request import Request


class _Code(str, Enum):
    """A reason code that is its own string: compares, prints and serializes as its value
    (enum.StrEnum does this from Python 3.11; requires-python admits 3.10)."""

    def __str__(self) -> str:
        return self.value


class AdmissionStop(_Code):
    """Why the WAITING loop stopped admitting requests this step.

    The one list of these codes: the scheduler sets them, a run records the
    value (`step_record.admission_stop_reason`, the same strings as before the
    enum existed, so old runs read), the dashboard explains it with
    `description`.
    """
    QUEUE_EMPTY = "queue_empty"
    BUDGET_EXHAUSTED = "budget_exhausted"
    MAX_NUM_SEQS = "max_num_seqs"
    NO_FREE_BLOCKS = "no_free_blocks"
    PREEMPTED_THIS_STEP = "preempted_this_step"
    CHUNKED_PREFILL_DISABLED = "chunked_prefill_disabled"

    @property
    def description(self) -> str:
        return _ADMISSION_STOP_DESCRIPTIONS[self]


_ADMISSION_STOP_DESCRIPTIONS = {
    AdmissionStop.QUEUE_EMPTY: "nobody was waiting",
    AdmissionStop.BUDGET_EXHAUSTED: "the token budget was spent (RUNNING requests are served first)",
    AdmissionStop.MAX_NUM_SEQS: "the running batch is full (max_num_seqs)",
    AdmissionStop.NO_FREE_BLOCKS: "allocate_slots refused the head of the waiting queue: no free KV blocks",
    AdmissionStop.PREEMPTED_THIS_STEP: "a request was preempted this step: no admissions",
    AdmissionStop.CHUNKED_PREFILL_DISABLED: "the head's prompt does not fit the remaining budget whole "
                                            "(chunked prefill is off)",
}


class DeferReason(_Code):
    """Why the WAITING loop passed over a request and went on with the ones
    behind it (it waits in skipped_waiting; recorded per request in
    `step_record.deferred_reasons`)."""
    GRAMMAR_COMPILING = "grammar_compiling"
    GRAMMAR_FAILED = "grammar_failed"
    STALE_OUTPUT_IN_FLIGHT = "stale_output_in_flight"

    @property
    def description(self) -> str:
        return _DEFER_REASON_DESCRIPTIONS[self]


_DEFER_REASON_DESCRIPTIONS = {
    DeferReason.GRAMMAR_COMPILING: "its structured-output grammar is still compiling",
    DeferReason.GRAMMAR_FAILED: "its grammar failed to compile: the next update finishes it with FINISHED_ERROR",
    DeferReason.STALE_OUTPUT_IN_FLIGHT: "async scheduling: preempted while a step was sampling its next token; "
                                        "it is readmitted once that token has arrived",
}

# What a scheduled chunk is, from the request's point of view.
ScheduledKind = Literal["prefill_chunk", "final_prefill_chunk", "decode", "resumed"]


@dataclass
class ScheduledRequestRecord:
    request_id: str
    num_tokens: int                   # scheduled this step (draft tokens included)
    kind: ScheduledKind
    num_computed_tokens_before: int   # where this chunk starts
    new_block_ids: list[int]          # blocks allocated this step (all blocks if new/resumed)
    draft_token_ids: list[int] = field(default_factory=list)   # spec decode: the drafts scheduled with it


@dataclass
class SpecDecodeRecord:
    """One request's draft verification in one step (spec decode; filled by update_from_output)."""
    request_id: str
    draft_token_ids: list[int]        # the drafts the step verified, at positions first_draft_position...
    num_accepted: int                 # how many of them the rejection sampler kept (a prefix)
    output_token_ids: list[int]       # what the step produced: the accepted drafts + one recovered/bonus token
    first_draft_position: int
    # The KV slots the rejected drafts' keys and values were written to. They stay
    # the request's: num_computed_tokens is rolled back, and the next step writes
    # the real tokens' KV over them (block_id * block_size + offset, as slot_mapping).
    rejected_slots: list[int] = field(default_factory=list)


@dataclass
class PrefixHitRecord:
    request_id: str
    num_query_tokens: int   # tokens looked up (the request's num_tokens)
    num_hit_tokens: int     # tokens found in the prefix cache (whole blocks)
    hit_block_ids: list[int]


@dataclass
class SchedulerStepRecord:
    step_id: int
    token_budget_start: int
    token_budget_end: int = 0
    scheduled: list[ScheduledRequestRecord] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    admission_stop_reason: AdmissionStop | None = None
    prefix_hits: list[PrefixHitRecord] = field(default_factory=list)
    # Waiting requests passed over this step: a preempted one whose output is
    # still in flight, or one whose grammar is still compiling.
    deferred_req_ids: list[str] = field(default_factory=list)
    deferred_reasons: dict[str, DeferReason] = field(default_factory=dict)   # request id -> why
    num_running: int = 0    # after this step's decisions
    num_waiting: int = 0    # waiting + skipped_waiting
    # Structured output: requests whose grammar finished compiling, promoted
    # WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR -> WAITING by this step.
    grammar_ready_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: each request's verification, added when the step's output is processed.
    spec_decode: list[SpecDecodeRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        # NOTE: msgspec walks dataclasses in C; dataclasses.asdict deep-copies
        # in Python, a cost paid every step at trace level full (what a step
        # snapshot costs: bench/results/tracing_breakdown_*.json).
        return msgspec.to_builtins(self)


def classify_chunk(num_computed_before: int, num_scheduled: int, num_tokens: int,
                   num_output_tokens: int, resumed: bool) -> ScheduledKind:
    """Name a scheduled chunk. NOTE: the scheduler itself has no such notion
    (no prefill/decode phases): this label is for the reader only."""
    if resumed:
        return "resumed"
    if num_computed_before + num_scheduled < num_tokens:
        return "prefill_chunk"
    if num_output_tokens > 0 and num_scheduled == 1 and num_computed_before == num_tokens - 1:
        return "decode"
    return "final_prefill_chunk"


def make_scheduled_record(request: Request, num_scheduled: int, new_block_ids: list[int],
                          resumed: bool, draft_token_ids: list[int] | None = None) -> ScheduledRequestRecord:
    """Record one scheduled request; call before num_computed_tokens is advanced."""
    # NOTE: placeholders (async scheduling) are tokens too, only not seen yet;
    # drafts are not (a decode with drafts is still a decode).
    num_placeholders = request.num_output_placeholders
    num_computed_tokens = request.num_computed_tokens
    drafts = draft_token_ids or []
    kind = classify_chunk(num_computed_tokens, num_scheduled - len(drafts), request.num_tokens + num_placeholders,
                          request.num_output_tokens + num_placeholders, resumed)
    return ScheduledRequestRecord(request.request_id, num_scheduled, kind, num_computed_tokens, new_block_ids,
                                  list(drafts))


def make_spec_decode_record(request: Request, draft_token_ids: list[int], output_token_ids: list[int],
                            blocks: Sequence[KVCacheBlock], block_size: int) -> SpecDecodeRecord:
    """Record a verification; call before num_computed_tokens is rolled back (the drafts are
    then the last len(draft_token_ids) positions computed)."""
    num_accepted = len(output_token_ids) - 1
    # (async scheduling: the next step's tokens, already scheduled, are still in flight)
    first = request.num_computed_tokens - request.num_in_flight_tokens - len(draft_token_ids)
    rejected = range(first + num_accepted, first + len(draft_token_ids))
    return SpecDecodeRecord(request.request_id, list(draft_token_ids), num_accepted, list(output_token_ids), first,
                            [blocks[pos // block_size].block_id * block_size + pos % block_size for pos in rejected])
