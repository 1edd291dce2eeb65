"""AsyncLLM: the asyncio frontend the HTTP server drives.

Mirrors vllm/v1/engine/async_llm.py. Per request:

    generate()  -> InputProcessor.process_inputs  (tokenize, validate -> EngineCoreRequest)
                -> OutputProcessor.add_request     (with a RequestOutputCollector)
                -> engine_core.add_request_async   (ZMQ to EngineCoreProc)
                ... awaits its collector, yields RequestOutputs until finished

and one background task for everybody:

    output_handler: engine_core.get_output_async() -> OutputProcessor.process_outputs
                    (detokenize, stop strings, put into the collectors)
                    -> abort stop-string finishes in the engine -> stat loggers

A request with n > 1 is fanned out into n child requests here
(engine/parallel_sampling.py), which share one collector; the engine sees n
ordinary requests. Simplified: no LoRA / multimodal. As in vLLM, the engine's request id is the caller's id plus a random suffix
(InputProcessor.assign_request_id), so two callers may use the same id; the
RequestOutputs carry the caller's id. The HTTP server tokenizes in its own
thread pool and passes token ids; a text prompt given here is tokenized on
the caller's thread.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from vllm_anatomy.config import ModelConfig, VllmConfig
from vllm_anatomy.engine.arg_utils import EngineArgs
from vllm_anatomy.engine.core_client import EngineCoreClient, cancel_task_threadsafe
from vllm_anatomy.engine.exceptions import EngineDeadError, EngineGenerateError
from vllm_anatomy.engine.input_processor import InputProcessor, PromptType
from vllm_anatomy.engine.output_processor import OutputProcessor, RequestOutputCollector
from vllm_anatomy.engine.parallel_sampling import fan_out
from vllm_anatomy.engine.protocol import SchedulerStats
from vllm_anatomy.metrics.stats import IterationStats
from vllm_anatomy.outputs import RequestOutput
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.tracing.factory import make_recorder
from vllm_anatomy.tracing.recorder import Recorder
from vllm_anatomy.tracing.request_tracer import make_request_tracer
from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

# Outputs are processed in slices this big, yielding to the event loop between
# slices so that a huge batch does not stall the HTTP handlers (vLLM's value).
VLLM_V1_OUTPUT_PROC_CHUNK_SIZE = 128


class AsyncLLM:
    """asyncio engine client.

    `stat_loggers`: objects with `record(scheduler_stats, iteration_stats)`,
    called after every processed batch (scheduler_stats may be None).
    """

    def __init__(self, vllm_config: VllmConfig, *, multiprocess: bool = True,
                 recorder: Recorder | None = None, stat_loggers: list | None = None) -> None:
        self.vllm_config = vllm_config
        self.model_config: ModelConfig = vllm_config.model_config
        # NOTE: a recorder we make is ours to shut down (flush the exporters).
        self._owns_recorder = recorder is None
        self.recorder = recorder if recorder is not None else make_recorder(vllm_config, "frontend")
        self.request_tracer = make_request_tracer(self.recorder, vllm_config.model_config.model)
        self.tokenizer = get_tokenizer(self.model_config.model)
        self.input_processor = InputProcessor(self.model_config, self.tokenizer,
                                              speculative_config=vllm_config.speculative_config)
        self.output_processor = OutputProcessor(self.tokenizer, self.request_tracer)
        self.stat_loggers: list = list(stat_loggers or [])
        self.engine_core = EngineCoreClient.make_client(
            multiprocess_mode=multiprocess, asyncio_mode=True, vllm_config=vllm_config,
            recorder=self.recorder)
        self.output_handler: asyncio.Task | None = None
        # Set once a shutdown began (drain): no new request is accepted.
        self._shutdown_reason: str | None = None
        # Set by the output handler / abort() when a drain waits and nothing is left in flight.
        self._drained: asyncio.Event | None = None
        # NOTE: (as vLLM) start the output handler now if a loop runs (the HTTP
        # server's case): it reads ENGINE_CORE_DEAD, so a death is noticed even
        # if no request ever came, and the server's watchdog waits on it.
        try:
            asyncio.get_running_loop()
            self._run_output_handler()
        except RuntimeError:
            pass

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, multiprocess: bool = True,
                         recorder: Recorder | None = None) -> "AsyncLLM":
        return cls(engine_args.create_engine_config(), multiprocess=multiprocess, recorder=recorder)

    # -- state ------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.output_handler is None or not self.output_handler.done()

    @property
    def errored(self) -> bool:
        """No new request can be served: the engine is dead, or shutting down."""
        return self._shutdown_reason is not None or self.engine_core.engine_dead or not self.is_running

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(self._shutdown_reason) if self._shutdown_reason else EngineDeadError()

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    def get_tokenizer(self):
        return self.tokenizer

    # -- requests ---------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None,
                          trace_headers: dict[str, str] | None = None,
                          priority: int = 0) -> RequestOutputCollector:
        """Validate and send one request; returns the collector its outputs arrive in.
        priority: under --scheduling-policy priority, lower runs first."""
        if self.errored:
            raise self.dead_error
        attrs: dict[str, Any] = {"vllm_anatomy.request_id": request_id}
        # The request's span opens first (a child of the HTTP span, or of the caller's): admitting it is part of it.
        with self.request_tracer.admitting(request_id, self.request_tracer.caller_headers(trace_headers),
                                           getattr(params, "n", 1)), \
                self.recorder.span("AsyncLLM.add_request", **attrs):
            return await self._add_request(request_id, prompt, params, arrival_time, trace_headers, priority)

    async def _add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                           arrival_time: float | None,
                           trace_headers: dict[str, str] | None, priority: int = 0) -> RequestOutputCollector:
        with self.recorder.span("InputProcessor.process_inputs"):
            prompt_text, request = self.input_processor.process_inputs(
                request_id, prompt, params, arrival_time, trace_headers=trace_headers, priority=priority)
            self.input_processor.assign_request_id(request)
        # NOTE: the collector has the parent's id (n > 1): aborting it aborts every child.
        queue = RequestOutputCollector(params.output_kind, request.request_id)
        added: list[str] = []
        engine_request_id = request.request_id     # (fan_out renames the object: it becomes the last child)
        try:
            for parent_req, index, child in fan_out(request):
                # NOTE: register with the OutputProcessor *before* the engine can answer.
                self.output_processor.add_request(child, prompt_text, queue, parent_req, index)
                added.append(child.request_id)
                # The request's span (a child of the HTTP span when traceparent came in;
                # with n > 1 a child's, under the parent's); its own context then rides
                # to the engine on the request.
                self.request_tracer.on_add(child, parent_req, index)
                await self.engine_core.add_request_async(child)
        except BaseException:
            self.output_processor.abort_requests(added, trace_reason="error")
            self.request_tracer.discard_admission(engine_request_id)
            # Siblings the engine already took must not stay there.
            if added[:-1] and not self.engine_core.engine_dead:
                await self.engine_core.abort_requests_async(added[:-1])
            raise
        self._run_output_handler()
        return queue

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       *, trace_headers: dict[str, str] | None = None, priority: int = 0
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's RequestOutputs until one says finished.

        prompt: text, a list of token ids, or {"prompt_token_ids": [...]}.
        Closing or cancelling the generator aborts the request in the engine.
        """
        q: RequestOutputCollector | None = None
        try:
            q = await self.add_request(request_id, prompt, sampling_params, trace_headers=trace_headers,
                                       priority=priority)
            finished = False
            while not finished:
                # NOTE: get_nowait first: no suspension when an output is ready.
                out = q.get_nowait() or await q.get()
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer went away (e.g. an HTTP client disconnected): free the blocks.
            if q is not None:
                await self.abort(q.request_id)
            raise
        except (EngineDeadError, ValueError, TypeError):
            raise    # engine death, or a request refused by validation
        except Exception as e:
            if q is not None:
                await self.abort(q.request_id)
            raise EngineGenerateError(f"Request {request_id} failed: {e!r}") from e

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        known = self.output_processor.abort_requests(ids)
        # NOTE: a dead engine holds no blocks any more: nothing to free there.
        if known and not self.engine_core.engine_dead:
            await self.engine_core.abort_requests_async(known)
        self._notify_if_drained()

    # -- the output handler ------------------------------------------------------
    def _run_output_handler(self) -> None:
        if self.output_handler is None:
            self.output_handler = asyncio.get_running_loop().create_task(
                self._output_handler_loop(), name="AsyncLLM.output_handler")

    async def _output_handler_loop(self) -> None:
        engine_core, output_processor = self.engine_core, self.output_processor
        try:
            while True:
                outputs = await engine_core.get_output_async()
                iteration_stats = IterationStats()
                batch = outputs.outputs
                for start in range(0, len(batch), VLLM_V1_OUTPUT_PROC_CHUNK_SIZE):
                    if start:
                        await asyncio.sleep(0)
                    chunk = batch[start:start + VLLM_V1_OUTPUT_PROC_CHUNK_SIZE]
                    attrs: dict[str, Any] = {"vllm_anatomy.num_outputs": len(chunk)}
                    # (in the trace of the step that made the outputs: it follows from their last hop)
                    with self.recorder.span("OutputProcessor.process_outputs", follows_from=outputs.trace_headers,
                                            **attrs):
                        processed = output_processor.process_outputs(chunk, outputs.timestamp, iteration_stats)
                        # Stop strings finished these here; the engine still runs them.
                        await engine_core.abort_requests_async(processed.reqs_to_abort)
                self._record_stats(outputs.scheduler_stats, iteration_stats)
                self._notify_if_drained()
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            logger.error("AsyncLLM output_handler: %s", e)   # the engine logged its own traceback
            output_processor.propagate_error(e)
        except Exception as e:
            logger.exception("AsyncLLM output_handler failed.")
            output_processor.propagate_error(EngineDeadError(f"output handler failed: {e!r}"))

    def _record_stats(self, scheduler_stats: SchedulerStats | None,
                      iteration_stats: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats)
            except Exception:   # a broken logger must not stop serving
                logger.exception("Stat logger %r failed.", stat_logger)

    # -- utility calls -------------------------------------------------------------
    async def get_scheduler_stats(self) -> SchedulerStats:
        """Queue lengths and KV-cache usage, asked from the engine now."""
        return await self.engine_core.get_scheduler_stats_async()

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget the cached blocks; with reset_running_requests the running requests are
        preempted first (they recompute their KV), else False while any holds blocks."""
        return await self.engine_core.reset_prefix_cache_async(reset_running_requests, reset_connector)

    # -- shutdown -------------------------------------------------------------------
    async def drain(self, timeout: float, abort_now: asyncio.Event | None = None) -> list[str]:
        """Graceful shutdown, the frontend's half: refuse new requests, let those in
        flight finish for at most `timeout` s (or until `abort_now` is set), then fail
        the rest with EngineDeadError (a stream ends with an error event, a plain
        request gets 503). Returns the ids it failed. The engine still runs; shutdown() stops it.

        NOTE: vLLM drains inside EngineCoreProc (`shutdown_state`; new requests
        rejected) and its parent kills the engine after --shutdown-timeout. The
        frontend waits here instead, so that what is left when time is up ends
        with an error its client can read rather than a cut connection.
        """
        self._shutdown_reason = "The server is shutting down."
        if timeout > 0:
            await self._wait_for_requests_to_drain(timeout, abort_now)
        return await self._fail_all_requests(
            f"The server shut down before this request finished (--shutdown-timeout {timeout:g} s).")

    async def _wait_for_requests_to_drain(self, timeout: float, abort_now: asyncio.Event | None) -> None:
        """Until nothing is in flight, the engine is dead, `abort_now` is set, or `timeout` s."""
        self._drained = asyncio.Event()
        self._notify_if_drained()
        events = [asyncio.ensure_future(e.wait()) for e in (self._drained, abort_now) if e is not None]
        # NOTE: the output handler ends only when the engine dies: nothing would finish then.
        handler = [self.output_handler] if self.output_handler is not None else []
        try:
            await asyncio.wait(events + handler, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in events:
                waiter.cancel()

    def _notify_if_drained(self) -> None:
        if self._drained is not None and not self.output_processor.has_unfinished_requests():
            self._drained.set()

    async def _fail_all_requests(self, message: str) -> list[str]:
        """End every request in flight with EngineDeadError(message); abort them in the engine."""
        output_processor = self.output_processor
        ids = list(output_processor.request_states)
        if not ids:
            return []
        output_processor.propagate_error(EngineDeadError(message))
        # NOTE: the error is already in each collector, and an exception there
        # wins over the "abort" output that forgetting the request would add.
        output_processor.abort_requests(ids, trace_reason="error")
        if not self.engine_core.engine_dead:
            try:
                await self.engine_core.abort_requests_async(ids)
            except EngineDeadError:
                pass        # died meanwhile: nothing left to free there
        return ids

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the output handler and the engine (process, sockets, temp dir).

        `timeout`: seconds the engine process gets to exit after SIGTERM before SIGKILL."""
        cancel_task_threadsafe(self.output_handler)
        self.engine_core.shutdown(timeout)
        if self._owns_recorder:
            self.recorder.shutdown()

    def __repr__(self) -> str:
        return f"AsyncLLM(model={self.model_config.model!r}, running={self.is_running})"
