"""LLMEngine: the synchronous frontend the offline `LLM` drives.

Mirrors vllm/v1/engine/llm_engine.py: InputProcessor -> EngineCoreClient ->
OutputProcessor, polled by `step()`. Which client (vLLM's
`EngineCoreClient.make_client(multiprocess_mode, asyncio_mode=False)`):

    InprocClient   EngineCore in this process: `step()` runs one engine step,
                   then processes its outputs (the lessons' engine: its
                   scheduler and executor are `engine.engine_core`)
    SyncMPClient   EngineCoreProc in its own process steps on its own; `step()`
                   takes the next outputs from its queue and processes them,
                   so detokenizing overlaps the engine's next step

`LLMEngine(vllm_config)` runs in-process; `LLMEngine.from_engine_args` (what
LLM uses) reads VLLM_ENABLE_V1_MULTIPROCESSING (vllm_anatomy/envs.py) as vLLM does.

Tracing: without an injected recorder, one is made from
vllm_config.observability_config (trace_level, trace_dir, otlp_traces_endpoint);
its RequestTracer keeps one `llm_request` span per request (a no-op one when
tracing is off). An engine process makes its own recorder on the same run
store, so a run recorded from either mode has the engine's steps.
"""
from __future__ import annotations

import logging
from typing import Any

