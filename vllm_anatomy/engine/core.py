"""EngineCore: the inner loop — schedule, execute, update.

Mirrors vllm/v1/engine/core.py (`EngineCore`): used in-process by LLMEngine
and InprocClient. The same core in its own process, behind ZMQ sockets, is
EngineCoreProc, in engine/core_proc.py (vLLM keeps both in core.py). One `step()`:

    Scheduler.schedule()                          -> SchedulerOutput   (CPU, pure Python)
    Executor.execute_model(out, non_block=True)   -> Future            (enqueues the forward)
    Scheduler.get_grammar_bitmask(out)            -> GrammarOutput     (CPU, while the device runs)
    future.result() is None -> Executor.sample_tokens(grammar_output)
                                                  -> ModelRunnerOutput (sampling + the one sync)
    Scheduler.update_from_output()                -> EngineCoreOutputs (append tokens, stop, free)

NOTE: this is the article's timeline (§五). execute_model only *enqueues*
the forward on the device and answers None ("go on to sampling"), so the CPU
is free until sample_tokens needs the logits; the grammar bitmask of the
structured-output requests (which tokens each one may sample next) is built
in exactly that window, hidden behind the forward pass instead of added to
the step. Only sampling needs it, and sampling needs the logits anyway.

With async scheduling (`async_scheduling`, on by default on a GPU) the engine
steps with `step_with_batch_queue` instead: it schedules and launches step N+1
before it waits for step N's tokens, so that the host's work overlaps the
device's. sample_tokens(non_block=True) then returns a Future whose result()
is the sync point, one step later.

Tracing: the step records nothing itself. It tells one StepTracer
(tracing/step_tracer.py) where each step is — scheduled, bitmask built,
output applied — and the tracer writes the spans, links and snapshot the
trace level asks for; at level off every call is a no-op.

Errors. A bad request fails alone; the engine stays up:
  * add_request re-checks what the engine relies on (prompt ids and every
    token id of its SamplingParams inside the vocabulary, types and ranges)
    with the frontend's own functions, and raises for that request only
    (EngineCoreProc runs the check in its input thread and answers
    FinishReason.ERROR, as vLLM's _handle_request_preproc_error does);
  * a request that fails in the worker while joining the batch comes back
    in ModelRunnerOutput.error_req_ids and is finished with FINISHED_ERROR,
    its blocks freed, while the rest of the batch goes on.
NOTE: what runs for the whole batch at once (the forward, the sampler, the
scheduler's own bookkeeping) cannot be pinned on one request. An exception
there may leave the KV cache, the persistent batch or the device (CUDA
errors are sticky) in an unknown state, so it is the engine's death, as in
vLLM: EngineCoreProc reports it and the server answers 503.
"""
from __future__ import annotations

import gc
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future


from vllm_anatomy.config import VllmConfig
from vllm_anatomy.core.kv_cache_utils import (check_enough_kv_cache_memory, get_request_block_hasher,
                                              init_none_hash, sha256)
from vllm_anatomy.core.outputs import DraftTokenIds, ModelRunnerOutput
from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.output import GrammarOutput, SchedulerOutput
from vllm_anatomy.engine.input_processor import validate_params, validate_prompt_token_ids
from vllm_anatomy.engine.protocol import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                          FinishReason, SchedulerStats)
from vllm_anatomy.executor.abstract import Executor
from vllm_anatomy.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from vllm_anatomy.structured_output import StructuredOutputManager
from vllm_anatomy.tracing.recorder import NullRecorder, Recorder
from vllm_anatomy.tracing.step_tracer import NullStepTrace, StepTrace
from vllm_anatomy.utils.gc_utils import freeze_gc_heap, maybe_attach_gc_debug_callback

logger = logging.getLogger(__name__)


