"""The spec-decode metrics: SpecDecodingStats counts as vLLM's, the four vllm:spec_decode_* counters
appear on /metrics only with speculative decoding on, and SchedulerStats carries the stats across
the engine -> frontend socket (msgpack)."""
from __future__ import annotations

import msgspec
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_anatomy.engine.protocol import EngineCoreOutputs, SchedulerStats
from vllm_anatomy.metrics.prometheus import PrometheusStatLogger
from vllm_anatomy.spec_decode.metrics import SpecDecodingStats

NAMES = {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
         "vllm:spec_decode_num_accepted_tokens_per_pos"}


def families(logger: PrometheusStatLogger) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(logger.registry).decode())}


def test_observe_draft_counts_per_position():
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    stats.observe_draft(num_draft_tokens=2, num_accepted_tokens=0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0] and stats.num_draft_tokens_per_pos == [2, 2, 1]


def test_counters_only_with_speculative_decoding():
    assert not NAMES & set(families(PrometheusStatLogger("m", 2048)))
    logger = PrometheusStatLogger("m", 2048, num_speculative_tokens=3)
    assert NAMES <= set(families(logger))
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(3, 3)
    stats.observe_draft(3, 1)
    logger.record(SchedulerStats(spec_decoding_stats=stats))
    logger.record(SchedulerStats())                  # a step without drafts adds nothing
    f = families(logger)

    def value(name, **labels):
        [v] = [s.value for s in f[name].samples if s.name == name + "_total"
               and all(s.labels.get(k) == x for k, x in labels.items())]
        return v
    assert value("vllm:spec_decode_num_drafts") == 2
    assert value("vllm:spec_decode_num_draft_tokens") == 6
    assert value("vllm:spec_decode_num_accepted_tokens") == 4
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos", position=str(p)) for p in range(3)] == [2, 1, 1]
    assert all(s.labels["model_name"] == "m" and s.labels["engine"] == "0"
               for s in f["vllm:spec_decode_num_drafts"].samples)


def test_stats_cross_the_socket():
    stats = SpecDecodingStats.new(2)
    stats.observe_draft(2, 1)
    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=1, spec_decoding_stats=stats))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineCoreOutputs)
    assert back.scheduler_stats is not None and back.scheduler_stats.spec_decoding_stats == stats
