"""The snapshot contract: what a run store's `snapshots.data` holds, as typed records.

Two kinds are recorded at trace level "full", one row per step each:

    "step"          StepSnapshot         EngineCore, last in each step (SchedulerOutput,
                                         Scheduler.snapshot(), the step's block-pool events)
    "model_runner"  ModelRunnerSnapshot  the worker, after sampling (GPUModelRunner.snapshot()
                                         and the sampled ids); one per rank with tensor parallelism

and, with async scheduling, one more for a step that scheduled drafts:

    "spec_decode"   SpecDecodeSnapshot   EngineCore, when the step's output is processed (its
                                         "step" snapshot was taken at launch, before it was
                                         verified): the drafts it verified and what came of them

`tracing/reader.py` decodes every snapshot into these Structs (`Run.step_snapshot`,
`Run.model_runner_snapshot`, `decode_snapshot`); docs/trace-format.md lists their fields
(tests/tracing/test_snapshot_contract.py checks it against them), and the same test records a
fresh run and decodes each snapshot back into exactly what was stored, so a producer that
renames, adds or drops a field fails there, not in a dashboard page.

NOTE: every Struct forbids unknown fields: the decoder refuses a field the contract does not
name instead of dropping it. A field with a default is one that older runs lack (read with the
default), or one the producer leaves out when it has its default (`omit_defaults`, as
SchedulerOutput is encoded). Reason codes are plain strings here (the engine's enums:
AdmissionStop and DeferReason in core/sched/record.py, CudagraphReason in worker/cudagraph.py)
so that reading a run imports neither the scheduler nor torch.

The `*Index` Structs at the end are partial views for run-level tables: the same fields, fewer
of them (the decoder skips the rest without building it), checked to be a subset of the
contract by the same test.
"""
from __future__ import annotations

from typing import Any

import msgspec


class _Record(msgspec.Struct, forbid_unknown_fields=True):
    """A snapshot record: strict (no field outside the contract)."""


# -- "step": the scheduler's side ------------------------------------------------------------------
class NewRequestRecord(_Record):
    """SchedulerOutput.scheduled_new_reqs[i] (NewRequestData): a request the worker has not seen."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]          # SamplingParams, fields left at their default omitted
    block_ids: list[list[int]]               # one list per KV-cache group (one group here)
    num_computed_tokens: int


class CachedRequestsRecord(_Record):
    """SchedulerOutput.scheduled_cached_reqs (CachedRequestData): parallel lists, one entry per request."""
    req_ids: list[str]
    resumed_req_ids: list[str]
    new_token_ids: list[list[int]]           # only pipeline parallelism fills it: always [] here
    all_token_ids: dict[str, list[int]]      # requests not scheduled in the previous step
    new_block_ids: list[list[list[int]] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]


class SchedulerOutputRecord(_Record, omit_defaults=True):
    """SchedulerOutput as the engine sends it (fields at their default left out)."""
    scheduled_new_reqs: list[NewRequestRecord]
    scheduled_cached_reqs: CachedRequestsRecord
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    preempted_req_ids: list[str] = []
    has_structured_output_requests: bool = False
    pending_structured_output_tokens: bool = False
    step_id: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}   # spec decode: request id -> its drafts this step


class RequestRecord(_Record):
    """Request.snapshot(): one request of a scheduler queue."""
    request_id: str
    status: str                              # a RequestStatus name
    num_tokens: int
    num_computed_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_output_placeholders: int
    num_stale_output_tokens: int
    num_preemptions: int
    num_cached_tokens: int
    block_ids: list[int]
    spec_token_ids: list[int] = []           # spec decode: the drafts it will be verified with next step


class ScheduledRequestRecord(_Record):
    """SchedulerStepRecord.scheduled[i]: one chunk scheduled this step."""
    request_id: str
    num_tokens: int                          # draft tokens included
    kind: str                                # ScheduledKind: prefill_chunk | final_prefill_chunk | decode | resumed
    num_computed_tokens_before: int
    new_block_ids: list[int]
    draft_token_ids: list[int] = []          # spec decode: the drafts scheduled after its last token


class SpecDecodeRecord(_Record):
    """SchedulerStepRecord.spec_decode[i]: one request's drafts verified this step (spec decode)."""
    request_id: str
    draft_token_ids: list[int]               # at positions first_draft_position, +1, ...
    num_accepted: int                        # the rejection sampler kept the first num_accepted
    output_token_ids: list[int]              # accepted drafts + one recovered or bonus token
    first_draft_position: int
    rejected_slots: list[int] = []           # KV slots the rejected drafts were written to (rewritten next step)


class PrefixHitRecord(_Record):
    """SchedulerStepRecord.prefix_hits[i]: a prefix-cache lookup of a request admitted this step."""
    request_id: str
    num_query_tokens: int
    num_hit_tokens: int
    hit_block_ids: list[int]


