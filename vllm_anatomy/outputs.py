"""What the user gets back: RequestOutput / CompletionOutput.

Mirrors vllm/outputs.py. Built by the OutputProcessor from EngineCoreOutputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-n).
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt token: None for the first (nothing precedes it), then as SampleLogprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Frontend timestamps (time.monotonic) of one request's life."""
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # SamplingParams.prompt_logprobs: each prompt token's logprob and the top-n
    # (in the first output only when streaming deltas).
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict | None = field(default=None, repr=False)
