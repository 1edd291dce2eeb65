"""InputProcessor: prompt + SamplingParams -> EngineCoreRequest.

Mirrors vllm/v1/engine/input_processor.py. Tokenizes (or accepts token ids),
validates against the model, fills the defaults that depend on the model
(max_tokens, EOS), and builds the record that crosses into the engine.
Everything that can be refused is refused here, before the engine ever sees
it; EngineCore.preprocess_add_request re-checks what the engine relies on
(validate_prompt_token_ids, SamplingParams.verify) with the same functions.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, Union

from vllm_anatomy.config import ModelConfig, SpeculativeConfig
from vllm_anatomy.engine.protocol import EngineCoreRequest
from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.sampling_params import _SAMPLING_EPS, SamplingParams

# A prompt is text, a list of token ids, or vLLM's dict forms.
PromptType = Union[str, list[int], dict[str, Any]]


def load_generation_config(model_dir: str) -> dict:
    """generation_config.json of a model directory ({} when there is none)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def validate_text(text: str, parameter: str) -> str:
    """Refuse text that has no UTF-8 encoding (a lone surrogate such as "\\ud800").

    NOTE: JSON may carry "\\ud800" and Python decodes it into a str, but the
    tokenizer (Rust) and every encoder after it cannot represent it: refused
    here, it is a 400 naming the field instead of a crash further in.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise VLLMValidationError(
            f"{parameter} contains text that cannot be encoded as UTF-8 "
            f"(a lone surrogate at character {e.start}).", parameter=parameter) from None
    return text


def validate_prompt_token_ids(ids: list[int], vocab_size: int, max_model_len: int | None) -> None:
    """A non-empty list of in-vocabulary ints that leaves room for one output token
    (the length is not checked when max_model_len is None)."""
    if len(ids) == 0:
        raise VLLMValidationError("The decoder prompt cannot be empty.", parameter="prompt")
    # NOTE: C-speed scans (map/set, min/max): this runs for every request, up
    # to three times (frontend, EngineCore, the worker's InputBatch).
    if not set(map(type, ids)) <= {int}:          # bool is not int here
        raise VLLMValidationError("prompt_token_ids must be a list of integers.", parameter="prompt")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise VLLMValidationError(f"Token id {bad} is out of vocabulary (vocab_size={vocab_size}).",
                                  parameter="prompt")
    # NOTE: at least one token must still fit after the prompt, so a prompt
    # of exactly max_model_len tokens is refused too (as vLLM does).
    if max_model_len is not None and len(ids) >= max_model_len:
        raise VLLMValidationError(
            f"The decoder prompt (length {len(ids)}) is longer than the maximum model "
            f"length of {max_model_len}. Make sure that `max_model_len` is no smaller "
            f"than the number of text tokens plus one.", parameter="prompt")


def validate_params(params: Any, vocab_size: int, speculative_config: SpeculativeConfig | None = None,
                    check_grammar: bool = False) -> None:
    """SamplingParams, valid for this model (vLLM: InputProcessor._validate_params).

    check_grammar: also check the structured-output constraint (its bounds, then a
    compile against a byte-level vocabulary: validate_xgrammar_grammar). The frontend
    does (InputProcessor, below). NOTE: EngineCore's re-check does not: there the
    grammar's own compile, in the low-priority pool within its CPU budget, is the
    check (a failure finishes the request with the reason), so no constraint is
    compiled at normal priority in the engine process (issue 29). vLLM's EngineCore
    does not re-validate either.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    params.verify(vocab_size, check_structured_outputs=check_grammar)
    # NOTE: v0.27.1 (SamplingParams._validate_spec_decode): the rejection
    # sampler applies temperature, top-k, top-p, min_tokens, penalties,
    # allowed_token_ids and bad words to every draft position, but not min_p
    # and logit_bias: refused, not silently ignored.
    if speculative_config is not None and (params.min_p > _SAMPLING_EPS or params.logit_bias):
        raise VLLMValidationError("The min_p and logit_bias sampling parameters "
                                  "are not yet supported with speculative decoding.")


class InputProcessor:

    def __init__(self, model_config: ModelConfig, tokenizer, generation_config: dict | None = None,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        self.model_config = model_config
        self.speculative_config = speculative_config
        self.tokenizer = tokenizer
        gen = generation_config if generation_config is not None else load_generation_config(model_config.model)
        eos = gen.get("eos_token_id", tokenizer.eos_token_id)
        eos_list = eos if isinstance(eos, list) else [eos]
        self.eos_token_id: int | None = eos_list[0] if eos_list and eos_list[0] is not None else tokenizer.eos_token_id
        # Extra EOS ids from generation_config also stop generation (hidden from the user).
        self.extra_eos_ids = [t for t in eos_list[1:] if t is not None]
        # NOTE: the model's vocabulary (rows of the embedding and of the logits),
        # which every token id must index; the tokenizer's may differ.
        self.vocab_size = model_config.hf_config.get("vocab_size", len(tokenizer))

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            validate_text(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("A dict prompt needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise TypeError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_inputs(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Everything process_inputs refuses, for callers that tokenized already
        (the HTTP server checks before it answers 200 to a stream)."""
        validate_params(params, self.vocab_size, self.speculative_config, check_grammar=True)
        validate_prompt_token_ids(prompt_token_ids, self.vocab_size, self.model_config.max_model_len)
        if params.bad_words:
            # bad_words' token ids come from the tokenizer: checked on a copy, as process_inputs will make them.
            validate_params(self._with_bad_words_token_ids(params.clone()), self.vocab_size)

    def _with_bad_words_token_ids(self, params: SamplingParams) -> SamplingParams:
        params.update_from_tokenizer(self.tokenizer)
        return params

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None,
                       trace_headers: dict[str, str] | None = None,
                       priority: int = 0) -> tuple[str | None, EngineCoreRequest]:
        """priority: under --scheduling-policy priority, lower runs first (ignored under fcfs)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        validate_params(params, self.vocab_size, self.speculative_config, check_grammar=True)
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        validate_prompt_token_ids(prompt_token_ids, self.vocab_size, self.model_config.max_model_len)
        params = params.clone()
        if params.bad_words:
            # NOTE: tokenized here, on the frontend (vLLM: update_from_tokenizer in
            # process_inputs); the worker gets token ids, checked against the vocabulary.
            validate_params(self._with_bad_words_token_ids(params), self.vocab_size)
        max_model_len = self.model_config.max_model_len
        if params.max_tokens is None:
            params.max_tokens = max_model_len - len(prompt_token_ids)
        if not params.ignore_eos:
            params.eos_token_id = self.eos_token_id
            params.all_stop_token_ids = list(self.extra_eos_ids) or None
        req = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            trace_headers=trace_headers,
        )
        return prompt_text, req

    @staticmethod
    def assign_request_id(request: EngineCoreRequest) -> None:
        """Make the engine's id unique: the caller's id plus 8 random characters (as vLLM).

        NOTE: two HTTP clients may send the same X-Request-Id; both must run.
        `external_req_id` keeps the caller's id: RequestOutputs report it, and
        AsyncLLM.abort accepts it. The offline LLMEngine does not call this: its
        caller (LLM) numbers requests itself and looks outputs up by that id.
        """
        if request.external_req_id is not None:
            raise ValueError("external_req_id must not be set before assign_request_id.")
        request.external_req_id = request.request_id
        request.request_id = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
