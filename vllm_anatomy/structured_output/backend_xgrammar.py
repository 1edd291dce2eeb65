"""The xgrammar backend: JSON schemas, regexes, choices and EBNF grammars.

Mirrors vllm/v1/structured_output/backend_xgrammar.py. xgrammar
(https://github.com/mlc-ai/xgrammar) compiles a constraint against the model's
vocabulary once (GrammarCompiler, with a cache), then a GrammarMatcher per
request walks it token by token and fills that request's bitmask row: bit t
set = token t may come next.

Also here: validate_xgrammar_grammar, the frontend's check (SamplingParams.verify),
which parses the constraint without compiling it against the vocabulary.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.structured_output.backend_types import (StructuredOutputBackend, StructuredOutputGrammar,
                                                          StructuredOutputOptions)
from vllm_anatomy.structured_output.utils import choice_as_grammar

if TYPE_CHECKING:
    import xgrammar as xgr

    from vllm_anatomy.sampling_params import SamplingParams
else:
    xgr = None      # imported on first use (xgrammar takes a while to import)

# xgrammar's GrammarCompiler cache (vLLM: VLLM_XGRAMMAR_CACHE_MB, default 512).
XGRAMMAR_CACHE_MB = 512


def _xgr():
    global xgr
    if xgr is None:
        import xgrammar
        xgr = xgrammar
    return xgr


@dataclass
class XgrammarBackend(StructuredOutputBackend):

    def __post_init__(self) -> None:
        x = _xgr()
        # NOTE: a TokenizerInfo is taken as is: the GPU-free tests build one over
        # a tiny vocabulary; the engine passes the model's HF tokenizer.
        tokenizer_info = self.tokenizer if isinstance(self.tokenizer, x.TokenizerInfo) else \
            x.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        self.compiler = x.GrammarCompiler(tokenizer_info, max_threads=8, cache_enabled=True,
                                          cache_limit_bytes=XGRAMMAR_CACHE_MB * 1024 * 1024)

    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str) -> StructuredOutputGrammar:
        if request_type == StructuredOutputOptions.JSON:
            ctx = self.compiler.compile_json_schema(grammar_spec, any_whitespace=True)
        elif request_type == StructuredOutputOptions.JSON_OBJECT:
            ctx = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
        elif request_type == StructuredOutputOptions.GRAMMAR:
            ctx = self.compiler.compile_grammar(grammar_spec)
        elif request_type == StructuredOutputOptions.REGEX:
            ctx = self.compiler.compile_regex(grammar_spec)
        elif request_type == StructuredOutputOptions.CHOICE:
            # NOTE: vLLM rewrites a choice into a grammar at validation time (the
            # params change under the caller); here the key keeps the choice.
            ctx = self.compiler.compile_grammar(choice_as_grammar(json.loads(grammar_spec)))
        else:
            raise ValueError(f"grammar is not of valid supported types. ({request_type!s})")
        # NOTE: v0.27.1 passes max_rollback_tokens (its spec-decode depth); xgrammar
        # 0.2.9 deprecates it (rollback is always unlimited), and structured requests get no drafts here.
        return XgrammarGrammar(matcher=_xgr().GrammarMatcher(ctx),
                               vocab_size=self.vocab_size, ctx=ctx)

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return _xgr().allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        del self.compiler


@dataclass
class XgrammarGrammar(StructuredOutputGrammar):
    vocab_size: int
    matcher: Any = field(hash=False)     # xgr.GrammarMatcher
    ctx: Any = field(hash=False)         # xgr.CompiledGrammar
    num_processed_tokens: int = field(default=0, repr=False, hash=False, init=False)
    _is_terminated: bool = field(default=False, repr=False, hash=False)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self._is_terminated:
            return False
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        self._is_terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens
        self._is_terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, idx)

    def is_terminated(self) -> bool:
        return self._is_terminated

    def reset(self) -> None:
        self.num_processed_tokens = 0
        self.matcher.reset()


# JSON-schema string formats xgrammar understands (v0.27.1's list).
STRING_SUPPORTED_FORMATS = {
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
}


def has_xgrammar_unsupported_json_features(schema: dict[str, Any]) -> bool:
    """Keywords v0.27.1 refuses for xgrammar (it would ignore them, not enforce them)."""
    def check_object(obj: Any) -> bool:
        if not isinstance(obj, dict):
            return False
        kind = obj.get("type")
        if kind in ("integer", "number") and "multipleOf" in obj:
            return True
        if kind == "array" and any(k in obj for k in ("uniqueItems", "contains", "minContains", "maxContains")):
            return True
        if kind == "string" and "format" in obj and obj["format"] not in STRING_SUPPORTED_FORMATS:
            return True
        if kind == "object" and any(k in obj for k in ("patternProperties", "propertyNames")):
            return True
        return any(check_object(v) if isinstance(v, dict) else
                   isinstance(v, list) and any(check_object(item) for item in v)
                   for v in obj.values())
    return check_object(schema)


def _compiler_message(err: Exception) -> str:
    """xgrammar's message without its log prefix ("[15:53:33] /project/cpp/x.cc:5082: ")."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(err)).strip()


def validate_xgrammar_grammar(sampling_params: SamplingParams) -> None:
    """Refuse a constraint xgrammar cannot parse, with xgrammar's message.

    Raises VLLMValidationError (a 400 on the HTTP server).
    """
    so = sampling_params.structured_outputs
    if so is None:
        return
    x = _xgr()
    try:
        if so.regex is not None:
            what = "regex"
            x.Grammar.from_regex(so.regex)
        elif so.choice is not None:
            what = "choices"
            x.Grammar.from_ebnf(choice_as_grammar(so.choice))
        elif so.json is not None:
            what = "json schema"
            schema = _load_schema(so.json)
            if has_xgrammar_unsupported_json_features(schema):
                raise VLLMValidationError("The provided JSON schema contains features not supported by xgrammar.",
                                          parameter="structured_outputs")
            x.Grammar.from_json_schema(json.dumps(schema))
        elif so.grammar is not None:
            what = "grammar"
            x.Grammar.from_ebnf(so.grammar)
    except VLLMValidationError:
        raise
    except Exception as err:
        raise VLLMValidationError(f"Failed to transform {what} into a grammar: {_compiler_message(err)}",
                                  parameter="structured_outputs") from err


def _load_schema(spec: str | dict) -> dict:
    if not isinstance(spec, str):
        return spec
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise VLLMValidationError(f"Invalid JSON grammar specification: {e}", parameter="structured_outputs") from e
    if not isinstance(schema, dict):
        raise VLLMValidationError("A JSON schema must be a JSON object.", parameter="structured_outputs")
    return schema
