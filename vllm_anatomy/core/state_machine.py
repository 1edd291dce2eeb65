"""The request state machine as data: every RequestStatus, every transition the
article draws (§四.1) and the ones this engine adds, what in the code makes each
happen, and which statuses this engine never enters (and why).

Teaching extra, not in vLLM (vLLM's states live only in the code that sets them).
The dashboard draws its diagram from these definitions, and
tests/unit/test_state_machine.py drives the real scheduler and checks that every
status change it observes is declared here, and that every transition marked
`used` does happen.

NOTE: the article draws two moves as two edges through WAITING, where the code
takes one step: a preempted request keeps the status PREEMPTED while it sits in
the waiting queue and becomes RUNNING when rescheduled (the article:
PREEMPTED → WAITING → RUNNING), and a structured-output request is created
directly in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR (the article: WAITING → …).
ARTICLE_PATHS maps each such code move to the edges drawn for it (one more, not
in the article: a prompt too long is finished on arrival, drawn through WAITING).

The one definition the dashboard draws from: the statuses (RequestStatus, with
STATUS_DESCRIPTIONS), the transitions (STATUS_TRANSITIONS), and the
finish-reason mapping (FINISH_REASONS, read
from RequestStatus.get_finished_reason, where vLLM keeps it, and its inverse
for queued requests, finished_status_of).
"""
from __future__ import annotations

from typing import NamedTuple

from vllm_anatomy.core.request import RequestStatus

ARRIVAL = "ARRIVAL"   # not a status: the point a request enters from


class StatusTransition(NamedTuple):
    source: str        # a RequestStatus name, or ARRIVAL
    target: str        # a RequestStatus name
    label: str         # short, as the article labels the edge (in English)
    how: str           # what in this engine makes it happen
    in_article: bool   # drawn in the article's diagram
    used: bool         # this engine can take it


S = RequestStatus
STATUS_TRANSITIONS: tuple[StatusTransition, ...] = (
    StatusTransition(ARRIVAL, S.WAITING.name, "request arrives",
                     "Scheduler.add_request appends it to the waiting queue (FCFS)", True, True),
    StatusTransition(S.WAITING.name, S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name, "needs a grammar",
                     "a structured-output request is created in this status; StructuredOutputManager.grammar_init "
                     "compiles its grammar in a thread pool", True, True),
    StatusTransition(S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name, S.WAITING.name, "grammar compiled",
                     "schedule() promotes it once the compile has finished", True, True),
    StatusTransition(S.WAITING.name, S.WAITING_FOR_REMOTE_KVS.name, "P/D: await KV transfer",
                     "not here: no KV connector (disaggregated prefill)", True, False),
    StatusTransition(S.WAITING_FOR_REMOTE_KVS.name, S.RUNNING.name, "KV loaded",
                     "not here: no KV connector", True, False),
    StatusTransition(S.WAITING.name, S.RUNNING.name, "scheduled, KV blocks allocated",
                     "schedule()'s waiting loop: a token budget and allocate_slots() blocks", True, True),
    StatusTransition(S.RUNNING.name, S.RUNNING.name, "next chunk / decode",
                     "schedule()'s running loop gives it more tokens every step", True, True),
    StatusTransition(S.RUNNING.name, S.PREEMPTED.name, "no free block: preempted",
                     "allocate_slots() found no free block: _preempt_request frees the blocks of running[-1], "
                     "resets num_computed_tokens to 0 and puts it at the front of the waiting queue", True, True),
    StatusTransition(S.PREEMPTED.name, S.WAITING.name, "requeued (recompute)",
                     "it is in the waiting queue already, still labelled PREEMPTED; rescheduled, it becomes "
                     "RUNNING and recomputes its tokens (prefix-cache hits help)", True, True),
    StatusTransition(S.RUNNING.name, S.FINISHED_STOPPED.name, "stop token",
                     "update_from_output: EOS or a stop token id (check_stop); a stop string, in the frontend", True,
                     True),
    StatusTransition(S.RUNNING.name, S.FINISHED_LENGTH_CAPPED.name, "max_tokens",
                     "update_from_output: max_tokens or max_model_len reached (check_stop)", True, True),
    StatusTransition(S.RUNNING.name, S.FINISHED_ABORTED.name, "cancelled by the user",
                     "finish_requests(FINISHED_ABORTED): the client went away or a stop string matched", True, True),
    StatusTransition(S.RUNNING.name, S.FINISHED_ERROR.name, "runtime error",
                     "the worker could not run this request alone (ModelRunnerOutput.error_req_ids), or its grammar "
                     "refused a sampled token", True, True),
    StatusTransition(S.RUNNING.name, S.FINISHED_REPETITION.name, "repetition detected",
                     "not here: no repetition detection", True, False),
    StatusTransition(S.RUNNING.name, S.WAITING_FOR_STREAMING_REQ.name, "streaming session pauses",
                     "not here: no streaming-input sessions", True, False),
    StatusTransition(S.WAITING_FOR_STREAMING_REQ.name, S.WAITING.name, "new input arrives",
                     "not here: no streaming-input sessions", True, False),
    # Not in the article's diagram, but taken by this engine (and by vLLM):
    StatusTransition(S.WAITING.name, S.FINISHED_ABORTED.name, "cancelled while waiting",
                     "finish_requests(FINISHED_ABORTED) on a request still in the waiting queue", False, True),
    StatusTransition(S.WAITING.name, S.FINISHED_IGNORED.name, "prompt too long",
                     "Scheduler.add_request: a prompt longer than max_model_len is finished on arrival, never "
                     "queued or scheduled", False, True),
    StatusTransition(S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name, S.FINISHED_ERROR.name, "grammar failed",
                     "a grammar that does not compile finishes its request alone", False, True),
    StatusTransition(S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name, S.FINISHED_ABORTED.name, "cancelled",
                     "finish_requests(FINISHED_ABORTED) while its grammar compiles", False, True),
    StatusTransition(S.PREEMPTED.name, S.FINISHED_ABORTED.name, "cancelled while preempted",
                     "finish_requests(FINISHED_ABORTED) on a preempted request in the waiting queue", False, True),
    StatusTransition(S.PREEMPTED.name, S.FINISHED_LENGTH_CAPPED.name, "last token arrives late",
                     "async scheduling: a token sampled before the preemption is delivered after it "
                     "(num_stale_output_tokens) and reaches max_tokens", False, True),
    StatusTransition(S.PREEMPTED.name, S.FINISHED_STOPPED.name, "stop token arrives late",
                     "async scheduling: a stale token delivered after the preemption is EOS or a stop token", False,
                     True),
)