class SchedulerStepRecord(_Record):
    """core/sched/record.py SchedulerStepRecord: why schedule() did what it did."""
    step_id: int
    token_budget_start: int
    token_budget_end: int
    scheduled: list[ScheduledRequestRecord]
    preempted_req_ids: list[str]
    admission_stop_reason: str | None        # an AdmissionStop code
    prefix_hits: list[PrefixHitRecord]
    deferred_req_ids: list[str]
    num_running: int
    num_waiting: int
    grammar_ready_req_ids: list[str] = []
    deferred_reasons: dict[str, str] = {}    # request id -> a DeferReason code (runs before: none)
    spec_decode: list[SpecDecodeRecord] = []     # spec decode: each verification of this step


class KVBlockRecord(_Record):
    """KVCacheRecord.blocks[i]: one block of the pool, who holds it and its hash."""
    block_id: int
    ref_cnt: int
    hash: str | None                         # short hex of the block hash
    owners: list[str]
    is_null: bool


class KVCacheRecord(_Record):
    """KVCacheManager.snapshot(). `sparse`: a pool of more than 4096 blocks lists only the
    blocks this step touched, the head of the free queue and the null block."""
    num_gpu_blocks: int
    block_size: int
    enable_caching: bool
    usage: float
    num_free_blocks: int
    sparse: bool
    blocks: list[KVBlockRecord]
    free_queue: list[int]
    req_to_block_ids: dict[str, list[int]]
    num_cached_block: dict[str, int]


class SchedulerRecord(_Record):
    """Scheduler.snapshot()."""
    step_id: int
    max_num_batched_tokens: int
    max_num_seqs: int
    waiting: list[RequestRecord]
    running: list[RequestRecord]
    skipped_waiting: list[RequestRecord]
    step_record: SchedulerStepRecord | None
    kv_cache: KVCacheRecord


class BlockPoolEventRecord(_Record):
    """core/block_pool.py BlockPoolEvent (runs before request_id / call / ref_cnts / queue_ends: kind, ids
    and hashes only)."""
    kind: str                                # allocate | free | hit | evict | cache | reset
    block_ids: list[int]
    block_hashes: list[str] = []
    request_id: str | None = None
    call: str | None = None
    ref_cnts: list[int] | None = None
    queue_ends: list[str | None] | None = None


class StepSnapshot(_Record):
    """Snapshot kind "step": recorded by EngineCore last in each step (a step is committed with it)."""
    step_id: int
    time: float                              # time.time() when recorded
    scheduler_output: SchedulerOutputRecord
    scheduler: SchedulerRecord
    block_pool_events: list[BlockPoolEventRecord]


class SpecDecodeSnapshot(_Record):
    """Snapshot kind "spec_decode": async scheduling only, a step's verifications, recorded when its
    output is processed (its "step" snapshot, taken at launch, has -1 placeholder drafts and no
    verifications)."""
    step_id: int
    time: float                              # time.time() when recorded
    scheduled_spec_decode_tokens: dict[str, list[int]]   # the drafts the step verified (the placeholders' values)
    spec_decode: list[SpecDecodeRecord]      # what the step's step_record.spec_decode would hold


# -- "model_runner": the worker's side --------------------------------------------------------------
class InputBatchRow(_Record):
    """InputBatchRecord.rows[i]: one row of the persistent batch."""
    index: int
    req_id: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]


class InputBatchRecord(_Record):
    """InputBatch.snapshot(): the persistent batch's rows and the condense moves of this step."""
    num_reqs: int
    rows: list[InputBatchRow]
    condense_moves: list[list[int]]          # [from_row, to_row]


class CudagraphDecisionRecord(_Record):
    """worker/cudagraph.py CudagraphDecision.to_dict()."""
    mode: str                                # FULL (a graph) | PIECEWISE (pieces, attention eager) | NONE (eager)
    num_tokens: int
    num_padded_tokens: int
    reason: str                              # a sentence
    reason_code: str | None = None           # a CudagraphReason code (runs before: none)


class PrepareInputsRecord(_Record):
    """GPUModelRunner._prepare_inputs' host-side arrays (None for a step that scheduled nothing)."""
    req_ids: list[str]
    num_scheduled_tokens: list[int]
    req_indices: list[int]
    cu_num_tokens: list[int]
    arange: list[int]
    positions: list[int]
    token_indices: list[int]
    input_ids: list[int]                     # -1: spliced in on the device (async scheduling)
    query_start_loc: list[int]
    seq_lens: list[int]
    slot_mapping: list[int]
    logits_indices: list[int]
    discard_request_indices: list[int]
    cudagraph: CudagraphDecisionRecord | None = None
    num_draft_tokens: list[int] = []         # spec decode: drafts per row (logits_indices then has 1 + that per row)


class CachedRequestRow(_Record):
    """ModelRunnerSnapshot.cached_requests[i]: a request the worker keeps state for."""
    req_id: str
    num_tokens: int
    num_computed_tokens: int
    in_batch: bool


class ModelRunnerSnapshot(_Record):
    """Snapshot kind "model_runner": GPUModelRunner.snapshot() plus what the step sampled."""
    input_batch: InputBatchRecord
    prepare_inputs: PrepareInputsRecord | None
    cached_requests: list[CachedRequestRow]
    kv_cache_shape: list[int] | None
    num_kv_cache_layers: int
    sampled_token_ids: list[list[int]] | None = None   # per batch row; runs before: none


