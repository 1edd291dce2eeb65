"""PrometheusStatLogger: the metric names, labels and buckets v0.27.1 exports, fed
by fabricated stats (no engine), and read back through prometheus_client's own
text exposition (the format /metrics serves)."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_anatomy.engine.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, SchedulerStats
from vllm_anatomy.metrics.prometheus import (ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS, TPOT_BUCKETS,
                                             PrometheusStatLogger)
from vllm_anatomy.metrics.stats import IterationStats, RequestStateStats

# Names as v0.27.1's PrometheusStatLogger defines them (counters gain `_total` when
# scraped; the parser reports their family under the name they were defined with).
V0271_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:prompt_tokens", "vllm:prompt_tokens_cached", "vllm:generation_tokens", "vllm:request_success",
    "vllm:iteration_tokens_total", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
}


def scrape(logger: PrometheusStatLogger) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(logger.registry).decode())}


def buckets(family) -> list[float]:
    return sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")} - {float("inf")})


def sample(family, suffix: str = "", **labels) -> float:
    [value] = [s.value for s in family.samples if s.name == family.name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items())]
    return value


def test_every_v0271_metric_is_exported_with_its_labels():
    families = scrape(PrometheusStatLogger("m", max_model_len=2048))
    assert V0271_NAMES <= set(families)
    for family in families.values():
        for s in family.samples:
            assert s.labels.get("model_name") == "m" and s.labels.get("engine") == "0", s
    assert buckets(families["vllm:request_queue_time_seconds"]) == REQUEST_LATENCY_BUCKETS
    assert buckets(families["vllm:request_time_per_output_token_seconds"]) == TPOT_BUCKETS
    assert buckets(families["vllm:iteration_tokens_total"]) == ITERATION_TOKENS_BUCKETS
    assert families["vllm:num_preemptions"].type == "counter"


def test_one_request_fills_its_phase_histograms_and_counters():
    logger = PrometheusStatLogger("m", max_model_len=2048)
    req = RequestStateStats(arrival_time=100.0)
    # Engine clock: queued at 10, scheduled at 12, first token at 12.5, preempted once, last token at 14.5.
    first = IterationStats(iteration_timestamp=100.7)
    first.update_from_output(EngineCoreOutput("r", [7], num_cached_tokens=16,
                                              events=[EngineCoreEvent(EngineCoreEventType.QUEUED, 10.0),
                                                      EngineCoreEvent(EngineCoreEventType.SCHEDULED, 12.0)]),
                             12.5, is_prefilling=True, prompt_len=40, req_stats=req)
    logger.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, num_skipped_waiting_reqs=1), first)
    last = IterationStats(iteration_timestamp=103.0)
    last.update_from_output(EngineCoreOutput("r", [8, 9, 10, 11],
                                             events=[EngineCoreEvent(EngineCoreEventType.PREEMPTED, 13.0)]),
                            14.5, is_prefilling=False, prompt_len=40, req_stats=req)
    last.update_from_finished_request("length", 40, 5, req, num_cached_tokens=16)
    logger.record(None, last)
    f = scrape(logger)
    assert sample(f["vllm:prompt_tokens"], "_total") == 40
    assert sample(f["vllm:prompt_tokens_cached"], "_total") == 16
    assert sample(f["vllm:num_preemptions"], "_total") == 1
    assert sample(f["vllm:num_requests_waiting"]) == 3            # waiting + skipped_waiting
    # Tokens per step: 24 computed prompt tokens + 1 generated, then 4 generated.
    assert sample(f["vllm:iteration_tokens_total"], "_count") == 2
    assert sample(f["vllm:iteration_tokens_total"], "_sum") == 24 + 1 + 4
    for name, seconds in [("vllm:request_queue_time_seconds", 2.0), ("vllm:request_prefill_time_seconds", 0.5),
                          ("vllm:request_inference_time_seconds", 2.5), ("vllm:request_decode_time_seconds", 2.0),
                          ("vllm:request_time_per_output_token_seconds", 2.0 / 4),
                          ("vllm:e2e_request_latency_seconds", 3.0)]:
        assert sample(f[name], "_count") == 1 and abs(sample(f[name], "_sum") - seconds) < 1e-9, name
    assert sample(f["vllm:request_success"], "_total", finished_reason="length") == 1