# Code moves (from, to) that the diagram draws as a path of two edges.
ARTICLE_PATHS: dict[tuple[str, str], tuple[str, ...]] = {
    (S.PREEMPTED.name, S.RUNNING.name): (S.PREEMPTED.name, S.WAITING.name, S.RUNNING.name),
    (ARRIVAL, S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name):
        (ARRIVAL, S.WAITING.name, S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name),
    (ARRIVAL, S.FINISHED_IGNORED.name): (ARRIVAL, S.WAITING.name, S.FINISHED_IGNORED.name),
    # Promoted and scheduled in the same schedule() call.
    (S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name, S.RUNNING.name):
        (S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name, S.WAITING.name, S.RUNNING.name),
}

# Edges the article draws that the code only ever takes as part of such a path.
PATH_ONLY_EDGES: frozenset[tuple[str, str]] = frozenset({
    (S.PREEMPTED.name, S.WAITING.name), (S.WAITING.name, S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name),
    (S.WAITING.name, S.FINISHED_IGNORED.name)})

# Statuses this engine never enters, and why (greyed in the dashboard's diagram).
UNUSED_STATUSES: dict[str, str] = {
    S.WAITING_FOR_REMOTE_KVS.name: "no KV connector: prefill and decode run on the same engine "
                                   "(vLLM's P/D disaggregation waits here for KV from another instance)",
    S.WAITING_FOR_STREAMING_REQ.name: "no streaming-input sessions (vLLM pauses a session here until its next "
                                      "input chunk arrives)",
    S.FINISHED_REPETITION.name: "no repetition detection (vLLM can stop a request that repeats itself)",
}


# One line per status: what a request in it is doing.
STATUS_DESCRIPTIONS: dict[str, str] = {
    S.WAITING.name: "in the waiting queue, no KV blocks yet",
    S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name: "its grammar compiles in a thread pool; passed over meanwhile",
    S.RUNNING.name: "scheduled every step, holds KV blocks",
    S.PREEMPTED.name: "evicted from the running batch, in the waiting queue to be recomputed",
    S.FINISHED_STOPPED.name: "finished on EOS / a stop token",
    S.FINISHED_LENGTH_CAPPED.name: "finished on max_tokens",
    S.FINISHED_ABORTED.name: "cancelled",
    S.FINISHED_IGNORED.name: "prompt longer than max_model_len: never scheduled",
    S.FINISHED_ERROR.name: "failed alone (the others went on)",
    **{name: f"not entered by this engine: {why}" for name, why in UNUSED_STATUSES.items()},
}

# The finish reason the frontend (OpenAI API) sees for each finished status
# ("stop", "length", ...): RequestStatus.get_finished_reason as data.
FINISH_REASONS: dict[str, str] = {
    status.name: str(RequestStatus.get_finished_reason(status))
    for status in RequestStatus if RequestStatus.is_finished(status)}

# Finished statuses that a request in the scheduler's queues can never reach:
# a prompt longer than max_model_len is finished on arrival, never queued.
NEVER_FROM_A_QUEUE = frozenset({S.FINISHED_IGNORED.name})


def finished_status_of(finish_reason: str) -> str:
    """The status a request that left the scheduler's queues finished with, from
    the finish reason its output carried.

    NOTE: status -> finish reason is not invertible: FINISHED_LENGTH_CAPPED and
    FINISHED_IGNORED both give "length". But FINISHED_IGNORED is set on
    arrival, never on a queued request, and among the statuses a queued request
    can finish with each reason names exactly one (checked at import).
    """
    return _QUEUED_FINISH_STATUS[finish_reason]


_QUEUED_FINISH_STATUS: dict[str, str] = {
    reason: name for name, reason in FINISH_REASONS.items() if name not in NEVER_FROM_A_QUEUE}
assert len(_QUEUED_FINISH_STATUS) == len(FINISH_REASONS) - len(NEVER_FROM_A_QUEUE), \
    "two statuses a queued request can finish with share a finish reason"


def declared_moves() -> set[tuple[str, str]]:
    """Every (from, to) status change the engine may make, as one step sees it: the
    used edges, except those the code never takes on their own (PATH_ONLY_EDGES),
    plus the code moves the article draws as paths."""
    used = {(t.source, t.target) for t in STATUS_TRANSITIONS if t.used}
    return (used - PATH_ONLY_EDGES) | set(ARTICLE_PATHS)


def article_edges(move: tuple[str, str]) -> list[tuple[str, str]]:
    """The edges of the article's diagram that one code move lights."""
    path = ARTICLE_PATHS.get(move)
    return list(zip(path, path[1:])) if path else [move]
