"""SpecDecodingStats and SpecDecodingProm: how many drafts, how many accepted, at which position.

Mirrors vllm/v1/spec_decode/metrics.py. Each step the scheduler counts, for
every request it had scheduled drafts for, the drafts and how many of them
the rejection sampler accepted (Scheduler.update_from_output); the counts ride
to the frontend in SchedulerStats.spec_decoding_stats, and the Prometheus
logger adds them to vLLM's four counters:

    vllm:spec_decode_num_drafts                 requests verified (one per request per step)
    vllm:spec_decode_num_draft_tokens           draft tokens verified
    vllm:spec_decode_num_accepted_tokens        draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos{position=p}   accepted at draft position p

acceptance rate = accepted / draft tokens; mean acceptance length = 1 +
accepted / drafts (each verification also yields one token of the target's
own: the bonus or the recovered token).

NOTE: a msgspec Struct here (vLLM: a dataclass), since it crosses the engine
-> frontend socket inside SchedulerStats.
"""
from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry, Counter


class SpecDecodingStats(msgspec.Struct, omit_defaults=True, gc=False):
    """One step's spec-decode counts, summed over its requests."""
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []
    num_draft_tokens_per_pos: list[int] = []

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens,
                   num_draft_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: num_draft_tokens drafted, the first num_accepted_tokens accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        assert num_accepted_tokens <= self.num_spec_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
        for i in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[i] += 1


class SpecDecodingProm:
    """The four Prometheus counters (names, help texts and the `position` label as in vLLM)."""

    def __init__(self, num_spec_tokens: int, labelnames: list[str], labelvalues: list[str],
                 registry: CollectorRegistry) -> None:
        counter_specs = [("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                         ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                         ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")]
        (self.counter_spec_decode_num_drafts, self.counter_spec_decode_num_draft_tokens,
         self.counter_spec_decode_num_accepted_tokens) = [
            Counter(name, doc, labelnames, registry=registry).labels(*labelvalues) for name, doc in counter_specs]
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                          labelnames + ["position"], registry=registry)
        self.counter_spec_decode_num_accepted_tokens_per_pos = [per_pos.labels(*labelvalues, str(pos))
                                                                for pos in range(num_spec_tokens)]

    def observe(self, stats: SpecDecodingStats) -> None:
        self.counter_spec_decode_num_drafts.inc(stats.num_drafts)
        self.counter_spec_decode_num_draft_tokens.inc(stats.num_draft_tokens)
        self.counter_spec_decode_num_accepted_tokens.inc(stats.num_accepted_tokens)
        for counter, n in zip(self.counter_spec_decode_num_accepted_tokens_per_pos,
                              stats.num_accepted_tokens_per_pos):
            counter.inc(n)