class EngineCore:

    def __init__(self, vllm_config: VllmConfig, recorder: Recorder | None = None,
                 executor_class: Callable[..., Executor] | None = None) -> None:
        self.vllm_config = vllm_config
        self.recorder = recorder or NullRecorder()
        cache_config = vllm_config.cache_config
        # Steps in flight: (sample_tokens' future, scheduler output, execute_model's future, step trace).
        self.batch_queue_size = vllm_config.scheduler_config.max_concurrent_batches
        self.batch_queue: deque[tuple[Future, SchedulerOutput, Future, StepTrace | NullStepTrace]] | None = None
        self.step_fn = self.step
        if self.batch_queue_size > 1:
            self.batch_queue = deque(maxlen=self.batch_queue_size)
            self.step_fn = self.step_with_batch_queue
        # All of a step's tracing goes through this one object (tracing/step_tracer.py).
        self.step_tracer = self.recorder.step_tracer(snapshot_at_launch=self.batch_queue is not None)
        with self.recorder.span("EngineCore.__init__"):
            executor_class = executor_class or Executor.get_class(vllm_config)
            self.model_executor = executor_class(vllm_config, self.recorder)
            with self.recorder.span("EngineCore._initialize_kv_caches"):
                kv_cache_config = self._initialize_kv_caches(vllm_config)
            self.structured_output_manager = StructuredOutputManager(vllm_config)
            scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
            self.scheduler = scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                                           structured_output_manager=self.structured_output_manager,
                                           block_size=cache_config.block_size, log_stats=True)
            # Teaching extras: the dashboard's block events (allocate / free / hit /
            # evict) only for a tracer that drains them every step, and the step
            # record only for a recorder that reads it (the step snapshots).
            self.scheduler.kv_cache_manager.block_pool.record_block_pool_events = \
                self.step_tracer.drains_kv_cache_events
            self.scheduler.record_steps = self.recorder.wants_snapshots
            self.step_tracer.watch(self.scheduler)
        # Speculative decoding: fetch each step's drafts for the scheduler (post_step).
        self.check_for_draft_tokens = vllm_config.speculative_config is not None
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        # The model's vocabulary, which every token id of a request must index
        # (read after the executor: an in-process worker fills hf_config).
        self.vocab_size: int | None = (vllm_config.model_config.hf_config or {}).get("vocab_size")
        # NOTE: the request computes its own block hashes (on arrival and on
        # every appended token); the hasher is created once, here, so every
        # request chains from the same NONE_HASH seed.
        self.request_block_hasher = None
        if cache_config.enable_prefix_caching:
            init_none_hash(sha256)
            self.request_block_hasher = get_request_block_hasher(cache_config.block_size, sha256)
        # NOTE: (as vLLM: utils/gc_utils.py) everything created so far (model,
        # tokenizer, block pool: hundreds of thousands of objects) lives as long
        # as the engine; moving it to the GC's permanent generation stops every
        # full collection from re-scanning it. At batch 256 on the CPU that was
        # ~25 % of the step time. Then VLLM_GC_DEBUG's log, if asked for.
        freeze_gc_heap()
        self._gc_debug_callback = maybe_attach_gc_debug_callback()

    def _initialize_kv_caches(self, vllm_config: VllmConfig) -> KVCacheConfig:
        """Size the KV cache (the workers measure their memory), check that one
        max_model_len sequence fits, allocate it; the scheduler's KVCacheConfig.

        NOTE: v0.27.1 refuses a KV cache too small for one sequence here, at
        start-up (check_enough_kv_cache_memory), not in the Scheduler: such a
        request could never be admitted.
        """
        num_gpu_blocks = self.model_executor.determine_num_available_blocks()
        kv_cache_spec = self._get_kv_cache_spec(vllm_config)
        page_size = sum(spec.page_size_bytes for spec in kv_cache_spec.values())
        # (the usable blocks: block 0 is the null block)
        check_enough_kv_cache_memory(vllm_config, kv_cache_spec, (num_gpu_blocks - 1) * page_size)
        vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.model_executor.initialize_from_config(num_gpu_blocks)
        # NOTE: one group: every layer is full attention. vLLM also lists the
        # workers' tensors (kv_cache_tensors); ours allocate their own.
        layer_names = list(kv_cache_spec)
        group_spec = next(iter(kv_cache_spec.values()), None) or FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size, num_kv_heads=1, head_size=1,
            dtype=vllm_config.model_config.dtype)
        return KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(layer_names, group_spec)])

    @staticmethod
    def _get_kv_cache_spec(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
        """Each attention layer's KV-cache format (vLLM asks the workers: get_kv_cache_spec).
        Empty for a model config without hf_config (unit tests with a stand-in executor)."""
        model_config = vllm_config.model_config
        if not model_config.hf_config:
            return {}
        spec = FullAttentionSpec(block_size=vllm_config.cache_config.block_size,
                                 num_kv_heads=model_config.num_kv_heads, head_size=model_config.head_dim,
                                 dtype=model_config.dtype)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(model_config.num_hidden_layers)}

    # -- requests ---------------------------------------------------------------
    def preprocess_add_request(self, request: EngineCoreRequest) -> Request:
        """EngineCoreRequest -> Request, block hashes included.

        NOTE: in EngineCoreProc this runs in the input thread, so hashing a long
        prompt overlaps the busy loop's step instead of delaying it (as in vLLM).
        Raises ValueError / TypeError for a request the engine must not run.
        """
        self._validate_request(request)
        req = Request.from_engine_core_request(request, self.request_block_hasher)
        if req.use_structured_output:
            # NOTE: returns at once: the grammar compiles in the manager's thread
            # pool while the request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.
            self.structured_output_manager.grammar_init(req)
        return req

    def _validate_request(self, request: EngineCoreRequest) -> None:
        """Re-check what the engine relies on: the frontend checked the same,
        but EngineCore is also driven directly (tests, lessons, other clients)."""
        if not isinstance(request.request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request.request_id).__name__}")
        if self.vocab_size is None:      # a model config without hf_config (unit tests)
            return
        validate_params(request.sampling_params, self.vocab_size, self.vllm_config.speculative_config)
        # NOTE: not the length: a prompt that can never fit is the scheduler's
        # to finish (FINISHED_IGNORED), as in vLLM; a token id past the
        # vocabulary would index past the embedding table for the whole batch.
        validate_prompt_token_ids(request.prompt_token_ids, self.vocab_size, max_model_len=None)

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Queue a request (an EngineCoreRequest, or a Request already preprocessed)."""
        with self.step_tracer.add_request(request):
            if isinstance(request, EngineCoreRequest):
                request = self.preprocess_add_request(request)
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests; unknown or already finished ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.step_tracer.end_requests(request_ids)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    def has_work(self) -> bool:
        """Requests to schedule, or steps still in flight whose outputs are due."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    # -- utility calls (the frontend reaches these through UTILITY messages) ------
    def get_scheduler_stats(self) -> SchedulerStats:
        """Queue lengths and KV-cache usage now (does not drain the per-step prefix stats)."""
        num_running, num_waiting = self.scheduler.get_request_counts()
        return SchedulerStats(num_running_reqs=num_running, num_waiting_reqs=num_waiting,
                              step_counter=self.scheduler.current_step,
                              kv_cache_usage=self.scheduler.get_kv_cache_usage())

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget all cached blocks. False if some blocks are still in use, unless
        reset_running_requests: then the running requests are preempted first
        (they recompute their KV) and it always succeeds."""
        return self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # -- the step -----------------------------------------------------------------
    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """One schedule -> execute -> (grammar bitmask) -> sample -> update round.

        Returns (outputs per client index, whether the model ran this step)."""
        if not self.scheduler.has_requests():
            return {}, False
        trace, scheduler_output, future = self._schedule_and_launch()
        with trace:
            # NOTE: the device runs the forward while the host builds the bitmask.
            grammar_output = self._get_grammar_bitmask(scheduler_output, trace)
            model_output = future.result()
            if model_output is None:
                model_output = self.model_executor.sample_tokens(grammar_output)
            outputs = self._update_from_output(scheduler_output, model_output, trace)
        trace.end()
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def post_step(self, model_executed: bool) -> None:
        """Speculative decoding: hand the drafts the worker proposed after this step to
        the scheduler, for the next schedule() to verify.

        NOTE: v0.27.1 calls post_step from its callers (the busy loop,
        InprocClient) after step(); here the step calls it right after
        update_from_output, so every caller of step() (lessons, tests) gets it
        and the step's snapshot shows the drafts proposed for the next step.
        With async scheduling the drafts stay on the device (the scheduler
        schedules -1 placeholders for them): nothing to hand over, as in v0.27.1."""
        if self.check_for_draft_tokens and not self.async_scheduling and model_executed:
            draft_token_ids = self.model_executor.take_draft_token_ids()
            if draft_token_ids is not None:
                self.scheduler.update_draft_token_ids(draft_token_ids)

    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Async scheduling: launch a new step if there is room, then (only once
        the queue is full, or nothing is left to launch) wait for the oldest.

        NOTE: the first call launches step 1 and returns at once with no
        outputs; every later call launches step N+1 and then waits for step N.
        The wait therefore starts with step N+1 already queued behind step N
        on the device, so the device never runs dry while the host turns step
        N's tokens into outputs and schedules step N+2.
        NOTE: a structured-output request whose previous token is still in
        flight (pending_structured_output_tokens) cannot get its bitmask yet:
        that step's forward is launched, but its sampling is deferred until
        step N's tokens have advanced the grammar (v0.27.1's rule).
        """
        batch_queue = self.batch_queue
        assert batch_queue is not None          # this step function is chosen only with one
        model_executed = False
        deferred: tuple[SchedulerOutput, Future, StepTrace | NullStepTrace] | None = None
        if self.scheduler.has_requests():
            trace, scheduler_output, exec_future = self._schedule_and_launch()
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            if model_executed and scheduler_output.pending_structured_output_tokens:
                deferred = (scheduler_output, exec_future, trace)
            else:
                if model_executed:
                    future = self._sample_non_block(scheduler_output, trace)
                else:
                    future = exec_future       # nothing to sample: execute_model answered EMPTY
                batch_queue.appendleft((future, scheduler_output, exec_future, trace))
                if len(batch_queue) < self.batch_queue_size and (model_executed or self.scheduler.has_requests()):
                    return {}, model_executed
        elif not batch_queue:
            return {}, False
        future, scheduler_output, exec_future, trace = batch_queue.pop()
        with trace:
            model_output = future.result()
            if model_output is None:
                exec_future.result()        # NOTE: raises execute_model's error, if that is why
                raise RuntimeError("sample_tokens returned no output")
            outputs = self._update_from_output(scheduler_output, model_output, trace)
        trace.end()
        if deferred is not None:
            # NOTE: only now, after step N's update_from_output, are step N's
            # tokens in the grammars: this step's bitmask can be built.
            scheduler_output, exec_future, trace = deferred
            if self.check_for_draft_tokens and scheduler_output.scheduled_spec_decode_tokens:
                # The drafts this step verifies (proposed on the device after step N), cut
                # where the grammars refuse them (-1s) before the bitmask is built over them.
                draft_token_ids = self.model_executor.take_draft_token_ids()
                if draft_token_ids is not None:
                    self.scheduler.update_draft_token_ids_in_output(draft_token_ids, scheduler_output)
            future = self._sample_non_block(scheduler_output, trace)
            batch_queue.appendleft((future, scheduler_output, exec_future, trace))
        return outputs, model_executed

    def _sample_non_block(self, scheduler_output: SchedulerOutput, trace: StepTrace | NullStepTrace) -> Future:
        with trace:
            grammar_output = self._get_grammar_bitmask(scheduler_output, trace)
            return self.model_executor.sample_tokens(grammar_output, non_block=True)

    def _get_grammar_bitmask(self, scheduler_output: SchedulerOutput,
                             trace: StepTrace | NullStepTrace) -> GrammarOutput | None:
        """The step's grammar bitmask (None without structured-output requests)."""
        with trace.grammar_bitmask() as span:
            grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
            span.built(grammar_output)
        return grammar_output

    def _schedule_and_launch(self) -> tuple[StepTrace | NullStepTrace, SchedulerOutput, Future]:
        """Schedule a step and enqueue its forward; return (its trace, still
        open: see StepTrace; its output; execute_model's future)."""
        trace = self.step_tracer.start_step()
        with trace:
            with trace.schedule():
                scheduler_output = self.scheduler.schedule()
            # The step's attributes and links; with async scheduling, its snapshot too.
            trace.scheduled(scheduler_output)
            future = self.model_executor.execute_model(scheduler_output, non_block=True)
        return trace, scheduler_output, future

    def _update_from_output(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput,
                            trace: StepTrace | NullStepTrace) -> dict[int, EngineCoreOutputs]:
        with trace.update_from_output():
            if model_output.verified_draft_token_ids is not None and scheduler_output.num_invalid_spec_tokens is None:
                # Async speculative decoding: the drafts this step verified, over the -1 placeholders.
                # NOTE: not for a deferred step whose drafts step_with_batch_queue already put
                # in place (num_invalid_spec_tokens set), checked against the grammars before its
                # bitmask: the same drafts against the same grammar states would be cut at the
                # same place again. v0.27.1 checks a step's drafts once.
                self.scheduler.update_draft_token_ids_in_output(
                    DraftTokenIds(model_output.req_ids, model_output.verified_draft_token_ids), scheduler_output)
            errors = self._finish_error_requests(model_output.error_req_ids)
            outputs = self.scheduler.update_from_output(scheduler_output, model_output)
            for client_index, output in errors:
                outputs.setdefault(client_index, EngineCoreOutputs()).outputs.append(output)
        self.post_step(model_executed=scheduler_output.total_num_scheduled_tokens > 0)
        # Without async scheduling, the step's snapshot: taken after the update, it shows the step's result.
        trace.updated(outputs)
        return outputs

    def _finish_error_requests(self, error_req_ids: list[str] | None) -> list[tuple[int, EngineCoreOutput]]:
        """Finish the requests the worker could not run with FINISHED_ERROR; their outputs.

        NOTE: vLLM finishes its error_req_ids (e.g. a failed KV load) inside
        Scheduler.update_from_output; here it happens just before that call,
        through the scheduler's finish_requests (blocks freed, the workers told
        next step), so update_from_output then skips them like aborted ones.
        """
        if not error_req_ids:
            return []
        requests = [req for req_id in error_req_ids
                    if (req := self.scheduler.requests.get(req_id)) is not None and not req.is_finished()]
        self.scheduler.finish_requests([req.request_id for req in requests], RequestStatus.FINISHED_ERROR)
        for req in requests:
            logger.warning("Request %s failed in the worker: finished with FINISHED_ERROR; "
                           "the other requests continue.", req.request_id)
        return [(req.client_index, EngineCoreOutput(
                    request_id=req.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
                    events=req.take_events(), trace_headers=req.trace_headers))
                for req in requests]

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.structured_output_manager.clear_backend()
        self.model_executor.shutdown()
        # NOTE: frozen objects are never collected; a process that builds
        # another engine (tests, notebooks) must get this one's cycles back.
        gc.unfreeze()
        if self._gc_debug_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_debug_callback)
