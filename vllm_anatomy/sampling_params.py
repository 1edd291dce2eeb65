"""SamplingParams: how one request wants its tokens chosen and when it stops.

Mirrors vllm/sampling_params.py (the subset this project implements). What is
not supported is refused with a clear error rather than silently ignored.

Validation has two halves, as in vLLM: `_verify_args` (run on construction,
and again when the engine process decodes the struct) checks each field's type
and range; `verify(vocab_size)` checks what depends on the model — every token
id inside the vocabulary. The InputProcessor and EngineCore.add_request call
both, so a bad value is refused before any per-request state is built from it.
"""
from __future__ import annotations

import copy
import math
from enum import IntEnum
from typing import Any

import msgspec

from vllm_anatomy.engine.stop_strings import stop_strings_limit_error
from vllm_anatomy.exceptions import VLLMValidationError

# NOTE: vLLM treats temperature below this as greedy (avoids dividing by ~0).
_SAMPLING_EPS = 1e-5
# The most top logprobs a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# The most parallel samples one request may ask for (vLLM: VLLM_MAX_N_SEQUENCES).
MAX_N_SEQUENCES = 16384
# NOTE: every integer crosses the process boundary as msgpack and lands in
# int64 tensors (token ids, torch.Generator seeds): one outside 64 bits would
# fail deep inside the engine. vLLM's protocol bounds seeds the same way.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One structured-output constraint: the output must match it (vLLM's names).

    Exactly one of json (a JSON schema, as a dict or its text), regex, choice
    (one of these strings), grammar (EBNF, xgrammar's dialect) or json_object
    (any JSON object) is set. Compiled by StructuredOutputManager (xgrammar).
    NOTE: a msgspec Struct (vLLM: a dataclass): it crosses to the engine
    process inside SamplingParams. Not supported: structural_tag, the options
    of other backends (disable_any_whitespace, whitespace_pattern,
    disable_additional_properties), and Lark grammars (vLLM converts them to EBNF).
    """
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        """Exactly one kind of constraint (checked on decode in the engine too)."""
        count = sum(getattr(self, f) is not None for f in _CONSTRAINTS)
        if count != 1:
            kind = "multiple are" if count > 1 else "none is"
            raise VLLMValidationError(f"You must use exactly one kind of structured outputs constraint "
                                      f"({', '.join(_CONSTRAINTS)}), but {kind} specified.",
                                      parameter="structured_outputs")

    def all_constraints_none(self) -> bool:
        return all(getattr(self, f) is None for f in _CONSTRAINTS)


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0   # every output carries the whole text so far
    DELTA = 1        # only what is new since the previous output
    FINAL_ONLY = 2   # one output, when the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters, field names as in vLLM.

    n > 1 asks for n samples of one prompt: the frontend fans the request out
    into n child requests (engine/parallel_sampling.py, ParentRequest), which
    share the prompt's KV blocks through the prefix cache. As in vLLM, greedy
    sampling with n > 1 is refused (the n outputs would be identical), and a
    seed gives child i the seed `seed + i`.

    Penalties (vLLM's semantics, model_executor/penalties.py): presence and
    frequency count the *output* tokens only (OpenAI's definition);
    repetition_penalty counts prompt *and* output tokens (the CTRL paper's,
    transformers' RepetitionPenaltyLogitsProcessor). allowed_token_ids keeps
    only those tokens; bad_words forbids the last token of each word's token
    sequence where the output so far ends with the rest of it.

    Not supported here (a ValueError says so): best_of (v0.27.1 has none),
    beam search.
    """
    n: int = 1
    # Penalties: 0.0 / 0.0 / 1.0 = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 (or -1) = disabled
    min_p: float = 0.0
    seed: int | None = None     # -1 = no seed, as in vLLM
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None      # a str becomes [str] (__post_init__)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None     # number of top logprobs besides the sampled token
    # Per prompt token (from the second): its logprob and the top-n (-1: the whole vocabulary).
    prompt_logprobs: int | None = None
    # Whether the request may start from prefix-cached blocks; None: not when
    # it asks for prompt_logprobs (they need every prompt token computed).
    skip_reading_prefix_cache: bool | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a JSON schema, regex, choice or grammar (structured output).
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> bias added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (None = all).
    allowed_token_ids: list[int] | None = None
    # Words that must not be generated; tokenized by the InputProcessor into
    # bad_words_token_ids (update_from_tokenizer), which the sampler reads.
    bad_words: list[str] | None = None
    # NOTE: vLLM keeps this private (_bad_words_token_ids, read through a
    # property); here a plain field like eos_token_id: filled on the frontend,
    # it must cross to the engine process inside the struct.
    bad_words_token_ids: list[list[int]] | None = None
    # Filled by the InputProcessor from the tokenizer / generation config;
    # None when ignore_eos (the scheduler's check_stop then never sees EOS).
    eos_token_id: int | None = None
    # Extra ids that also stop (e.g. generation_config's eos list), hidden from users.
    all_stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if _is_int(self.seed) and self.seed == -1:
            self.seed = None
        self._verify_args()

    # -- field by field (type and range) -----------------------------------------
    def _verify_args(self) -> None:
        for field in ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs",
                      "eos_token_id"):
            _check_int(field, getattr(self, field), optional=field in _OPTIONAL)
        for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty"):
            _check_float(field, getattr(self, field))
        _need(self.n >= 1, "n", f"must be at least 1, got {self.n}.")
        _need(self.n <= MAX_N_SEQUENCES, "n", f"must be at most {MAX_N_SEQUENCES}, got {self.n}.")
        _need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"must be in [-2, 2], got {self.presence_penalty}.")
        _need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"must be in [-2, 2], got {self.frequency_penalty}.")
        _need(self.repetition_penalty > 0.0, "repetition_penalty",
              f"must be greater than zero, got {self.repetition_penalty}.")
        _need(0.0 <= self.temperature <= 2.0, "temperature", f"must be in [0, 2], got {self.temperature}.")
        _need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}.")
        _need(self.top_k >= 0, "top_k", f"must be 0 or -1 (disabled) or at least 1, got {self.top_k}.")
        _need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None:
            _need(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}.")
        _need(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None:
            _need(self.min_tokens <= self.max_tokens, "min_tokens",
                  f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None:
            _need(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
                  f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")
        if self.prompt_logprobs is not None:
            _need(self.prompt_logprobs == -1 or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                  f"must be -1 (the whole vocabulary) or in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}.")
        if self.stop is not None:
            _need(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop), "stop",
                  "must be a string or a list of strings.")
            _need(all(len(s) > 0 for s in self.stop), "stop", "must not contain empty strings.")
            too_large = stop_strings_limit_error([self.stop] if isinstance(self.stop, str) else self.stop)
            _need(too_large is None, "stop", f"{too_large}")
        for field in ("stop_token_ids", "all_stop_token_ids", "allowed_token_ids"):
            _check_token_id_list(field, getattr(self, field))
        if self.allowed_token_ids is not None:
            _need(len(self.allowed_token_ids) > 0, "allowed_token_ids", "must not be empty.")
        self._verify_bad_words()
        self._verify_logit_bias()
        # NOTE: vLLM's _verify_greedy_sampling: n greedy samples would all be the same.
        if self.n > 1:
            _need(not self.sampling_type_greedy, "n", f"must be 1 when using greedy sampling, got {self.n}.")

    def _verify_bad_words(self) -> None:
        if self.bad_words is not None:
            _need(isinstance(self.bad_words, list) and all(isinstance(w, str) for w in self.bad_words),
                  "bad_words", "must be a list of strings.")
            _need(all(w for w in self.bad_words), "bad_words", "cannot contain an empty string.")
        if self.bad_words_token_ids is not None:
            _need(isinstance(self.bad_words_token_ids, list), "bad_words_token_ids", "must be a list of lists.")
            for ids in self.bad_words_token_ids:
                _check_token_id_list("bad_words_token_ids", ids)
                _need(len(ids) > 0, "bad_words_token_ids", "cannot contain an empty token sequence.")

    def _verify_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        _need(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to biases.")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id)
            _check_float("logit_bias", bias)

    # -- against the model -----------------------------------------------------------
    def verify(self, vocab_size: int, check_structured_outputs: bool = True) -> None:
        """Every token id inside [0, vocab_size) (vLLM: SamplingParams.verify), and the
        structured-output constraint (check_structured_outputs=False: only its fields
        and size bounds, not the compile check).

        NOTE: vLLM 0.27.1 checks logit_bias and allowed_token_ids but not
        stop_token_ids; with min_tokens an out-of-vocabulary stop id indexes
        past the logits row (issue 14's crash). Here every id is checked,
        allowed_token_ids against the model's vocabulary (vLLM: the
        tokenizer's; the sampler's mask has the logits' width).
        """
        bad_words_ids = [t for ids in self.bad_words_token_ids or () for t in ids]
        checked: tuple[tuple[str, Any], ...] = (
            ("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias),
            ("all_stop_token_ids", self.all_stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
            ("bad_words", bad_words_ids))
        for field, ids in checked:
            bad = [t for t in ids or () if not 0 <= t < vocab_size]
            if bad:
                raise VLLMValidationError(
                    f"{field} contains token id(s) outside the vocabulary [0, {vocab_size}): "
                    f"{bad[:5]}{' ...' if len(bad) > 5 else ''}.", parameter=field, value=bad)
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < vocab_size:
            raise VLLMValidationError(f"eos_token_id {self.eos_token_id} is outside the vocabulary.",
                                      parameter="eos_token_id")
        self._validate_structured_outputs(compile_check=check_structured_outputs)

    def _validate_structured_outputs(self, compile_check: bool = True) -> None:
        """A schema, regex or grammar xgrammar cannot compile is refused here, with
        xgrammar's own message (vLLM: the same check, in the frontend's verify).

        NOTE: this parses the constraint into a grammar but does not compile it
        against the vocabulary; that (the slow part) is the engine's, off the
        step (StructuredOutputManager.grammar_init).
        """
        so = self.structured_outputs
        if so is None:
            return
        if isinstance(so.choice, list) and not so.choice:
            raise VLLMValidationError("structured_outputs.choice cannot be an empty list.",
                                      parameter="structured_outputs")
        for field in ("grammar", "json", "regex"):
            value = getattr(so, field)
            if isinstance(value, str) and not value.strip():
                raise VLLMValidationError(f"structured_outputs.{field} cannot be an empty string.",
                                          parameter="structured_outputs")
        if so.json_object is False:
            raise VLLMValidationError("structured_outputs.json_object must be True if set; omit "
                                      "structured_outputs to disable structured outputs.",
                                      parameter="structured_outputs")
        from vllm_anatomy.structured_output.backend_xgrammar import validate_xgrammar_grammar
        validate_xgrammar_grammar(self, compile_check=compile_check)

    def update_from_tokenizer(self, tokenizer) -> None:
        """bad_words -> bad_words_token_ids (vLLM: SamplingParams.update_from_tokenizer).

        NOTE: each word is encoded twice, as it is and with a leading space,
        so it is forbidden at the start of the text and after a space (where a
        BPE tokenizer gives it other tokens). The spaced variant is kept only
        when it is a different sequence of the same length (vLLM's rule).
        """
        if not self.bad_words:
            return
        token_ids: list[list[int]] = []
        for bad_word in self.bad_words:
            plain = tokenizer.encode(bad_word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + bad_word.lstrip(), add_special_tokens=False)
            if not plain:
                raise VLLMValidationError(f"bad_words: {bad_word!r} encodes to no tokens.", parameter="bad_words")
            token_ids.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                token_ids.append(spaced)
        self.bad_words_token_ids = token_ids

    @property
    def no_penalties(self) -> bool:
        return (self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and self.repetition_penalty == 1.0)

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def update_from_generation_config(self, generation_config: dict[str, Any],
                                      eos_token_id: int | None = None) -> None:
        """The model's EOS token (unless ignore_eos), and generation_config's other
        EOS ids as extra stop ids (vLLM's method; our InputProcessor fills the same fields)."""
        if not self.ignore_eos:
            self.eos_token_id = eos_token_id
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        extra = ({eos_ids} if isinstance(eos_ids, int) else set(eos_ids)) - {eos_token_id}
        if extra:
            self.all_stop_token_ids = sorted(set(self.all_stop_token_ids or ()) | extra)

    def clone(self) -> "SamplingParams":
        """A copy the engine may change without touching the caller's (vLLM: copy.deepcopy).

        NOTE: the same independence as a deep copy, built field by field: the
        only mutable fields are these lists, the bias dict and the structured
        output spec. copy.deepcopy walked every field of every request's params
        (~40 % of adding 256 requests on a slow CPU)."""
        new = copy.copy(self)
        for name in ("stop", "stop_token_ids", "all_stop_token_ids", "allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if isinstance(value, list):
                setattr(new, name, list(value))
        if self.bad_words_token_ids is not None:
            new.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        if self.logit_bias is not None:
            new.logit_bias = dict(self.logit_bias)
        if self.structured_outputs is not None:
            new.structured_outputs = copy.deepcopy(self.structured_outputs)
        return new


_OPTIONAL = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs", "eos_token_id"})


def _need(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise VLLMValidationError(f"{field} {msg}", parameter=field)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _check_int(field: str, v: Any, optional: bool = False) -> None:
    if v is None and optional:
        return
    _need(_is_int(v), field, f"must be an integer, got {_short(v)}.")
    _need(INT64_MIN <= v <= INT64_MAX, field, f"must fit in a signed 64-bit integer, got {_short(v)}.")


def _check_float(field: str, v: Any) -> None:
    _need(isinstance(v, (int, float)) and not isinstance(v, bool), field, f"must be a number, got {_short(v)}.")
    _need(_is_finite(v), field, f"must be a finite number, got {_short(v)}.")


def _is_finite(v: int | float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:      # an int too large for a float
        return False


def _check_token_id_list(field: str, ids: Any) -> None:
    if ids is None:
        return
    _need(isinstance(ids, list) and all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids), field,
          "must be a list of non-negative 64-bit integers.")