SNAPSHOT_TYPES: dict[str, type[_Record]] = {"step": StepSnapshot, "model_runner": ModelRunnerSnapshot,
                                              "spec_decode": SpecDecodeSnapshot}


# -- partial views for run-level tables ---------------------------------------------------------------
# NOTE: the same names and types as above, fewer fields, unknown fields allowed: msgspec skips
# what a view does not name without building it (a 1,000-step run's 164 MB of step JSON read
# for its step records and queues in a fraction of a second; SQLite's json_extract parses a
# document once per call).
class _View(msgspec.Struct):
    """A partial view of a record (unknown fields skipped)."""


# A record kept as the plain data it was stored as (dicts and lists: what the tables hold), not
# validated against its Struct: building a Struct and turning it back into dicts would cost
# more than the pass itself (Run.step_snapshot reads a step strictly).
Plain = dict[str, Any]


class QueueEntryIndex(_View):
    request_id: str
    status: str


class NewRequestIndex(_View):
    req_id: str
    prompt_token_ids: list[int]


class SchedulerOutputIndex(_View):
    scheduled_new_reqs: list[NewRequestIndex]
    finished_req_ids: list[str]


class KVCacheIndex(_View):
    usage: float


class SchedulerIndex(_View):
    waiting: list[QueueEntryIndex]
    running: list[QueueEntryIndex]
    skipped_waiting: list[QueueEntryIndex]
    step_record: Plain | None                # a SchedulerStepRecord as plain data
    kv_cache: KVCacheIndex


class StepIndex(_View):
    """What run-level tables need of a "step" snapshot: its record, queues, KV usage, finished
    ids, block-pool events and the prompts of the requests it admitted."""
    step_id: int
    scheduler_output: SchedulerOutputIndex
    scheduler: SchedulerIndex
    block_pool_events: list[Plain]           # BlockPoolEventRecords as plain data


class InputBatchIndex(_View):
    condense_moves: list[list[int]]


class PrepareInputsIndex(_View):
    req_ids: list[str]
    seq_lens: list[int]
    discard_request_indices: list[int]
    cudagraph: CudagraphDecisionRecord | None = None
    num_draft_tokens: list[int] = []


class ModelRunnerIndex(_View):
    """What run-level tables need of a "model_runner" snapshot: condense moves, the CUDA-graph
    decision, and where each row's sampled token lands (runs without sampled ids: see
    ModelRunnerTokensIndex)."""
    input_batch: InputBatchIndex
    prepare_inputs: PrepareInputsIndex | None
    sampled_token_ids: list[list[int]] | None = None


class PrepareInputsTokens(_View):
    req_indices: list[int]
    positions: list[int]
    input_ids: list[int]


class ModelRunnerTokensIndex(_View):
    """Runs recorded before sampled_token_ids: the generated tokens read back from the inputs."""
    prepare_inputs: PrepareInputsTokens | None


VIEWS: dict[type[_View], type[_Record]] = {
    QueueEntryIndex: RequestRecord, NewRequestIndex: NewRequestRecord, SchedulerOutputIndex: SchedulerOutputRecord,
    KVCacheIndex: KVCacheRecord, SchedulerIndex: SchedulerRecord, StepIndex: StepSnapshot,
    InputBatchIndex: InputBatchRecord, PrepareInputsIndex: PrepareInputsRecord, ModelRunnerIndex: ModelRunnerSnapshot,
    PrepareInputsTokens: PrepareInputsRecord, ModelRunnerTokensIndex: ModelRunnerSnapshot,
}


# -- the contract as docs/trace-format.md shows it --------------------------------------------------
def records() -> list[type[_Record]]:
    """Every record of the contract, in the order this module defines them."""
    return [v for v in globals().values() if isinstance(v, type) and issubclass(v, _Record) and v is not _Record]


def contract_markdown() -> str:
    """The records and their fields as the Markdown of docs/trace-format.md's "Snapshot records"
    section (tests/tracing/test_reader_contract.py checks the doc holds exactly this;
    `python -m vllm_anatomy.tracing.snapshots` prints it)."""
    out = []
    for rec in records():
        doc = " ".join((rec.__doc__ or "").split())
        defaults = dict(zip(rec.__struct_fields__[len(rec.__struct_fields__) - len(rec.__struct_defaults__):],
                            rec.__struct_defaults__))
        fields = ", ".join(f"`{name}: {rec.__annotations__[name]}`"
                           + (f" = `{_default(defaults[name])!r}`" if name in defaults else "")
                           for name in rec.__struct_fields__)
        out.append(f"- **{rec.__name__}**" + (f" — {doc}" if doc else "") + f"  \n  {fields}")
    return "\n".join(out) + "\n"


def _default(value: Any) -> Any:
    return value.factory() if isinstance(value, msgspec._core.Factory) else value


if __name__ == "__main__":
    print(contract_markdown(), end="")