from vllm_anatomy import envs
from vllm_anatomy.config import VllmConfig
from vllm_anatomy.engine.arg_utils import EngineArgs
from vllm_anatomy.engine.core import EngineCore
from vllm_anatomy.engine.core_client import EngineCoreClient
from vllm_anatomy.engine.input_processor import InputProcessor, PromptType
from vllm_anatomy.engine.output_processor import OutputProcessor
from vllm_anatomy.engine.parallel_sampling import fan_out
from vllm_anatomy.engine.protocol import EngineCoreRequest
from vllm_anatomy.metrics.stats import IterationStats
from vllm_anatomy.outputs import RequestOutput
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.tracing.factory import make_recorder, run_meta
from vllm_anatomy.tracing.recorder import Recorder
from vllm_anatomy.tracing.request_tracer import make_request_tracer
from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:

    def __init__(self, vllm_config: VllmConfig, recorder: Recorder | None = None,
                 multiprocess_mode: bool = False) -> None:
        self.vllm_config = vllm_config
        # NOTE: a recorder we make is ours to shut down (flush the exporters).
        self._owns_recorder = recorder is None
        self.recorder = recorder if recorder is not None else make_recorder(vllm_config, "frontend")
        self.request_tracer = make_request_tracer(self.recorder, vllm_config.model_config.model)
        self.tokenizer = get_tokenizer(vllm_config.model_config.model)
        self.input_processor = InputProcessor(vllm_config.model_config, self.tokenizer,
                                              speculative_config=vllm_config.speculative_config)
        self.output_processor = OutputProcessor(self.tokenizer, self.request_tracer)
        self.engine_core_client = EngineCoreClient.make_client(
            multiprocess_mode=multiprocess_mode, asyncio_mode=False, vllm_config=vllm_config,
            recorder=self.recorder)
        # NOTE: vLLM names the client itself `engine_core` (and keeps
        # `model_executor` beside it "for v0 compatibility"). Here `engine_core`
        # is the EngineCore when it runs in this process, None when it runs in
        # its own: the lessons, notebooks and tests read its scheduler and
        # executor directly, and the client is a separate attribute.
        self.engine_core: EngineCore | None = getattr(self.engine_core_client, "engine_core", None)
        if self._owns_recorder:   # the config as resolved at start-up (num_gpu_blocks, ...)
            self.recorder.set_run_meta("config", run_meta(vllm_config)["config"])
        self.last_scheduler_stats = None
        # Counters named after vLLM's Prometheus metrics (prefix-cache counts in
        # tokens); what only this engine counts carries our own prefix.
        self.counters: dict[str, float] = {
            "vllm:num_preemptions": 0, "vllm:prefix_cache_queries": 0, "vllm:prefix_cache_hits": 0,
            "vllm:prompt_tokens": 0, "vllm:generation_tokens": 0, "vllm:request_success": 0,
            "vllm_anatomy:engine_steps": 0,
        }
        if vllm_config.speculative_config is not None:
            # vLLM's spec-decode counters (spec_decode/metrics.py); per position: `..._per_pos:<p>`.
            k = vllm_config.speculative_config.num_speculative_tokens
            self.counters.update({"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
                                  "vllm:spec_decode_num_accepted_tokens": 0,
                                  **{f"vllm:spec_decode_num_accepted_tokens_per_pos:{p}": 0 for p in range(k)}})

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, recorder: Recorder | None = None,
                         enable_multiprocessing: bool = False) -> "LLMEngine":
        """Build the config, then the engine; VLLM_ENABLE_V1_MULTIPROCESSING=1 puts EngineCore
        in its own process (as in vLLM; our default is 0, see envs.py)."""
        vllm_config = engine_args.create_engine_config()
        if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            logger.debug("Enabling multiprocessing for LLMEngine.")
            enable_multiprocessing = True
        return cls(vllm_config, recorder, multiprocess_mode=enable_multiprocessing)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        self.add_processed_request(*self.process_inputs(request_id, prompt, params, arrival_time,
                                                        priority=priority))

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None, priority: int = 0) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and validate (raises on bad input); nothing is added yet."""
        attrs: dict[str, Any] = {"vllm_anatomy.request_id": request_id}
        # (the request's span opens here: tokenizing is part of its trace)
        with self.request_tracer.admitting(request_id, self.request_tracer.caller_headers(None),
                                           getattr(params, "n", 1)), \
                self.recorder.span("InputProcessor.process_inputs", **attrs):
            return self.input_processor.process_inputs(request_id, prompt, params, arrival_time,
                                                       priority=priority)

    def add_processed_request(self, prompt_text: str | None, request: EngineCoreRequest) -> None:
        """Add a processed request; with n > 1, its n child requests (engine/parallel_sampling.py)."""
        added: list[str] = []
        request_id = request.request_id     # (fan_out renames the object: it becomes the last child)
        try:
            for parent_req, index, child in fan_out(request):
                self.output_processor.add_request(child, prompt_text, None, parent_req, index)
                added.append(child.request_id)
                # (an in-process EngineCore.add_request nests under the request's span)
                with self.request_tracer.adding(child, parent_req, index):
                    self.engine_core_client.add_request(child)
                self.counters["vllm:prompt_tokens"] += len(child.prompt_token_ids)
        except BaseException:
            # NOTE: refused by EngineCore's own checks (in-process: it raises;
            # an engine process instead finishes it with an error output), or
            # the engine is dead: forget it here too, or
            # has_unfinished_requests() would wait for it forever. Siblings the
            # engine already took are aborted there.
            self.output_processor.abort_requests(added, trace_reason="error")
            self.request_tracer.discard_admission(request_id)
            if added[:-1] and not self.engine_core_client.engine_dead:
                self.engine_core_client.abort_requests(added[:-1])
            raise

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.engine_core_client.reset_prefix_cache(reset_running_requests, reset_connector)

    def abort_request(self, request_ids: list[str]) -> None:
        known = self.output_processor.abort_requests(request_ids)
        # NOTE: a dead engine process holds no blocks any more: nothing to free there.
        if not self.engine_core_client.engine_dead:
            self.engine_core_client.abort_requests(known)

    def has_unfinished_requests(self) -> bool:
        # NOTE: with async scheduling a step may still be in flight after the
        # last request finished (e.g. an empty one scheduled while the final
        # tokens were on their way). vLLM's engine process drains it in its
        # busy loop; in-process, stepping until it is processed does that.
        return self.output_processor.has_unfinished_requests() or self.engine_core_client.has_steps_in_flight()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs (in-process: run the step; with an engine
        process: wait for its next outputs), turned into RequestOutputs.
        Raises EngineDeadError if the engine process died."""
        outputs = self.engine_core_client.get_output()
        if outputs.scheduler_stats is None and not outputs.outputs:
            return []   # an in-process step that scheduled nothing, or only launched a batch
        if outputs.scheduler_stats is not None:
            self._record_stats(outputs.scheduler_stats)
        iteration_stats = IterationStats()
        attrs: dict[str, Any] = {"vllm_anatomy.num_outputs": len(outputs.outputs)}
        # (in the trace of the step that made the outputs: it follows from it)
        with self.recorder.span("OutputProcessor.process_outputs", follows_from=outputs.trace_headers, **attrs):
            processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp,
                                                              iteration_stats)
            # Stop strings finished these on the frontend; free them in the engine.
            self.engine_core_client.abort_requests(processed.reqs_to_abort)
        # NOTE: counted from the IterationStats, as vLLM's PrometheusStatLogger
        # does: tokens and finishes of the requests the frontend still follows.
        # A request a stop string finished here runs on in the engine until the
        # abort lands; the tokens it makes meanwhile are not counted, however
        # far the engine (in its own process) got. Likewise, a preemption is
        # counted when its PREEMPTED event reaches the frontend (with the
        # request's next output), not by the step that scheduled it: under
        # async scheduling the stats travel with the outputs of the step before.
        c = self.counters
        c["vllm:generation_tokens"] += iteration_stats.num_generation_tokens
        c["vllm:request_success"] += len(iteration_stats.finished_requests)
        c["vllm:num_preemptions"] += iteration_stats.num_preempted_reqs
        return processed.request_outputs

    def _record_stats(self, stats) -> None:
        self.last_scheduler_stats = stats
        c = self.counters
        c["vllm_anatomy:engine_steps"] += 1
        c["vllm:prefix_cache_queries"] += stats.prefix_cache_queries
        c["vllm:prefix_cache_hits"] += stats.prefix_cache_hits
        spec = stats.spec_decoding_stats
        if spec is not None:
            c["vllm:spec_decode_num_drafts"] += spec.num_drafts
            c["vllm:spec_decode_num_draft_tokens"] += spec.num_draft_tokens
            c["vllm:spec_decode_num_accepted_tokens"] += spec.num_accepted_tokens
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                c[f"vllm:spec_decode_num_accepted_tokens_per_pos:{pos}"] += n

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine (an engine process: SIGTERM, then SIGKILL after `timeout` s;
        its sockets and temp dir removed) and flush our recorder. Safe to call twice.

        NOTE: requests still unfinished are aborted here first, so their
        `llm_request` spans end (finish reason "abort") and are exported: the
        spans already exported under them (tokenizing, the ZMQ hop, the
        engine's add) keep their parent. The engine aborts its own on SIGTERM."""
        self.output_processor.abort_requests(list(self.output_processor.request_states))
        self.engine_core_client.shutdown(timeout)
        if self._owns_recorder:
            self.recorder.shutdown()
