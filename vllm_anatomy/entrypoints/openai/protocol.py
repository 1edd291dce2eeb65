"""Pydantic models the OpenAI-compatible API shares: strict field types, errors, model
cards, usage, stream options, response formats, and the sampling fields of every request.

Mirrors vllm/entrypoints/openai/engine/protocol.py (errors, usage, model cards) and
models/protocol.py, names verbatim, for the subset this engine serves; the requests,
responses and stream chunks of each API are in chat_protocol.py
(chat_completion/protocol.py) and completion_protocol.py (completion/protocol.py).

NOTE: models are `strict`: a wrong JSON type ("temperature": "hot", "n": true)
is refused with a 400 instead of being coerced, as the OpenAI API does. vLLM
uses pydantic's lax mode; we prefer the clearer error. Every float must be
finite (JSON's NaN / Infinity literals are refused), every integer must fit in
64 bits (Int64, TokenId: vLLM bounds seeds the same way), and every text must
be encodable as UTF-8 (Text: a lone surrogate "\ud800" is refused). Ranges
that depend on the model (token ids inside the vocabulary) are checked by the
serving layer, with the engine's own functions.
Unknown fields are accepted and ignored (as vLLM does), so newer clients keep
working, except the ones in UNSUPPORTED_FIELDS, which would change the
answer: those are refused with a 400 naming the field, never silently ignored.
Not supported either: best_of > 1 (v0.27.1 has no best_of), suffix.
Supported as in vLLM: n (n choices, each with its index), presence_penalty,
frequency_penalty, repetition_penalty, min_p, allowed_token_ids, bad_words,
prompt_logprobs (not with stream=True, as in v0.27.1), and (completions) a list of prompts.

Structured output: `response_format` ({"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}) and
vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" |
"json_object": ...}) become SamplingParams.structured_outputs
(structured_outputs_from_response_format, as in vLLM's engine/protocol.py).
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from vllm_anatomy.engine.stop_strings import stop_strings_limit_error
from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.sampling_params import (INT64_MAX, INT64_MIN, RequestOutputKind, SamplingParams,
                                          StructuredOutputsParams)


def random_uuid() -> str:
    return uuid.uuid4().hex


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("unicode_encode", "contains text that cannot be encoded as UTF-8 "
                                  "(a lone surrogate at character {position})", {"position": e.start}) from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
# NOTE: OpenAI documents logit_bias values in [-100, 100]; vLLM clamps to that.
_LOGIT_BIAS_LIMIT = 100.0

# Fields of the OpenAI / vLLM APIs this engine does not implement -> the values
# that mean "not used". Anything else is refused (400), never silently ignored.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "function_call": (None, "none"),
    "logprob_token_ids": (None,), "use_beam_search": (None, False),
    # NOTE: vLLM v0.27.1 has no guided_* fields any more (it would ignore them);
    # their replacement is structured_outputs, which is supported here.
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "truncate_prompt_tokens": (None,), "prompt_embeds": (None,),
    # NOTE: (issue 29) the rest of v0.27.1's request fields that would change the
    # answer (or what is returned, cached or isolated) and are not implemented here.
    # Fields that change nothing in vLLM for a text model without a reasoning or
    # tool parser (include_reasoning, parallel_tool_calls, length_penalty without
    # beam search, truncation_side without truncate_prompt_tokens,
    # spaces_between_special_tokens with a fast tokenizer) are accepted, as there.
    "reasoning_effort": (None,), "thinking_token_budget": (None,), "priority": (None, 0),
    "return_token_ids": (None, False), "return_token_offsets": (None, False),
    "return_prompt_text": (None, False), "return_assistant_tokens_mask": (None, False),
    "cache_salt": (None,), "kv_transfer_params": (None,), "ec_transfer_params": (None,),
    "vllm_xargs": (None,), "repetition_detection": (None,), "stream_interval": (None, 1),
    "media_io_kwargs": (None, {}), "mm_processor_kwargs": (None, {}),
}


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


# -- errors ---------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- models -----------------------------------------------------------------------
class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_sampling: bool = True
    allow_view: bool = True


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# -- shared request pieces ----------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: Text
    description: Text | None = None
    # NOTE: OpenAI's field is "schema", which pydantic's BaseModel already has.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    # "text" (no constraint), "json_object" (any JSON object) or "json_schema".
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


def structured_outputs_from_response_format(structured_outputs: StructuredOutputsParams | None,
                                            response_format: ResponseFormat | None
                                            ) -> StructuredOutputsParams | None:
    """Apply response_format over structured_outputs (vLLM's function)."""
    if response_format is None or response_format.type == "text":
        return structured_outputs
    if response_format.type == "json_object":
        overrides: dict[str, Any] = {"json_object": True}
    else:
        schema = response_format.json_schema.json_schema if response_format.json_schema else None
        if schema is None:
            raise VLLMValidationError("When response_format type is 'json_schema', the 'json_schema' field "
                                      "must be provided, with its 'schema'.", parameter="response_format")
        overrides = {"json": schema}
    if structured_outputs is None:
        return StructuredOutputsParams(**overrides)
    return msgspec.structs.replace(structured_outputs, **overrides)


def structured_outputs_from_dict(data: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` request field, type-checked field by field."""
    if data is None:
        return None
    unknown = sorted(set(data) - set(StructuredOutputsParams.__struct_fields__))
    if unknown:
        raise VLLMValidationError(f"structured_outputs.{unknown[0]} is not supported by this engine "
                                  f"(supported: {', '.join(StructuredOutputsParams.__struct_fields__)}).",
                                  parameter="structured_outputs")
    try:
        return msgspec.convert(data, StructuredOutputsParams)
    except msgspec.ValidationError as e:
        raise VLLMValidationError(f"structured_outputs: {e}", parameter="structured_outputs") from None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class SamplingRequest(OpenAIBaseModel):
    """Fields that chat and completions share, and their SamplingParams mapping."""
    model: Text | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: Int64 = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    # vLLM extras: only these token ids may be sampled; these words may not be generated.
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[Text] | None = None
    # Token id (a decimal string, as JSON keys are) -> bias added to its logit.
    logit_bias: dict[str, float] | None = None
    user: Text | None = None
    response_format: ResponseFormat | None = None
    # vLLM extra: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json_object": true}
    structured_outputs: dict[str, Any] | None = None
    # vLLM extra: under --scheduling-policy priority, lower runs first (ignored under fcfs).
    priority: Int64 = 0
    # vLLM extra: each prompt token's logprob and the top-n (-1: the whole vocabulary);
    # returned as `prompt_logprobs` (per choice on completions, top-level on chat).
    prompt_logprobs: Int64 | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop_size(cls, value: Any) -> Any:
        """The stop list's bounds (engine/stop_strings.py), checked before pydantic
        validates each of possibly a million strings on the event loop."""
        if isinstance(value, list):
            error = stop_strings_limit_error([s if isinstance(s, str) else "" for s in value])
            if error is not None:
                raise PydanticCustomError("stop_too_large", "{error}", {"error": error})
        return value

    def uses_response_format(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"

    def has_structured_outputs(self) -> bool:
        """Whether the request carries a structured-output constraint (to check off the event loop)."""
        return self.structured_outputs is not None or self.uses_response_format()

    def extract_structured_outputs(self) -> StructuredOutputsParams | None:
        return structured_outputs_from_response_format(structured_outputs_from_dict(self.structured_outputs),
                                                       self.response_format)

    def check_unsupported(self) -> None:
        """Raise VLLMValidationError naming the first field this engine does not implement."""
        if self.stream_options is not None and not self.stream:
            raise VLLMValidationError("stream_options can only be set when stream is true.",
                                      parameter="stream_options")
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and value not in UNSUPPORTED_FIELDS[name]:
                raise VLLMValidationError(f"{name} is not supported by this engine (it would be ignored, "
                                          f"so the request is refused).", parameter=name)
        self.check_logprobs()

    def check_logprobs(self) -> None:
        """prompt_logprobs' own rules, in v0.27.1's order and words (its check_logprobs)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None:
            return
        # NOTE: a stream sends no prompt logprobs (they would come with the first
        # token, in no chunk field), so asking for any is refused; 0 is let through.
        if self.stream and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise VLLMValidationError("`prompt_logprobs` are not available when `stream=True`.",
                                      parameter="prompt_logprobs")
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise VLLMValidationError(f"`prompt_logprobs` must be a positive value or -1, got {prompt_logprobs}.",
                                      parameter="prompt_logprobs")

    def _logit_bias(self) -> dict[int, float] | None:
        """{"50256": -100} -> {50256: -100.0}, each bias clamped to [-100, 100] (as vLLM)."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            if not re.fullmatch(r"-?[0-9]{1,20}", key):
                raise VLLMValidationError(f"logit_bias keys must be token ids (decimal integers), got {key[:40]!r}.",
                                          parameter="logit_bias")
            out[int(key)] = min(_LOGIT_BIAS_LIMIT, max(-_LOGIT_BIAS_LIMIT, bias))
        return out

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        params = self._make_sampling_params(max_tokens, logprobs, prompt_logprobs)
        try:
            # NOTE: checked again by SamplingParams.verify; here so that the 400 names
            # the field the client used (response_format or structured_outputs).
            params._validate_structured_outputs()
        except VLLMValidationError as e:
            if e.parameter == "min_tokens":
                raise
            raise VLLMValidationError(str(e), parameter="response_format" if self.uses_response_format()
                                      else "structured_outputs") from e
        return params

    def _make_sampling_params(self, max_tokens: int, logprobs: int | None,
                              prompt_logprobs: int | None) -> SamplingParams:
        # NOTE: None means "the OpenAI default": temperature 1, top_p 1, top-k off.
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, logit_bias=self._logit_bias(),
            structured_outputs=self.extract_structured_outputs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            # Streams want only what is new; a plain response wants one final output.
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)
