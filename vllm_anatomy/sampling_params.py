"""SamplingParams: how one request wants its tokens chosen and when it stops.

Mirrors vllm/sampling_params.py (the subset this project implements). What is
not supported is refused with a clear error rather than silently ignored.
"""
from __future__ import annotations

import copy
from enum import IntEnum

import msgspec

# NOTE: vLLM treats temperature below this as greedy (avoids dividing by ~0).
_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0   # every output carries the whole text so far
    DELTA = 1        # only what is new since the previous output
    FINAL_ONLY = 2   # one output, when the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters, field names as in vLLM.

    Not supported here (a ValueError says so): n > 1, best_of, beam search,
    penalties, logit_bias, structured output, prompt_logprobs.
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 (or -1) = disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None     # number of top logprobs besides the sampled token
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the InputProcessor from the tokenizer / generation config;
    # None when ignore_eos (the scheduler's check_stop then never sees EOS).
    eos_token_id: int | None = None
    # Extra ids that also stop (e.g. generation_config's eos list), hidden from users.
    all_stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._verify_args()

    def _verify_args(self) -> None:
        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{field} {msg}")
        for field, typ in (("n", int), ("top_k", int), ("min_tokens", int)):
            v = getattr(self, field)
            need(isinstance(v, int) and not isinstance(v, bool), field, f"must be an integer, got {v!r}.")
        for field in ("temperature", "top_p", "min_p"):
            v = getattr(self, field)
            need(isinstance(v, (int, float)) and not isinstance(v, bool), field, f"must be a number, got {v!r}.")
        need(self.n == 1, "n", f"must be 1: this engine does not implement parallel sampling (got {self.n}).")
        need(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}.")
        need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}.")
        need(self.top_k >= 0, "top_k", f"must be 0 or -1 (disabled) or at least 1, got {self.top_k}.")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None:
            need(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
                 "max_tokens", f"must be an integer, got {self.max_tokens!r}.")
            need(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}.")
        need(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None:
            need(self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.seed is not None:
            need(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed",
                 f"must be an integer, got {self.seed!r}.")
        if self.logprobs is not None:
            need(isinstance(self.logprobs, int) and self.logprobs >= 0, "logprobs",
                 f"must be a non-negative integer, got {self.logprobs!r}.")
            need(self.logprobs <= 20, "logprobs", f"must be at most 20, got {self.logprobs}.")
        if self.stop is not None:
            need(all(isinstance(s, str) for s in self.stop), "stop", "must be a string or a list of strings.")
            need(all(len(s) > 0 for s in self.stop), "stop", "must not contain empty strings.")
        if self.stop_token_ids is not None:
            need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be a list of non-negative integers.")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
