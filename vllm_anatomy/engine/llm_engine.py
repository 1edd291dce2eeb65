"""LLMEngine: the synchronous frontend the offline `LLM` drives.

Mirrors vllm/v1/engine/llm_engine.py: InputProcessor -> EngineCore ->
OutputProcessor, polled by `step()`. Here EngineCore runs in this process
(vLLM's InprocClient); the multi-process client comes with the server.

Tracing: without an injected recorder, one is made from
vllm_config.observability_config (trace_level, trace_dir, otlp_traces_endpoint);
its RequestTracer keeps one `llm_request` span per request (a no-op one when
tracing is off).
"""
from __future__ import annotations

from vllm_anatomy.config import VllmConfig
from vllm_anatomy.engine.core import EngineCore
from vllm_anatomy.engine.input_processor import InputProcessor, PromptType
from vllm_anatomy.engine.output_processor import OutputProcessor
from vllm_anatomy.engine.protocol import EngineCoreRequest
from vllm_anatomy.metrics.stats import IterationStats
from vllm_anatomy.outputs import RequestOutput
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.tracing.factory import make_recorder, run_meta
from vllm_anatomy.tracing.recorder import Recorder
from vllm_anatomy.tracing.request_tracer import make_request_tracer
from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer



class LLMEngine:

    def __init__(self, vllm_config: VllmConfig, recorder: Recorder | None = None) -> None:
        self.vllm_config = vllm_config
        # NOTE: a recorder we make is ours to shut down (flush the exporters).
        self._owns_recorder = recorder is None
        self.recorder = recorder if recorder is not None else make_recorder(vllm_config, "frontend")
        self.request_tracer = make_request_tracer(self.recorder, vllm_config.model_config.model)
        self.tokenizer = get_tokenizer(vllm_config.model_config.model)
        self.input_processor = InputProcessor(vllm_config.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(vllm_config, self.recorder)
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

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        self.add_processed_request(*self.process_inputs(request_id, prompt, params, arrival_time))

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and validate (raises on bad input); nothing is added yet."""
        with self.recorder.span("InputProcessor.process_inputs", **{"vllm_anatomy.request_id": request_id}):
            return self.input_processor.process_inputs(request_id, prompt, params, arrival_time)

    def add_processed_request(self, prompt_text: str | None, request: EngineCoreRequest) -> None:
        self.output_processor.add_request(request, prompt_text)
        try:
            self._add_to_engine_core(request)
        except BaseException:
            # NOTE: refused by EngineCore's own checks: forget it here too, or
            # has_unfinished_requests() would wait for it forever.
            self.output_processor.abort_requests([request.request_id])
            self.request_tracer.abort_all([request.request_id], "error")
            raise
        self.counters["vllm:prompt_tokens"] += len(request.prompt_token_ids)

    def _add_to_engine_core(self, request: EngineCoreRequest) -> None:
        with self.request_tracer.adding(request):   # an in-process EngineCore.add_request nests under it
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        known = self.output_processor.abort_requests(request_ids)
        self.request_tracer.abort_all(known)
        self.engine_core.abort_requests(known)

    def has_unfinished_requests(self) -> bool:
        # NOTE: with async scheduling a step may still be in flight after the
        # last request finished (e.g. an empty one scheduled while the final
        # tokens were on their way). vLLM's engine process drains it in its
        # busy loop; in-process, stepping until it is processed does that.
        return self.output_processor.has_unfinished_requests() or bool(self.engine_core.batch_queue)

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs_by_client, _ = self.engine_core.step_fn()
        request_outputs: list[RequestOutput] = []
        for outputs in outputs_by_client.values():
            if outputs.scheduler_stats is not None:
                self._record_stats(outputs.scheduler_stats)
            c = self.counters
            for eco in outputs.outputs:
                c["vllm:generation_tokens"] += len(eco.new_token_ids)
                if eco.finished:
                    c["vllm:request_success"] += 1
            iteration_stats = IterationStats()
            with self.recorder.span("OutputProcessor.process_outputs",
                                    **{"vllm_anatomy.num_outputs": len(outputs.outputs)}):
                processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp,
                                                                  iteration_stats)
            # NOTE: as in v0.27.1, a preemption is counted when its PREEMPTED
            # event reaches the frontend (with the request's next output), not
            # by the step that scheduled it: under async scheduling the stats
            # travel with the outputs of the step before.
            c["vllm:num_preemptions"] += iteration_stats.num_preempted_reqs
            request_outputs.extend(processed.request_outputs)
            self.request_tracer.on_outputs(outputs.outputs)
            self.request_tracer.abort_all(processed.reqs_to_abort, "stop")
            # Stop strings finished these on the frontend; free them in the engine.
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return request_outputs

    def _record_stats(self, stats) -> None:
        self.last_scheduler_stats = stats
        c = self.counters
        c["vllm_anatomy:engine_steps"] += 1
        c["vllm:prefix_cache_queries"] += stats.prefix_cache_queries
        c["vllm:prefix_cache_hits"] += stats.prefix_cache_hits

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        if self._owns_recorder:
            self.recorder.shutdown()
