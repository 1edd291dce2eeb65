"""Statistics the frontend computes from each batch of engine outputs.

Mirrors vllm/v1/metrics/stats.py. Three plain records:

- `RequestStateStats`: kept per live request in the OutputProcessor
  (timestamps and token counts).
- `IterationStats`: one per batch of EngineCoreOutputs processed by the
  frontend (one engine step): token counts, the TTFTs and inter-token
  latencies observed in this batch, and the requests that finished in it.
- `FinishedRequestStats`: one per request that finished in this batch.

A stat logger (e.g. a Prometheus exporter) receives
`record(scheduler_stats, iteration_stats)` after every batch: counters add the
token counts, histograms observe each list element.

Clocks (as in vLLM):
- `arrival_time` and `iteration_timestamp` are wall-clock `time.time()`; TTFT
  and e2e latency are measured on it, from the frontend's point of view.
- `queued_ts`, `scheduled_ts`, `first_token_ts`, `last_token_ts` are the engine
  process' `time.monotonic()` (EngineCoreEvent / EngineCoreOutputs.timestamp);
  only differences between them are used (queue, prefill, decode times, ITL).
  NOTE: CLOCK_MONOTONIC is system-wide on Linux, so the engine process' readings
  are comparable with each other even though they come from another process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_anatomy.engine.protocol import (EngineCoreEvent, EngineCoreEventType, EngineCoreOutput,
                                          SchedulerStats)

__all__ = ["RequestStateStats", "FinishedRequestStats", "IterationStats", "SchedulerStats"]


@dataclass
class RequestStateStats:
    """Per-request running stats, updated as outputs arrive (seconds)."""
    arrival_time: float = 0.0           # wall clock, when the frontend accepted it
    num_generation_tokens: int = 0
    queued_ts: float = 0.0              # engine monotonic clock from here on
    scheduled_ts: float = 0.0           # first time scheduled
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0    # TTFT, wall clock


@dataclass
class FinishedRequestStats:
    """One finished request (all times in seconds)."""
    finish_reason: str                  # "stop" | "length" | "abort" | "error" | ...
    e2e_latency: float = 0.0            # arrival -> finish, wall clock
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    queued_time: float = 0.0            # QUEUED -> first SCHEDULED
    prefill_time: float = 0.0           # first SCHEDULED -> first token
    inference_time: float = 0.0         # first SCHEDULED -> last token
    decode_time: float = 0.0            # first token -> last token
    mean_time_per_output_token: float = 0.0
    num_cached_tokens: int = 0


@dataclass
class IterationStats:
    """Stats of one processed batch of engine outputs (one engine step)."""
    iteration_timestamp: float = field(default_factory=time.time)
    num_generation_tokens: int = 0      # new tokens in this batch
    num_prompt_tokens: int = 0          # prompts of requests that got their first token
    # Of those prompt tokens, the ones found in the prefix cache (vLLM:
    # prompt_token_stats.cached_tokens); the rest were computed.
    num_cached_prompt_tokens: int = 0
    num_preempted_reqs: int = 0         # PREEMPTED events seen in this batch
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)

    def _time_since(self, start: float) -> float:
        return self.iteration_timestamp - start

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens prefilled by computing them (vLLM: prompt_token_stats.computed)."""
        return self.num_prompt_tokens - self.num_cached_prompt_tokens

    def update_from_output(self, output: EngineCoreOutput, engine_core_timestamp: float,
                           is_prefilling: bool, prompt_len: int, req_stats: RequestStateStats) -> None:
        num_new = len(output.new_token_ids)
        self.num_generation_tokens += num_new
        if is_prefilling:
            self.num_prompt_tokens += prompt_len
            self.num_cached_prompt_tokens += min(output.num_cached_tokens, prompt_len)
            ttft = self._time_since(req_stats.arrival_time)
            self.time_to_first_tokens_iter.append(ttft)
            req_stats.first_token_latency = ttft
        req_stats.num_generation_tokens += num_new
        if output.events is not None:
            self.update_from_events(output.events, req_stats)
        if num_new == 0:
            return   # e.g. an aborted or ignored request: no token, no latency
        if is_prefilling:
            req_stats.first_token_ts = engine_core_timestamp
        else:
            # NOTE: one value per output, not per token: with several new tokens in
            # one step (spec decode) vLLM also records one interval.
            self.inter_token_latencies_iter.append(engine_core_timestamp - req_stats.last_token_ts)
        req_stats.last_token_ts = engine_core_timestamp

    def update_from_events(self, events: list[EngineCoreEvent], req_stats: RequestStateStats) -> None:
        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                req_stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if req_stats.scheduled_ts == 0.0:   # first time only (not after preemption)
                    req_stats.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                self.num_preempted_reqs += 1

    def update_from_finished_request(self, finish_reason: str, num_prompt_tokens: int,
                                     max_tokens_param: int | None, req_stats: RequestStateStats,
                                     num_cached_tokens: int = 0) -> None:
        s = req_stats
        # NOTE: a request aborted before it was scheduled has no engine timestamps;
        # its interval stats stay 0 instead of becoming nonsense differences.
        scheduled = s.scheduled_ts > 0.0
        has_tokens = s.first_token_ts > 0.0
        decode_time = s.last_token_ts - s.first_token_ts if has_tokens else 0.0
        self.finished_requests.append(FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_latency=self._time_since(s.arrival_time),
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=s.num_generation_tokens,
            max_tokens_param=max_tokens_param,
            queued_time=s.scheduled_ts - s.queued_ts if scheduled and s.queued_ts > 0.0 else 0.0,
            prefill_time=s.first_token_ts - s.scheduled_ts if scheduled and has_tokens else 0.0,
            inference_time=s.last_token_ts - s.scheduled_ts if scheduled and has_tokens else 0.0,
            decode_time=decode_time,
            mean_time_per_output_token=(decode_time / (s.num_generation_tokens - 1)
                                        if s.num_generation_tokens > 1 else 0.0),
            num_cached_tokens=num_cached_tokens))
