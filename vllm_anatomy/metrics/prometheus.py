"""PrometheusStatLogger: engine statistics as Prometheus metrics for GET /metrics.

Mirrors the PrometheusStatLogger of vllm/v1/metrics/loggers.py: same metric
names, help texts, buckets and labels (`model_name`, `engine`). The frontend
calls `record(scheduler_stats, iteration_stats)` once per batch of engine outputs.

NOTE: vLLM registers into prometheus_client's process-global REGISTRY (one
server per process). Here every app gets its own `CollectorRegistry`, so tests
can build several apps in one process without "Duplicated timeseries" errors.
NOTE: prometheus_client appends `_total` to counter names on exposition:
Counter("vllm:prompt_tokens") is scraped as `vllm:prompt_tokens_total`, exactly
as in vLLM.
Only the metrics this engine produces are defined (no LoRA, KV connector or
multimodal metrics); the spec-decode counters (vllm:spec_decode_*) only with
speculative decoding on (num_speculative_tokens > 0), as in vLLM.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from vllm_anatomy.engine.protocol import FINISH_REASON_STRINGS, SchedulerStats
from vllm_anatomy.spec_decode.metrics import SpecDecodingProm

# Buckets as in vLLM's loggers.py.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
TPOT_BUCKETS = ITL_BUCKETS
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """[1, 2, 5, 10, 20, 50, ...] up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:

    def __init__(self, model_name: str, max_model_len: int, engine_index: int = 0,
                 registry: CollectorRegistry | None = None, num_speculative_tokens: int = 0) -> None:
        # NOTE: without this every counter also exports a `<name>_created`
        # timestamp series; vLLM's /metrics has none (process-wide switch).
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labelnames = ["model_name", "engine"]
        self.labelvalues = [model_name, str(engine_index)]
        self._init_scheduler_metrics()
        self._init_iteration_metrics()
        self._init_request_metrics(max_model_len)
        self.spec_decoding_prom = SpecDecodingProm(num_speculative_tokens, self.labelnames, self.labelvalues,
                                                   self.registry) if num_speculative_tokens > 0 else None

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, self.labelnames, registry=self.registry).labels(*self.labelvalues)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, self.labelnames, registry=self.registry).labels(*self.labelvalues)

    def _histogram(self, name: str, doc: str, buckets: list) -> Histogram:
        return Histogram(name, doc, self.labelnames, buckets=buckets,
                         registry=self.registry).labels(*self.labelvalues)

    def _init_scheduler_metrics(self) -> None:
        """Scheduler state (gauges) and per-step scheduler counters."""
        gauge, counter = self._gauge, self._counter
        self.gauge_scheduler_running = gauge("vllm:num_requests_running",
                                             "Number of requests in model execution batches.")
        self.gauge_scheduler_waiting = gauge("vllm:num_requests_waiting",
                                             "Number of requests waiting to be processed.")
        self.gauge_kv_cache_usage = gauge("vllm:kv_cache_usage_perc",
                                          "KV-cache usage. 1 means 100 percent usage.")
        self.counter_num_preempted_reqs = counter("vllm:num_preemptions",
                                                  "Cumulative number of preemption from the engine.")
        self.counter_prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.counter_prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")

    def _init_iteration_metrics(self) -> None:
        """Per-iteration token counts."""
        counter = self._counter
        self.counter_prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.counter_prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                                    "Number of cached prompt tokens (local + external).")
        self.counter_generation_tokens = counter("vllm:generation_tokens",
                                                 "Number of generation tokens processed.")
        self.histogram_iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS)

    def _init_request_metrics(self, max_model_len: int) -> None:
        """Per finished request: its finish reason, latencies, phases and token counts."""
        histogram = self._histogram
        self.counter_request_success_base = request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            self.labelnames + ["finished_reason"], registry=self.registry)
        # NOTE: one child per finish reason up front, so every series exists at 0
        # before the first request finishes (vLLM does the same).
        self.counter_request_success = {reason: request_success.labels(*self.labelvalues, reason)
                                        for reason in FINISH_REASON_STRINGS}
        self.histogram_time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.histogram_inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.histogram_request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.histogram_e2e_time_request = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
        # The four phases of a request, from its engine-side events (seconds).
        self.histogram_queue_time_request = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS)
        self.histogram_inference_time_request = histogram(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS)
        self.histogram_prefill_time_request = histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS)
        self.histogram_decode_time_request = histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.histogram_num_prompt_tokens_request = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.histogram_num_generation_tokens_request = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats=None) -> None:
        if scheduler_stats is not None:
            self._record_scheduler_stats(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration_stats(iteration_stats)

    def _record_scheduler_stats(self, s: SchedulerStats) -> None:
        self.gauge_scheduler_running.set(s.num_running_reqs)
        self.gauge_scheduler_waiting.set(s.num_waiting_reqs + s.num_skipped_waiting_reqs)
        self.gauge_kv_cache_usage.set(s.kv_cache_usage)
        self.counter_prefix_cache_queries.inc(s.prefix_cache_queries)
        self.counter_prefix_cache_hits.inc(s.prefix_cache_hits)
        if self.spec_decoding_prom is not None and s.spec_decoding_stats is not None:
            self.spec_decoding_prom.observe(s.spec_decoding_stats)

    def _record_iteration_stats(self, it) -> None:
        self.counter_num_preempted_reqs.inc(it.num_preempted_reqs)
        self.counter_prompt_tokens.inc(it.num_prompt_tokens)
        self.counter_prompt_tokens_cached.inc(it.num_cached_prompt_tokens)
        self.counter_generation_tokens.inc(it.num_generation_tokens)
        # NOTE: as v0.27.1, "tokens per engine step" counts prompt tokens when
        # their request's first token arrives (computed ones only) plus the
        # step's generated tokens; a step of pure prefill chunks observes 0.
        self.histogram_iteration_tokens.observe(it.num_computed_prompt_tokens + it.num_generation_tokens)
        for ttft in it.time_to_first_tokens_iter:
            self.histogram_time_to_first_token.observe(ttft)
        for itl in it.inter_token_latencies_iter:
            self.histogram_inter_token_latency.observe(itl)
        for finished in it.finished_requests:
            reason = str(finished.finish_reason)
            child = self.counter_request_success.get(reason)
            if child is None:   # a reason this engine did not know at start-up
                child = self.counter_request_success_base.labels(*self.labelvalues, reason)
            child.inc()
            self.histogram_e2e_time_request.observe(finished.e2e_latency)
            self.histogram_queue_time_request.observe(finished.queued_time)
            self.histogram_prefill_time_request.observe(finished.prefill_time)
            self.histogram_inference_time_request.observe(finished.inference_time)
            self.histogram_decode_time_request.observe(finished.decode_time)
            self.histogram_request_time_per_output_token.observe(finished.mean_time_per_output_token)
            self.histogram_num_prompt_tokens_request.observe(finished.num_prompt_tokens)
            self.histogram_num_generation_tokens_request.observe(finished.num_generation_tokens)
