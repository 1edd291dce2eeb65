"""InputProcessor: prompt + SamplingParams -> EngineCoreRequest.

Mirrors vllm/v1/engine/input_processor.py. Tokenizes (or accepts token ids),
validates, fills the defaults that depend on the model (max_tokens, EOS), and
builds the record that crosses into the engine. Everything that can be refused
is refused here, before the engine ever sees it.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Union

from vllm_anatomy.config import ModelConfig
from vllm_anatomy.engine.protocol import EngineCoreRequest
from vllm_anatomy.sampling_params import SamplingParams

# A prompt is text, a list of token ids, or vLLM's dict forms.
PromptType = Union[str, list[int], dict[str, Any]]


def load_generation_config(model_dir: str) -> dict:
    """generation_config.json of a model directory ({} when there is none)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


class InputProcessor:

    def __init__(self, model_config: ModelConfig, tokenizer, generation_config: dict | None = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        gen = generation_config if generation_config is not None else load_generation_config(model_config.model)
        eos = gen.get("eos_token_id", tokenizer.eos_token_id)
        eos_list = eos if isinstance(eos, list) else [eos]
        self.eos_token_id: int | None = eos_list[0] if eos_list and eos_list[0] is not None else tokenizer.eos_token_id
        # Extra EOS ids from generation_config also stop generation (hidden from the user).
        self.extra_eos_ids = [t for t in eos_list[1:] if t is not None]
        self.vocab_size = model_config.hf_config.get("vocab_size", len(tokenizer))

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
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

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None,
                       trace_headers: dict[str, str] | None = None) -> tuple[str | None, EngineCoreRequest]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        self._validate_prompt(prompt_token_ids)
        params = params.clone()
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
            trace_headers=trace_headers,
            external_req_id=request_id,
        )
        return prompt_text, req

    def _validate_prompt(self, ids: list[int]) -> None:
        if len(ids) == 0:
            raise ValueError("The decoder prompt cannot be empty.")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError("prompt_token_ids must be a list of integers.")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab_size={self.vocab_size}).")
        max_model_len = self.model_config.max_model_len
        # NOTE: at least one token must still fit after the prompt, so a prompt
        # of exactly max_model_len tokens is refused too (as vLLM does).
        if len(ids) >= max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model "
                f"length of {max_model_len}. Make sure that `max_model_len` is no smaller "
                f"than the number of text tokens plus one.")
