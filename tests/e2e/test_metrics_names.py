"""GET /metrics of a live server speaks v0.27.1's names, labels and buckets (issue 18).

The expected names and buckets are copied here from v0.27.1's
vllm/v1/metrics/loggers.py (PrometheusStatLogger), not imported from our
metrics/prometheus.py, so the check does not agree with itself. A live
`vllm-anatomy serve` answers one chat request; /metrics is then read with
prometheus_client's own parser (counters' families lose their `_total`).
Offline, LLM.get_metrics() may use only those names, or our own prefix.
"""
from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_utils import RemoteOpenAIServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "smol"
MAX_MODEL_LEN = 512

# Every name v0.27.1's PrometheusStatLogger (vllm/v1/metrics/loggers.py) defines.
V0271_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
    "vllm:engine_sleep_state", "vllm:kv_cache_usage_perc", "vllm:corrupted_requests",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits", "vllm:mm_cache_queries", "vllm:mm_cache_hits", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached", "vllm:generation_tokens",
    "vllm:request_success", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total", "vllm:request_max_num_generation_tokens", "vllm:request_params_n",
    "vllm:request_params_max_tokens", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_prefill_kv_computed_tokens", "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds", "vllm:kv_block_reuse_gap_seconds", "vllm:lora_requests_info",
    "vllm:cache_config_info",
}
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TIME_PER_OUTPUT_TOKEN_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                 7.5, 10.0, 20.0, 40.0, 80.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# The issue-18 metrics: (type, buckets; None for a counter).
EXPECTED = {
    "vllm:request_queue_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_decode_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_inference_time_seconds": ("histogram", REQUEST_LATENCY_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("histogram", TIME_PER_OUTPUT_TOKEN_BUCKETS),
    "vllm:iteration_tokens_total": ("histogram", ITERATION_TOKENS_BUCKETS),
    "vllm:prompt_tokens_cached": ("counter", None),
}


@pytest.fixture(scope="module")
def families() -> dict:
    """/metrics after one finished chat request, as {family name: Metric}."""
    with RemoteOpenAIServer("--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                       temperature=0, max_tokens=4)
        # NOTE: the frontend records a finished request's stats after it answered: wait for them.
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"{server.url}/metrics", timeout=10).text
            found = {f.name: f for f in text_string_to_metric_families(text)}
            if _count(found["vllm:request_queue_time_seconds"]) >= 1 or time.monotonic() > deadline:
                return found
            time.sleep(0.2)


def _count(family) -> float:
    return sum(s.value for s in family.samples if s.name == family.name + "_count")


def _buckets(family) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_metric_as_v0271_defines_it(families, name):
    kind, buckets = EXPECTED[name]
    family = families[name]
    assert family.type == kind
    for s in family.samples:
        assert {k: v for k, v in s.labels.items() if k != "le"} == {"model_name": MODEL, "engine": "0"}, s
    if buckets is not None:
        assert _buckets(family) == [float(b) for b in buckets]
        assert _count(family) >= 1, f"{name}: nothing observed after a finished request"


def test_no_invented_vllm_name(families):
    ours = {name for name in families if name.startswith("vllm:")}
    assert ours - V0271_NAMES == set(), "names v0.27.1 does not define (use the vllm_anatomy: prefix)"


def test_offline_get_metrics_names(default_model_dir):
    from vllm_anatomy.entrypoints.llm import LLM
    from vllm_anatomy.sampling_params import SamplingParams
    llm = LLM(default_model_dir, max_model_len=MAX_MODEL_LEN)
    try:
        llm.generate(["Say hi."], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        names = set(llm.get_metrics())
    finally:
        llm.llm_engine.shutdown()
    assert names and all(n in V0271_NAMES or n.startswith("vllm_anatomy:") for n in names), names
