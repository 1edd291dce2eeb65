"""Scheduler: each step, who computes how many tokens — and what came of it.

Mirrors vllm/v1/core/sched/scheduler.py (Scheduler.schedule, _preempt_request,
_update_after_schedule, update_from_output, finish_requests, make_stats).
schedule() is split for reading into the article's two boxes,
_schedule_running then _schedule_waiting (v0.27.1 writes one long function).

Policies: FCFS (the default) or priority (--scheduling-policy priority: the
waiting queues are heaps ordered by (priority, arrival_time), and a running
request short of blocks preempts the worst of that order, even one already
scheduled in this step, whose tokens go back to the budget).
KV cache events: the block pool's BlockStored / BlockRemoved / AllBlocksCleared
are published once per step (update_from_output) when --kv-events-config asks.
Speculative decoding (as v0.27.1): a request's draft tokens (spec_token_ids,
set by update_draft_token_ids after each step) are scheduled with it, inside
the same token budget (scheduled_spec_decode_tokens); a draft model's
lookahead slots are reserved by allocate_slots; update_from_output rolls
num_computed_tokens back over the drafts the rejection sampler rejected.
Simplified: one token budget (v0.27.1 also keeps an encoder compute budget for
multimodal inputs); no KV connector, encoder cache, LoRA or pipeline
parallelism (their attributes exist, set to None).
Structured output: requests wait in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
(in skipped_waiting) until their grammar has compiled, get_grammar_bitmask
builds each step's bitmask, update_from_output advances the grammars. With
speculative decoding their drafts are cut at the first one the grammar refuses
(update_draft_token_ids) and every draft position is masked. Async scheduling (output
placeholders) lives in async_scheduler.py; the few lines here that read
num_output_placeholders / num_stale_output_tokens / skipped_waiting are
no-ops without it.
Teaching extras: `last_step_record` and `snapshot()`.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm_anatomy.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm_anatomy.core.outputs import DraftTokenIds, LogprobsLists, LogprobsTensors, ModelRunnerOutput
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.interface import SchedulerInterface
from vllm_anatomy.core.sched.output import CachedRequestData, GrammarOutput, NewRequestData, SchedulerOutput
from vllm_anatomy.core.sched.record import (AdmissionStop, DeferReason, PrefixHitRecord, SchedulerStepRecord,
                                             SpecDecodeRecord, make_scheduled_record, make_spec_decode_record)
from vllm_anatomy.core.sched.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from vllm_anatomy.core.sched.utils import check_stop
from vllm_anatomy.distributed.kv_events import EventPublisherFactory, KVEventBatch
from vllm_anatomy.engine.protocol import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from vllm_anatomy.spec_decode.metrics import SpecDecodingStats
from vllm_anatomy.structured_output import StructuredOutputManager
from vllm_anatomy.structured_output.backend_types import StructuredOutputGrammar

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm_anatomy.config import VllmConfig
    from vllm_anatomy.kv_cache_interface import KVCacheConfig


@dataclass
class StepDecisions:
    """What one schedule() call has decided so far: _schedule_running fills it,
    _schedule_waiting adds to it, and the SchedulerOutput and the step record
    are read from it."""
    token_budget: int
    # Waiting requests passed over this step; back in front of skipped_waiting at the end.
    skipped_waiting: RequestQueue
    scheduled_running_reqs: list[Request] = field(default_factory=list)
    scheduled_new_reqs: list[Request] = field(default_factory=list)
    scheduled_resumed_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    # The step's one clock reading (the SCHEDULED / PREEMPTED events carry it).
    scheduled_timestamp: float = 0.0
    # Priority policy: victims taken back since the running loop last looked
    # (each stood before the request being scheduled: the loop index moves back).
    num_unscheduled: int = 0
    req_to_new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Spec decode: the draft tokens scheduled with each request (a prefix of its spec_token_ids).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # For the step record (teaching extra):
    admission_stop_reason: AdmissionStop | None = None
    prefix_hits: list[PrefixHitRecord] = field(default_factory=list)
    deferred_reasons: dict[str, DeferReason] = field(default_factory=dict)

    def assign(self, request: Request, num_new_tokens: int, new_blocks: KVCacheBlocks) -> None:
        """Schedule num_new_tokens of the request, out of the budget."""
        self.req_to_new_blocks[request.request_id] = new_blocks
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.token_budget -= num_new_tokens

    def unassign(self, request: Request) -> None:
        """Take back a running request scheduled earlier in this step (the priority
        policy preempted it): its tokens return to the budget."""
        self.scheduled_running_reqs.remove(request)
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        self.req_to_new_blocks.pop(request.request_id)
        self.num_unscheduled += 1


class Scheduler(SchedulerInterface):

    # Output placeholders a step adds to each request it will sample for:
    # none here (the tokens are known before the next schedule), 1 in AsyncScheduler.
    placeholders_per_sampling_step = 0

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 structured_output_manager: StructuredOutputManager, block_size: int,
                 hash_block_size: int | None = None, mm_registry: Any = None,
                 include_finished_set: bool = False, log_stats: bool = False) -> None:
        """kv_cache_config: the KV cache EngineCore built (its blocks and groups);
        structured_output_manager: EngineCore's (it compiles grammars in a thread
        pool); block_size / hash_block_size: tokens per block and per block hash
        (equal: one group); include_finished_set: put each client's finished ids
        in EngineCoreOutputs.finished_requests (vLLM: for data-parallel front-ends).
        mm_registry: NOTE: vLLM's multimodal registry, which sizes the encoder
        budget and cache; no multimodal models here (None)."""
        self.vllm_config = vllm_config
        self.scheduler_config = vllm_config.scheduler_config
        self.cache_config = vllm_config.cache_config
        self.kv_cache_config = kv_cache_config
        self.kv_events_config = vllm_config.kv_events_config
        self.parallel_config = vllm_config.parallel_config
        self.log_stats = log_stats
        self.structured_output_manager = structured_output_manager
        # Finished since the last update_from_output(), per client; None unless
        # include_finished_set.
        self.finished_req_ids_dict: dict[int, set[str]] | None = \
            defaultdict(set) if include_finished_set else None
        # The requests the last schedule() gave tokens: who the worker's persistent batch holds.
        self.prev_step_scheduled_req_ids: set[str] = set()
        self.max_num_running_reqs = self.scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = (self.scheduler_config.max_num_scheduled_tokens
                                         if self.scheduler_config.max_num_scheduled_tokens is not None
                                         else self.scheduler_config.max_num_batched_tokens)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.enable_kv_cache_events = (self.kv_events_config is not None
                                       and self.kv_events_config.enable_kv_cache_events)
        # NOTE: what vLLM runs beside the scheduler and we do not: a KV connector
        # (disaggregated prefill / KV offloading), an encoder-cache connector and
        # an encoder cache (multimodal inputs). Their attributes exist, empty.
        self.connector = None
        self.ec_connector = None
        self.encoder_cache_manager = None
        self.kv_event_publisher = EventPublisherFactory.create(self.kv_events_config)

        num_gpu_blocks = self.cache_config.num_gpu_blocks
        assert num_gpu_blocks is not None and num_gpu_blocks > 0
        self.block_size = block_size

        self.requests: dict[str, Request] = {}
        try:
            self.policy = SchedulingPolicy(self.scheduler_config.policy)
        except ValueError as e:
            raise ValueError(f"Unknown scheduling policy: {self.scheduler_config.policy}") from e
        self.waiting = create_request_queue(self.policy)
        # Waiting requests passed over by an earlier step (a grammar still
        # compiling, or a preempted request whose in-flight output had not
        # arrived yet). FCFS looks here first.
        self.skipped_waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the workers drop their state for these.
        self.finished_req_ids: set[str] = set()
        # Preempted since the last schedule() (by it, or by reset_prefix_cache).
        self.reset_preempted_req_ids: set[str] = set()
        # Prompts longer than max_model_len: finished on the next update, never scheduled.
        self._ignored_reqs: list[Request] = []
        # Requests whose grammar failed to compile: finished (FINISHED_ERROR) on the next update.
        self.grammar_compile_error_reqs: set[str] = set()
        # Requests promoted WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR -> WAITING this step (for the record).
        self._grammar_ready_req_ids: list[str] = []
        # Those the last schedule() promoted (teaching extra, as last_step_record: the tracer's grammar spans).
        self.last_grammar_ready_req_ids: list[str] = []
        # Speculative decoding (vLLM's names). NOTE: a draft model writes KV for
        # its own drafts past the verified tokens, so their slots are reserved
        # ahead (lookahead); ngram proposes on the host and writes nothing.
        # (use_eagle: vLLM's EAGLE drafts one more block; no EAGLE here.)
        speculative_config = vllm_config.speculative_config
        self.use_eagle = False
        self.num_spec_tokens = vllm_config.num_speculative_tokens
        self.num_lookahead_tokens = self.num_spec_tokens \
            if speculative_config is not None and speculative_config.uses_draft_model() else 0
        # This step's verifications, one per request with drafts (teaching extra, as
        # last_step_record; tracing reads them for the step span's events).
        self.last_spec_decode_records: list[SpecDecodeRecord] = []
        if hash_block_size is None:
            hash_block_size = block_size
        self.hash_block_size = hash_block_size
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config=kv_cache_config, max_model_len=self.max_model_len,
            enable_caching=self.cache_config.enable_prefix_caching, use_eagle=self.use_eagle,
            log_stats=self.log_stats, enable_kv_cache_events=self.enable_kv_cache_events,
            scheduler_block_size=self.block_size, hash_block_size=hash_block_size,
            watermark=self.scheduler_config.watermark)
        self.current_step = 0
        # Teaching extra: keep `last_step_record` (why schedule() did what it
        # did); EngineCore turns it off unless a tracer snapshots steps.
        self.record_steps = True
        self.last_step_record: SchedulerStepRecord | None = None
        # The records of the steps scheduled and not yet updated, by step id: update_from_output
        # adds each step's verifications to its own record (with async scheduling, not the latest).
        self._step_records_in_flight: dict[int, SchedulerStepRecord] = {}

    def schedule(self) -> SchedulerOutput:
        """One step's decisions, in the article's two boxes: RUNNING requests
        first, then WAITING ones with what is left of the token budget.

        NOTE: v0.27.1 writes this as one long schedule(); it is split here for
        reading (_schedule_running, _schedule_waiting, then the output and the
        step record). The order of operations is unchanged.
        """
        # NOTE: there is no "prefill phase" or "decode phase". Each request has
        # num_computed_tokens and num_tokens_with_spec (prompt + outputs); each
        # step gives requests tokens so num_computed_tokens catches up. A decode
        # is just a catch-up of 1; chunked prefill and prefix caching fall out.
        self.current_step += 1
        step = StepDecisions(token_budget=self.max_num_scheduled_tokens,
                             skipped_waiting=create_request_queue(self.policy),
                             scheduled_timestamp=time.monotonic())
        self.kv_cache_manager.new_step_starts()

        # First, schedule the RUNNING requests.
        self._schedule_running(step)
        # Next, admit WAITING requests. NOTE: never in a step that preempted:
        # memory is short, and admitting now would just preempt again next step.
        if step.preempted_reqs:
            step.admission_stop_reason = AdmissionStop.PREEMPTED_THIS_STEP
        else:
            step.admission_stop_reason = self._schedule_waiting(step)

        total_num_scheduled_tokens = sum(step.num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens and step.token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs
        scheduler_output = self._make_scheduler_output(step, total_num_scheduled_tokens)
        self.prev_step_scheduled_req_ids = set(step.num_scheduled_tokens)
        # NOTE: only the step snapshots (trace level full) read the record;
        # EngineCore turns it off below that, since at batch 256 building it
        # costs about a fifth of schedule() (bench/host_cost.py).
        if self.record_steps:
            self.last_step_record = self._make_step_record(step)
            self._step_records_in_flight[self.current_step] = self.last_step_record
        self.last_grammar_ready_req_ids, self._grammar_ready_req_ids = self._grammar_ready_req_ids, []
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    def _schedule_running(self, step: StepDecisions) -> None:
        """Give each RUNNING request the tokens it needs to catch up, in order,
        while the budget lasts; preempt from the back when blocks run out."""
        req_index = 0
        # (read once: the loop below runs for every running request, every step)
        max_model_len = self.max_model_len
        long_prefill_token_threshold = self.scheduler_config.long_prefill_token_threshold
        allocate_slots, num_lookahead_tokens = self.kv_cache_manager.allocate_slots, self.num_lookahead_tokens
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            req_index += 1
            # NOTE: async scheduling: a step already in flight samples this
            # request's last token; one more step would be thrown away.
            # num_computed_tokens already counts the in-flight steps' inputs
            # (and their drafts, as if all were accepted); minus the placeholders
            # but one, it counts them as all rejected: + 1 is then the fewest
            # tokens the request will have. It ends at max_model_len or at
            # max_tokens outputs (check_stop's length cap).
            if request.num_output_placeholders > 0 and (
                    (num_tokens_at_least := request.num_computed_tokens + 2 - request.num_output_placeholders)
                    >= max_model_len or (
                        request.max_tokens is not None and
                        num_tokens_at_least >= request.num_prompt_tokens + request.max_tokens)):
                continue
            # NOTE: placeholders (async scheduling) count as tokens to catch up
            # on: their values are still on the device, but their positions are known.
            # (request.num_tokens_with_spec, without the property's call)
            num_new_tokens = (request.num_tokens + len(request.spec_token_ids) + request.num_output_placeholders
                              - request.num_computed_tokens)
            # (_cap_long_prefill, inline as in v0.27.1)
            if 0 < long_prefill_token_threshold < num_new_tokens:
                num_new_tokens = long_prefill_token_threshold
            # Within the budget, and positions must stay below max_model_len,
            # with room for the token this step samples (v0.27.1: "necessary when
            # using spec decoding": drafts past it are not scheduled).
            num_new_tokens = min(num_new_tokens, step.token_budget, max_model_len - request.num_computed_tokens - 1)
            if num_new_tokens <= 0:
                # NOTE: `continue`, not `break` (as in vLLM): later requests may still run.
                continue
            new_blocks = allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
            if new_blocks is None:
                # Out of blocks: preempt the lowest-priority request(s) until it fits.
                new_blocks = self._preempt_and_allocate(request, num_new_tokens, step)
            if step.num_unscheduled:
                # (a victim scheduled earlier in this loop stood before this request)
                req_index -= step.num_unscheduled
                step.num_unscheduled = 0
            if new_blocks is None:
                break
            step.scheduled_running_reqs.append(request)
            step.assign(request, num_new_tokens, new_blocks)
            # Speculative decode related: the drafts that fit in num_new_tokens go with it.
            if request.spec_token_ids:
                num_scheduled_spec_tokens = (num_new_tokens + request.num_computed_tokens - request.num_tokens
                                             - request.num_output_placeholders)
                if num_scheduled_spec_tokens > 0:
                    step.scheduled_spec_decode_tokens[request.request_id] = \
                        request.spec_token_ids[:num_scheduled_spec_tokens]
                # New ones are set by update_draft_token_ids after this step.
                request.spec_token_ids = []

    def _preempt_and_allocate(self, request: Request, num_new_tokens: int,
                              step: StepDecisions) -> KVCacheBlocks | None:
        """allocate_slots failed for a running request: preempt the lowest-priority
        request and retry, until it fits (None: it preempted itself)."""
        while True:
            # Preempt the lowest-priority request, then retry.
            if self.policy == SchedulingPolicy.PRIORITY:
                # The largest (priority, arrival_time): it may sit before this
                # request and have been scheduled already; then it gives its
                # tokens back (v0.27.1 compares this pair, not the queue's full order).
                preempted_req = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                self.running.remove(preempted_req)
                if preempted_req in step.scheduled_running_reqs:
                    step.unassign(preempted_req)
            else:
                # FCFS: the most recently admitted one, running[-1]. NOTE: it
                # sits after the request being scheduled, so it was never
                # scheduled in this step.
                preempted_req = self.running.pop()
                assert preempted_req.request_id not in step.num_scheduled_tokens
            self._preempt_request(preempted_req, step.scheduled_timestamp)
            step.preempted_reqs.append(preempted_req)
            if preempted_req is request:
                return None  # it preempted itself: nothing left to free for it
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens,
                                                              num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is not None:
                return new_blocks

    def _schedule_waiting(self, step: StepDecisions) -> AdmissionStop:
        """Admit WAITING requests in FCFS order with what is left of the budget;
        returns why admission stopped."""
        stop_reason = self._admit_waiting(step)
        if step.skipped_waiting:
            # Back in front of skipped_waiting, in their original order.
            self.skipped_waiting.prepend_requests(step.skipped_waiting)
        return stop_reason

    def _admit_waiting(self, step: StepDecisions) -> AdmissionStop:
        """The admission loop: passes over the requests that cannot run yet and
        stops at the first limit it meets."""
        while True:
            request_queue = self._select_waiting_queue_for_scheduling()
            if request_queue is None:
                return AdmissionStop.QUEUE_EMPTY
            if step.token_budget <= 0:
                return AdmissionStop.BUDGET_EXHAUSTED
            if len(self.running) >= self.max_num_running_reqs:
                return AdmissionStop.MAX_NUM_SEQS
            request = request_queue.peek_request()
            defer_reason = self._defer_reason(request)
            if defer_reason is not None:
                # NOTE: pass it over and let the requests behind it go first; the
                # step never waits.
                request_queue.pop_request()
                step.skipped_waiting.prepend_request(request)
                step.deferred_reasons[request.request_id] = defer_reason
                continue
            stop_reason = self._try_admit(request_queue, step)
            if stop_reason is not None:
                return stop_reason

    def _try_admit(self, request_queue: RequestQueue, step: StepDecisions) -> AdmissionStop | None:
        """Look the head request up in the prefix cache, allocate its blocks and
        move it to `running` (None: admitted)."""
        request = request_queue.peek_request()
        # NOTE: a waiting request holds no blocks (new, or preempted and
        # freed), so it always gets a fresh prefix-cache lookup; a resumed
        # request usually finds its own freed blocks still cached.
        assert request.num_computed_tokens == 0
        new_computed_blocks, num_new_local_computed_tokens, request.shared_prefix_boundary = \
            self.kv_cache_manager.get_computed_blocks(request)
        # num_tokens, not num_prompt_tokens: a resumed request recomputes its outputs too.
        num_new_tokens = self._cap_long_prefill(request.num_tokens - num_new_local_computed_tokens)
        if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > step.token_budget:
            return AdmissionStop.CHUNKED_PREFILL_DISABLED
        num_new_tokens = min(num_new_tokens, step.token_budget)
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, num_new_local_computed_tokens, new_computed_blocks,
            num_lookahead_tokens=self.num_lookahead_tokens, full_sequence_must_fit=True,
            has_scheduled_reqs=bool(self.running))
        if new_blocks is None:
            # NOTE: waiting requests never preempt running ones: stop admitting.
            return AdmissionStop.NO_FREE_BLOCKS

        self.kv_cache_manager.record_prefix_cache_stats(request, num_new_local_computed_tokens)
        if self.record_steps and self.kv_cache_manager.enable_caching:
            step.prefix_hits.append(PrefixHitRecord(
                request.request_id, request.num_tokens, num_new_local_computed_tokens,
                new_computed_blocks.get_block_ids()[0]))
        request_queue.pop_request()
        self.running.append(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.SCHEDULED, step.scheduled_timestamp)
        if request.status == RequestStatus.PREEMPTED:
            step.scheduled_resumed_reqs.append(request)
        else:
            step.scheduled_new_reqs.append(request)
        step.assign(request, num_new_tokens, self.kv_cache_manager.get_blocks(request.request_id))
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_new_local_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_new_local_computed_tokens
        return None

    def _cap_long_prefill(self, num_new_tokens: int) -> int:
        # NOTE: the threshold keeps one long prompt from taking a whole step's
        # budget; v0.27.1 applies it to every chunk, even of a lone request.
        threshold = self.scheduler_config.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new_tokens else num_new_tokens

    def _make_scheduler_output(self, step: StepDecisions, total_num_scheduled_tokens: int) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(req, step.req_to_new_blocks[req.request_id].get_block_ids())
                                for req in step.scheduled_new_reqs],
            scheduled_cached_reqs=self._make_cached_request_data(
                step.scheduled_running_reqs, step.scheduled_resumed_reqs, step.req_to_new_blocks),
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            # NOTE: hand over this set object; _update_after_schedule starts a new
            # one, so the output keeps exactly the ids finished before this step.
            finished_req_ids=self.finished_req_ids,
            # (the same hand-over: preempted since the last schedule(), here or by reset_prefix_cache)
            preempted_req_ids=self.reset_preempted_req_ids,
            scheduled_spec_decode_tokens=step.scheduled_spec_decode_tokens,
            step_id=self.current_step,
        )

    def _make_step_record(self, step: StepDecisions) -> SchedulerStepRecord:
        """The step's decisions as plain data (teaching extra)."""
        spec = step.scheduled_spec_decode_tokens

        def scheduled(reqs: list[Request], resumed: bool):
            return [make_scheduled_record(req, step.num_scheduled_tokens[req.request_id],
                                          step.req_to_new_blocks[req.request_id].get_block_ids()[0], resumed,
                                          spec.get(req.request_id, []))
                    for req in reqs]

        record = SchedulerStepRecord(
            step_id=self.current_step, token_budget_start=self.max_num_scheduled_tokens,
            token_budget_end=step.token_budget,
            scheduled=(scheduled(step.scheduled_running_reqs, False) + scheduled(step.scheduled_new_reqs, False)
                       + scheduled(step.scheduled_resumed_reqs, True)),
            preempted_req_ids=[req.request_id for req in step.preempted_reqs],
            admission_stop_reason=step.admission_stop_reason,
            prefix_hits=step.prefix_hits, deferred_req_ids=[req.request_id for req in step.skipped_waiting],
            deferred_reasons=step.deferred_reasons,
            num_running=len(self.running), num_waiting=len(self.waiting) + len(self.skipped_waiting),
            grammar_ready_req_ids=self._grammar_ready_req_ids)
        return record

    def _make_cached_request_data(self, running_reqs: list[Request], resumed_reqs: list[Request],
                                  req_to_new_blocks: dict[str, KVCacheBlocks]) -> CachedRequestData:
        # NOTE: v0.27.1 fills these lists in one loop; one comprehension per
        # list does the same in half the time (every running request, every step).
        reqs = running_reqs + resumed_reqs
        req_ids = [req.request_id for req in reqs]
        resumed_req_ids = {req.request_id for req in resumed_reqs}
        # NOTE: a request the worker did not see last step (resumed after
        # preemption, or a running one left out for lack of budget) lost its row
        # in the persistent batch; the worker re-adds it, and with async
        # scheduling its cached outputs may lack tokens still in flight back then.
        # So it gets its full token list (v0.27.1: all_token_ids, "MRV1-only").
        prev_step_scheduled_req_ids = self.prev_step_scheduled_req_ids
        all_token_ids = {req.request_id: list(req.all_token_ids) for req in reqs
                         if req.request_id not in prev_step_scheduled_req_ids}
        # For a resumed request these are all of its blocks: they *replace* its old row.
        # (a decode that needs no new block gets the manager's shared empty
        # KVCacheBlocks, whose get_block_ids(allow_none=True) is None: no call)
        empty_blocks = self.kv_cache_manager.empty_kv_cache_blocks
        new_block_ids = [None if (blocks := req_to_new_blocks[req_id]) is empty_blocks
                         else blocks.get_block_ids(allow_none=True) for req_id in req_ids]
        num_computed_tokens = [req.num_computed_tokens for req in reqs]
        # v0.27.1 counts the tokens still in flight (async scheduling) as outputs.
        num_output_tokens = [req.num_output_tokens + req.num_output_placeholders for req in reqs]
        # new_token_ids: only pipeline parallelism sends sampled tokens back (none here).
        return CachedRequestData(req_ids, resumed_req_ids, new_token_ids=[], all_token_ids=all_token_ids,
                                 new_block_ids=new_block_ids, num_computed_tokens=num_computed_tokens,
                                 num_output_tokens=num_output_tokens)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        """Preempt by recompute: free the blocks, forget the progress, requeue at the front.

        NOTE: the caller already removed it from `running`. Its freed blocks
        stay cached (hashed blocks go to the LRU tail), so on resumption the
        prefix cache often gives most of the work back. timestamp: the
        PREEMPTED event's (the step's clock reading). drop_stale_output: drop,
        not deliver, the tokens still in flight (reset_prefix_cache resumes the
        request in the same step: a late token would land out of order).
        """
        assert request.status == RequestStatus.RUNNING, "Only running requests can be preempted"
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if request.spec_token_ids:
            request.spec_token_ids = []     # drafts for a sequence whose KV is gone: proposed anew later
        # NOTE: async scheduling: everything still in flight becomes stale. Its
        # sampled tokens are still delivered (they are the model's real samples
        # for positions the request had reached), but must not touch the reset
        # counters; update_from_output drains the stale share step by step.
        # num_in_flight_tokens already includes any undrained stale share, so
        # this assigns rather than adds. An undrained dropped share stays dropped.
        request.drop_stale_output = drop_stale_output or (
            request.drop_stale_output and request.num_stale_output_tokens > 0)
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
        self.waiting.prepend_request(request)
        self.reset_preempted_req_ids.add(request.request_id)

    def _select_waiting_queue_for_scheduling(self) -> RequestQueue | None:
        """FCFS: requests skipped by an earlier step are older, so they go first.
        Priority: the queue whose head comes first in the priority order."""
        if self.policy == SchedulingPolicy.FCFS:
            return self.skipped_waiting or self.waiting or None
        if self.waiting and self.skipped_waiting:
            waiting_req = self.waiting.peek_request()
            skipped_req = self.skipped_waiting.peek_request()
            return self.waiting if waiting_req < skipped_req else self.skipped_waiting
        return self.waiting or self.skipped_waiting or None

    @staticmethod
    def _is_blocked_waiting_status(status: RequestStatus) -> bool:
        """Waiting for something outside the scheduler (here: only a grammar)."""
        return status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    def _enqueue_waiting_request(self, request: Request) -> None:
        # NOTE: a blocked request goes straight to skipped_waiting, so that it
        # does not hold up the head of `waiting` while it compiles.
        if self._is_blocked_waiting_status(request.status):
            self.skipped_waiting.add_request(request)
        else:
            self.waiting.add_request(request)

    def _remove_waiting_requests(self, requests: Iterable[Request]) -> None:
        """Out of whichever waiting queue holds them."""
        requests = set(requests)
        self.waiting.remove_requests(requests)
        self.skipped_waiting.remove_requests(requests)

    def _defer_reason(self, request: Request) -> DeferReason | None:
        """Why the head of the waiting queue must be passed over this step (None: try to admit it).

        NOTE: either its grammar is still compiling (or failed), or (async
        scheduling) a step launched before it was preempted is still sampling
        its next token: resuming now would sample that position again, so it
        waits until that token is delivered (within the pipeline depth).
        """
        if self._is_blocked_waiting_status(request.status) and \
                not self._try_promote_blocked_waiting_request(request):
            if request.request_id in self.grammar_compile_error_reqs:
                return DeferReason.GRAMMAR_FAILED
            return DeferReason.GRAMMAR_COMPILING
        if request.num_stale_output_tokens > 0 and not request.drop_stale_output:
            return DeferReason.STALE_OUTPUT_IN_FLIGHT
        return None

    def _try_promote_blocked_waiting_request(self, request: Request) -> bool:
        """WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR -> WAITING once the grammar has
        compiled (a non-blocking poll of its Future). A failed compile stays
        blocked and is finished with FINISHED_ERROR by the next update."""
        structured_output_req = request.structured_output_request
        if structured_output_req is None or structured_output_req.grammar is None:
            return False
        if isinstance(structured_output_req.grammar, Exception):
            self.grammar_compile_error_reqs.add(request.request_id)
            return False
        request.status = RequestStatus.WAITING
        self._grammar_ready_req_ids.append(request.request_id)
        return True

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # NOTE: advance num_computed_tokens now, before the step even runs
        # (optimistically), so that the next schedule() sees the chunk as done.
        # Sampled tokens are appended later, in update_from_output.
        placeholders = self.placeholders_per_sampling_step
        for req_id, num_scheduled_token in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_scheduled_token
            request.num_in_flight_tokens += num_scheduled_token
            request.is_prefill_chunk = (request.num_computed_tokens
                                        < request.num_tokens + request.num_output_placeholders)
            # NOTE: a partial prefill chunk samples nothing worth keeping.
            if not request.is_prefill_chunk:
                if request.structured_output_request is not None:     # request.use_structured_output
                    scheduler_output.has_structured_output_requests = True
                    # NOTE: async scheduling: a placeholder still in flight is a token
                    # the grammar has not seen; this step's bitmask must wait for it.
                    if request.num_output_placeholders > 0:
                        scheduler_output.pending_structured_output_tokens = True
                request.num_output_placeholders += placeholders
        # New sets: the output keeps the ones it was handed.
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The step's bitmask: rows for each scheduled structured request that samples
        (a partial prefill chunk does not), in scheduling order: one per scheduled
        draft and one for its bonus (or only) token.

        NOTE: EngineCore calls this after execute_model has launched the
        forward and before sample_tokens: the rows are filled while the device
        computes the logits they will mask.
        """
        if not scheduler_output.has_structured_output_requests:
            return None
        structured_output_request_ids = [
            req_id for req_id in scheduler_output.num_scheduled_tokens
            if (req := self.requests.get(req_id)) and req.use_structured_output and not req.is_prefill_chunk]
        if not structured_output_request_ids:
            return None     # e.g. aborted after schedule()
        # NOTE: speculative decoding: 1 + its scheduled drafts rows per id (StructuredOutputManager).
        bitmask = self.structured_output_manager.grammar_bitmask(
            self.requests, structured_output_request_ids, scheduler_output.scheduled_spec_decode_tokens)
        assert bitmask is not None          # rows for each id, and there are ids
        return GrammarOutput(structured_output_request_ids, bitmask)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        """Append sampled tokens, check stops, free finished requests, build outputs."""
        # NOTE: may run one step late (async scheduling): by now the scheduler
        # may have scheduled the next step, preempted or finished requests of
        # this one. Outputs of requests gone meanwhile are skipped below.
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs_dict = model_runner_output.prompt_logprobs_dict
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        spec_decoding_stats: SpecDecodingStats | None = None
        self.last_spec_decode_records = []
        step_record = self._take_step_record(scheduler_output.step_id)
        if step_record is not None:
            step_record.spec_decode = self.last_spec_decode_records
        stopped_running_reqs: set[Request] = set()
        stopped_preempted_reqs: set[Request] = set()
        # (read once: the loop below runs for every scheduled request, every step;
        # without speculative decoding the dict is empty and is never looked up)
        scheduled_spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        req_id_to_index = model_runner_output.req_id_to_index
        for req_id, num_tokens_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            output_is_stale = False
            if request is not None:
                request.num_in_flight_tokens -= num_tokens_scheduled
                # Drain the stale share (see _preempt_request) in lockstep.
                if request.num_stale_output_tokens > 0:
                    output_is_stale = True
                    request.num_stale_output_tokens -= num_tokens_scheduled
                    assert request.num_stale_output_tokens >= 0
            if request is None or request.is_finished():
                continue  # aborted while the step was running
            if output_is_stale and request.drop_stale_output:
                continue  # resumed at once (reset_prefix_cache): its positions are being recomputed
            req_index = req_id_to_index[req_id]
            # NOTE: a non-final prefill chunk samples nothing (empty list).
            new_token_ids = sampled_token_ids[req_index] if sampled_token_ids else []
            scheduled_spec_token_ids = (scheduled_spec_decode_tokens.get(req_id)
                                        if scheduled_spec_decode_tokens else None)
            if scheduled_spec_token_ids and new_token_ids:
                num_draft_tokens = len(scheduled_spec_token_ids)
                num_accepted = len(new_token_ids) - 1       # the last one is the recovered or bonus token
                num_rejected = num_draft_tokens - num_accepted
                # (teaching extra: what was accepted, where the rejected drafts' KV went;
                # not for a stale output: preempted meanwhile, its KV is gone)
                if not output_is_stale:
                    self.last_spec_decode_records.append(make_spec_decode_record(
                        request, scheduled_spec_token_ids, new_token_ids,
                        self.kv_cache_manager.get_blocks(req_id).blocks[0], self.block_size))
                # NOTE: the rejected drafts' positions were computed (their KV
                # written) for nothing: roll num_computed_tokens back over them, so
                # the next step computes those positions again, with the real
                # tokens, over the same slots. A stale count (the request was
                # preempted meanwhile) predates the preemption's reset.
                if not output_is_stale:
                    if request.num_computed_tokens > 0:
                        request.num_computed_tokens -= num_rejected
                    if request.num_output_placeholders > 0:
                        request.num_output_placeholders -= num_rejected
                spec_decoding_stats = self.make_spec_decoding_stats(
                    spec_decoding_stats, num_draft_tokens, num_accepted,
                    scheduler_output.num_invalid_spec_tokens, req_id)
            stopped = False
            status_before_stop = request.status
            if new_token_ids:
                # NOTE: a stale token (the request was preempted while this step
                # ran) is delivered like any other: it is appended to a PREEMPTED
                # request, which will recompute its KV on resumption, and may
                # even finish it there.
                new_token_ids, stopped = self._update_request_with_output(request, new_token_ids,
                                                                          is_stale=output_is_stale)
            # (request.use_structured_output, read as the attribute it tests: most
            # requests have no grammar, and this runs for each of them every step)
            if new_token_ids and request.structured_output_request is not None and \
                    self.structured_output_manager.should_advance(request):
                new_token_ids, grammar_stopped = self._advance_grammar(request, new_token_ids)
                stopped = grammar_stopped or stopped
            if stopped:
                self._free_request(request)
                if status_before_stop == RequestStatus.RUNNING:
                    stopped_running_reqs.add(request)
                else:
                    stopped_preempted_reqs.add(request)
            # The request's rows of the step's logprobs (only if it asked).
            new_logprobs = None
            if logprobs is not None and request.sampling_params.logprobs is not None:
                new_logprobs = logprobs.slice_request(req_index, len(new_token_ids))
            prompt_logprobs_tensors = prompt_logprobs_dict.get(req_id) if prompt_logprobs_dict else None
            # NOTE: no output for a partial prefill: nothing new to say yet.
            if new_token_ids or stopped:
                outputs[request.client_index].append(
                    self._make_output(request, new_token_ids, new_logprobs, prompt_logprobs_tensors))
            else:
                # (the worker returns a prompt's logprobs with its first sampled token, never before)
                assert not prompt_logprobs_tensors
        if stopped_running_reqs:
            self.running = [req for req in self.running if req not in stopped_running_reqs]
        if stopped_preempted_reqs:
            # Rare: a stale token finished a preempted request.
            self._remove_waiting_requests(stopped_preempted_reqs)
        for request in self._ignored_reqs:
            self._free_request(request)
            outputs[request.client_index].append(self._make_output(request, []))
        self._ignored_reqs = []
        self._finish_grammar_compile_errors(outputs)
        # The step's KV cache events, one batch (vLLM publishes them here too).
        events = self.kv_cache_manager.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))  # type: ignore[arg-type]
        return self._make_engine_core_outputs(outputs, spec_decoding_stats)

    def _take_step_record(self, step_id: int) -> SchedulerStepRecord | None:
        """The record of the step being updated (None if steps are not recorded).

        NOTE: with async scheduling, step N is updated after step N+1 was
        scheduled: last_step_record is N+1's by then. Steps are updated in the
        order they were scheduled, so older records still here are dropped."""
        records = self._step_records_in_flight
        while records and (oldest := next(iter(records))) < step_id:
            del records[oldest]
        return records.pop(step_id, None)

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """The drafts the worker proposed after the step: what the next schedule() verifies.

        NOTE: called by EngineCore after update_from_output, so a request the
        step finished is gone, and one still in prefill (its sampled token was
        a guess mid-prompt) keeps none. A structured-output request keeps the
        drafts its grammar accepts, up to the first one it refuses (a draft the
        grammar forbids could never be accepted: verifying it wastes its slot
        and every position after it); get_grammar_bitmask masks each kept one."""
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.is_prefill_chunk:
                if request.spec_token_ids:
                    request.spec_token_ids = []
                continue
            if self.structured_output_manager.should_advance(request):
                spec_token_ids = self._validate_spec_tokens(request, spec_token_ids)
            request.spec_token_ids = spec_token_ids

    @staticmethod
    def _validate_spec_tokens(request: Request, spec_token_ids: list[int]) -> list[int]:
        """The longest prefix of the drafts the request's grammar accepts (the grammar does not move)."""
        struct_request = request.structured_output_request
        assert struct_request is not None and isinstance(struct_request.grammar, StructuredOutputGrammar)
        return struct_request.grammar.validate_tokens(spec_token_ids)

    def update_draft_token_ids_in_output(self, draft_token_ids: DraftTokenIds,
                                         scheduler_output: SchedulerOutput) -> None:
        """Async scheduling: the step was scheduled with -1 draft placeholders (the
        drafts were on the device); put the drafts in their place. A structured
        request's drafts are cut at the first one its grammar refuses and padded
        back with -1 (num_invalid_spec_tokens counts them): get_grammar_bitmask
        stops advancing there, and the stats do not count them as drafts.

        NOTE: v0.27.1 calls this for a deferred structured-output step, before its
        bitmask (EngineCore.step_with_batch_queue); ours does that too, and, for a
        step with drafts not deferred, before update_from_output, with the drafts it
        verified (EngineCore._update_from_output), so that update_from_output
        records them where v0.27.1 leaves the -1s. Once per step: a structured
        request's drafts always come in a deferred step (its previous token was in
        flight when they were scheduled), so its grammar checks them once."""
        num_invalid_spec_tokens: dict[str, int] = {}
        sched_spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            placeholder_spec_tokens = sched_spec_tokens.get(req_id)
            if not placeholder_spec_tokens:
                continue
            orig_num_spec_tokens = len(placeholder_spec_tokens)
            spec_token_ids = list(spec_token_ids[:orig_num_spec_tokens])
            # NOTE: v0.27.1 skips a request that is gone or finished (its -1s stay);
            # ours still writes its drafts in, unchecked: the step verified them on the
            # device, and the trace records what was verified (its outputs are dropped).
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished() \
                    and self.structured_output_manager.should_advance(request):
                spec_token_ids = self._validate_spec_tokens(request, spec_token_ids)
            num_invalid_tokens = orig_num_spec_tokens - len(spec_token_ids)
            if num_invalid_tokens:
                spec_token_ids.extend([-1] * num_invalid_tokens)
                num_invalid_spec_tokens[req_id] = num_invalid_tokens
            sched_spec_tokens[req_id] = spec_token_ids
        scheduler_output.num_invalid_spec_tokens = num_invalid_spec_tokens

    def make_spec_decoding_stats(self, spec_decoding_stats: SpecDecodingStats | None, num_draft_tokens: int,
                                 num_accepted_tokens: int, num_invalid_spec_tokens: dict[str, int] | None = None,
                                 request_id: str = "") -> SpecDecodingStats | None:
        if not self.log_stats or not num_draft_tokens:
            return spec_decoding_stats
        if spec_decoding_stats is None:
            spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
        # NOTE: drafts the grammar refused (async: -1s) were never proposals worth counting.
        # (As in v0.27.1, a draft past the grammar's stop token still verifies against an
        # all-allowed row and may count as accepted; the stop check drops its token.)
        if num_invalid_spec_tokens:
            num_draft_tokens -= num_invalid_spec_tokens.get(request_id, 0)
        spec_decoding_stats.observe_draft(num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens)
        return spec_decoding_stats

    def _advance_grammar(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        """Feed the sampled tokens to the request's grammar: (the tokens to output, stopped).

        NOTE: the bitmask allowed only tokens the grammar accepts, so a refusal
        is a bug (a mask applied to the wrong row, a token sampled without its
        mask): the request fails alone with FINISHED_ERROR, as in vLLM.
        Ours (issue 29; vLLM 0.27.1 fails these requests): the grammar decides
        where a structured output ends. Once it has accepted its stop token the
        request stops (finish_reason "stop"), also under ignore_eos; and when
        it refuses a token while complete (min_tokens masked the stop tokens,
        the only tokens it allowed) that token is dropped and the request stops.
        """
        struct_output_request = request.structured_output_request
        assert struct_output_request is not None
        grammar = struct_output_request.grammar
        assert isinstance(grammar, StructuredOutputGrammar)     # compiled: it was scheduled
        # NOTE: speculative decoding hands several tokens at once; fed one by one, so
        # that a grammar ending before the last (the tokens after its end dropped) is told apart.
        num_accepted = 0
        for token in new_token_ids:
            if not grammar.accept_tokens(request.request_id, [token]):
                break
            num_accepted += 1
        if num_accepted == len(new_token_ids):
            if grammar.is_terminated() and not request.is_finished():
                request.status = RequestStatus.FINISHED_STOPPED
                return new_token_ids, True
            return new_token_ids, False
        if grammar.is_completed():
            request.status = RequestStatus.FINISHED_STOPPED
            return new_token_ids[:num_accepted], True
        logger.error("Unexpected: grammar rejected tokens %s for request %s. Terminating request.",
                     new_token_ids, request.request_id)
        request.status = RequestStatus.FINISHED_ERROR
        return new_token_ids, True

    def _finish_grammar_compile_errors(self, outputs: dict[int, list[EngineCoreOutput]]) -> None:
        """Requests whose grammar failed to compile end with FINISHED_ERROR (an
        empty output with finish_reason "error"), the others go on."""
        error_req_ids, self.grammar_compile_error_reqs = self.grammar_compile_error_reqs, set()
        for req_id in error_req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            self.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
            outputs[request.client_index].append(self._make_output(request, []))

    def _update_request_with_output(self, request: Request, new_token_ids: list[int],
                                    is_stale: bool = False) -> tuple[list[int], bool]:
        """Append tokens one at a time, checking for a stop after each one.
        (is_stale is only read by AsyncScheduler's override.)"""
        if len(new_token_ids) == 1:
            # NOTE: a decode's one token (every request, every step without
            # speculative decoding): the loop below without its enumerate and slice.
            request.append_output_token_ids(new_token_ids[0])
            return new_token_ids, check_stop(request, self.max_model_len)
        for num_new, output_token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(output_token_id)
            if check_stop(request, self.max_model_len):
                # NOTE: tokens after the stop are dropped (only spec decode yields several).
                return new_token_ids[:num_new], True
        return new_token_ids, False

    def _make_output(self, request: Request, new_token_ids: list[int], new_logprobs: LogprobsLists | None = None,
                     prompt_logprobs_tensors: LogprobsTensors | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id, new_token_ids=new_token_ids, new_logprobs=new_logprobs,
            new_prompt_logprobs_tensors=prompt_logprobs_tensors,
            finish_reason=request.get_finished_reason(), stop_reason=request.stop_reason,
            # (take_events() returns None when there are none: most steps, skipped without a call)
            events=request.take_events() if request.events else None, trace_headers=request.trace_headers,
            # (-1 until first scheduled; max() would cost more than the rest of this call)
            num_cached_tokens=request.num_cached_tokens if request.num_cached_tokens > 0 else 0)

    def _make_engine_core_outputs(self, outputs: dict[int, list[EngineCoreOutput]],
                                  spec_decoding_stats: SpecDecodingStats | None = None
                                  ) -> dict[int, EngineCoreOutputs]:
        engine_core_outputs = {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}
        finished_req_ids = self.finished_req_ids_dict
        if finished_req_ids:
            for client, finished_set in finished_req_ids.items():
                if (eco := engine_core_outputs.get(client)) is not None:
                    eco.finished_requests = finished_set
                else:
                    engine_core_outputs[client] = EngineCoreOutputs(finished_requests=finished_set)
            self.finished_req_ids_dict = defaultdict(set)
        stats = self.make_stats(spec_decoding_stats)
        if stats is not None:
            # NOTE: stats go to one client only (any will do), even with no outputs.
            if not engine_core_outputs:
                engine_core_outputs[0] = EngineCoreOutputs()
            engine_core_outputs[min(engine_core_outputs)].scheduler_stats = stats
        return engine_core_outputs

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"Request {request.request_id!r} has an empty prompt")
        self.requests[request.request_id] = request
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)
        if request.num_prompt_tokens > self.max_model_len:
            # NOTE: the frontend rejects such prompts; if one slips through it
            # could never be scheduled, so finish it instead of queueing it.
            request.status = RequestStatus.FINISHED_IGNORED
            self._ignored_reqs.append(request)
            return
        self._enqueue_waiting_request(request)

    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: RequestStatus) -> list[Request]:
        """Finish requests from outside (aborts, stop strings); None: every request.
        Unknown or finished ids are ignored. Returns the requests it finished."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is None:
            request_ids = list(self.requests)
        valid_requests = [req for req_id in request_ids
                          if (req := self.requests.get(req_id)) is not None and not req.is_finished()]
        running = {req for req in valid_requests if req.status == RequestStatus.RUNNING}
        if running:
            self.running = [req for req in self.running if req not in running]
        if len(running) < len(valid_requests):
            self._remove_waiting_requests([req for req in valid_requests if req not in running])
        for request in valid_requests:
            request.status = finished_status
            self._free_request(request)
        return valid_requests

    def _free_request(self, request: Request) -> None:
        assert request.is_finished()
        self.finished_req_ids.add(request.request_id)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)

    def has_finished_requests(self) -> bool:
        return len(self.finished_req_ids) > 0 or len(self._ignored_reqs) > 0

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting) + len(self.skipped_waiting)

    def get_kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block (RLHF after a weight update; benchmarks).

        Without reset_running_requests it succeeds only when no request holds
        blocks. With it, every running request is preempted first (last first,
        so that they resume in their order) and its in-flight output dropped:
        they will recompute their KV with whatever weights are loaded now.
        reset_connector: NOTE: a KV connector's own cache; none here.
        """
        if reset_running_requests:
            timestamp = time.monotonic()
            while self.running:
                self._preempt_request(self.running.pop(), timestamp, drop_stale_output=True)
            # NOTE: preempted and resumed without a schedule() in between: the
            # worker must re-add them (full token lists), as if unscheduled last step.
            self.prev_step_scheduled_req_ids.clear()
        reset_successful = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not reset_successful:
            raise RuntimeError("Failed to reset the prefix cache although every running request was preempted")
        if reset_connector:
            reset_successful = self.reset_connector_cache() and reset_successful
        return reset_successful

    def reset_connector_cache(self) -> bool:
        """A KV connector's own cache (offloaded blocks); no connector here: nothing to reset."""
        return self.connector is None

    def shutdown(self) -> None:
        """Stop the KV event publisher (its thread sends what is queued first)."""
        self.kv_event_publisher.shutdown()

    def get_kv_connector(self) -> None:
        return self.connector

    def get_kv_event_publisher_config(self):
        return self.kv_event_publisher.get_publisher_config()

    def make_stats(self, spec_decoding_stats: SpecDecodingStats | None = None) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        prefix_stats = self.kv_cache_manager.make_prefix_cache_stats()
        assert prefix_stats is not None     # kept whenever log_stats is on
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            num_skipped_waiting_reqs=len(self.skipped_waiting),
            step_counter=self.current_step, kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_requests=prefix_stats.requests, prefix_cache_queries=prefix_stats.queries,
            prefix_cache_hits=prefix_stats.hits, spec_decoding_stats=spec_decoding_stats)

    def snapshot(self, kv_cache: dict[str, Any] | None = None) -> dict[str, Any]:
        """kv_cache: KVCacheManager.snapshot() or the same dict built another way
        (tracing's incremental KVCacheSnapshotter); None: the manager's own."""
        kv_snapshot = kv_cache if kv_cache is not None else self.kv_cache_manager.snapshot()
        # NOTE: each request's block ids are its row of the KV manager's block
        # tables: listed once there, shared here (the same list object; a
        # request holding no blocks gets [] from Request.snapshot).
        tables = kv_snapshot["req_to_block_ids"]
        return {
            "step_id": self.current_step,
            "max_num_batched_tokens": self.max_num_scheduled_tokens,
            "max_num_seqs": self.max_num_running_reqs,
            "waiting": [req.snapshot(tables.get(req.request_id)) for req in self.waiting],
            "running": [req.snapshot(tables.get(req.request_id)) for req in self.running],
            "skipped_waiting": [req.snapshot(tables.get(req.request_id)) for req in self.skipped_waiting],
            "step_record": self.last_step_record.to_dict() if self.last_step_record else None,
            "kv_cache": kv_snapshot,
        }
