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

import functools
import json
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_anatomy.exceptions import VLLMValidationError
from vllm_anatomy.structured_output.backend_types import (StructuredOutputBackend, StructuredOutputGrammar,
                                                          StructuredOutputOptions)
from vllm_anatomy.structured_output.limits import check_structured_output_limits
from vllm_anatomy.structured_output.request import get_structured_output_key
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
        self.compiler = x.GrammarCompiler(tokenizer_info, max_threads=self.max_threads, cache_enabled=True,
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
        # NOTE: v0.27.1 passes max_rollback_tokens (its spec-decode depth: the bitmask of a
        # request with drafts advances over them, then rolls back); xgrammar 0.2.9
        # deprecates it (rollback is always unlimited).
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
            # NOTE: (ours) a draft past the stop token is refused without asking the
            # matcher (which would log a warning for each such draft; same result).
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
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

    def is_completed(self) -> bool:
        return self._is_terminated or self.matcher.is_completed()

    def allows_any_token(self) -> bool:
        bitmask = _xgr().allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())


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


def validate_xgrammar_grammar(sampling_params: SamplingParams, compile_check: bool = True) -> None:
    """Refuse a constraint that is too large (limits.py), that xgrammar cannot
    compile (with xgrammar's message), or that can match nothing (compile_check=False:
    only the size bounds).

    Raises VLLMValidationError (a 400 on the HTTP server).

    NOTE: (ours) vLLM parses the constraint here (xgrammar's Grammar.from_*);
    this compiles it against a 257-token byte-level vocabulary instead, which
    costs about the same (a few ms within the limits) and also gives the first
    bitmask: all zeros means no output can ever match (regex "[^\\s\\S]", EBNF
    "root ::= root"), a request that would otherwise sample from all -inf
    logits and fail inside the engine. The answer is cached by the constraint's
    text: the HTTP server checks a request several times (protocol, serving,
    InputProcessor) and pays once, in a worker thread (serving_engine.py).
    """
    so = sampling_params.structured_outputs
    if so is None or so.json_object:
        return
    check_structured_output_limits(so)
    if not compile_check:
        return
    request_type, grammar_spec = get_structured_output_key(so)
    error = _validation_error(request_type, grammar_spec)
    if error is not None:
        raise VLLMValidationError(error, parameter="structured_outputs")
    if sampling_params.min_tokens > 0:
        _check_min_tokens_reachable(so, request_type, grammar_spec, sampling_params.min_tokens)


def _check_min_tokens_reachable(so, request_type: StructuredOutputOptions, grammar_spec: str,
                                min_tokens: int) -> None:
    """A 400 naming min_tokens when every output the constraint accepts is shorter.

    NOTE: every token holds at least one byte, so an output of n bytes is at most
    n tokens: a constraint whose longest output is shorter than min_tokens bytes
    can never reach min_tokens (vLLM 0.27.1 runs it and fails inside the engine;
    here, past admission, the scheduler would stop it as finished). A choice's
    longest output is its longest string; any other constraint is searched on the
    byte-level compile (_longest_output_bytes), within MIN_TOKENS_SEARCH_STEPS.
    """
    if so.choice is not None:
        longest: int | None = max(len(c.encode("utf-8")) for c in so.choice)
        what = "choice"
    else:
        longest = _longest_output_bytes(request_type, grammar_spec, min_tokens)
        what = {StructuredOutputOptions.JSON: "json schema", StructuredOutputOptions.REGEX: "regex",
                StructuredOutputOptions.GRAMMAR: "grammar"}.get(request_type, "constraint")
    if longest is not None and longest < min_tokens:
        raise VLLMValidationError(
            f"min_tokens={min_tokens} can never be reached: the longest output the structured_outputs "
            f"{what} accepts is {longest} bytes, so at most {longest} tokens.", parameter="min_tokens")


# The most bytes the min_tokens search tries (each: one matcher step and one 257-bit mask, ~10 us).
MIN_TOKENS_SEARCH_STEPS = 2048


@functools.lru_cache(maxsize=256)
def _longest_output_bytes(request_type: StructuredOutputOptions, grammar_spec: str, target: int) -> int | None:
    """The length in bytes of the longest output the constraint accepts, when it is shorter than
    `target`; None when some output reaches `target` bytes or the search ran out of steps.

    A depth-first walk of the byte-level matcher: every prefix the matcher accepts can be
    completed, so "no accepted prefix of `target` bytes" means "no output that long". Exact
    when it answers a number (the whole tree of prefixes was walked); it gives up (None:
    "unknown", the request is admitted) on wide trees such as `[a-z]{0,5}`.
    """
    x = _xgr()
    matcher = x.GrammarMatcher(_compile_byte_level(request_type, grammar_spec))
    bitmask = x.allocate_token_bitmask(1, _BYTE_VOCAB_SIZE)

    def allowed_bytes() -> list[int]:
        matcher.fill_next_token_bitmask(bitmask, 0)
        out = []
        for i, word in enumerate(bitmask[0, :8].tolist()):     # bytes 0-255 (bit 256: the stop token)
            word &= 0xFFFFFFFF
            while word:
                low = word & -word
                out.append(32 * i + low.bit_length() - 1)
                word ^= low
        return out

    stack = [allowed_bytes()]       # stack[d]: the bytes still to try after the first d bytes
    longest = steps = 0
    while stack:
        if not stack[-1]:
            stack.pop()
            if stack:               # (the root level was entered without a byte)
                matcher.rollback(1)
            continue
        byte = stack[-1].pop()
        steps += 1
        if steps > MIN_TOKENS_SEARCH_STEPS:
            return None
        if not matcher.accept_token(byte):
            continue
        longest = max(longest, len(stack))
        if longest >= target:
            return None
        stack.append(allowed_bytes())
    return longest


# The byte-level vocabulary the validation compiles against: token i < 256 is the
# byte i, token 256 the stop token.
_BYTE_VOCAB_SIZE = 257
_validation_compiler_lock = threading.Lock()
_validation_compiler: Any = None


def _byte_level_compiler():
    global _validation_compiler
    with _validation_compiler_lock:
        if _validation_compiler is None:
            x = _xgr()
            info = x.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"], x.VocabType.RAW,
                                   vocab_size=_BYTE_VOCAB_SIZE, stop_token_ids=[256])
            _validation_compiler = x.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return _validation_compiler


@functools.lru_cache(maxsize=64)
def _compile_byte_level(request_type: StructuredOutputOptions, grammar_spec: str) -> Any:
    """The constraint compiled against the byte-level vocabulary (an xgr.CompiledGrammar)."""
    compiler = _byte_level_compiler()
    if request_type == StructuredOutputOptions.JSON:
        schema = _load_schema(grammar_spec)
        if has_xgrammar_unsupported_json_features(schema):
            raise VLLMValidationError("The provided JSON schema contains features not supported by xgrammar.",
                                      parameter="structured_outputs")
        return compiler.compile_json_schema(grammar_spec, any_whitespace=True)
    if request_type == StructuredOutputOptions.REGEX:
        return compiler.compile_regex(grammar_spec)
    if request_type == StructuredOutputOptions.CHOICE:
        return compiler.compile_grammar(choice_as_grammar(json.loads(grammar_spec)))
    return compiler.compile_grammar(grammar_spec)


@functools.lru_cache(maxsize=256)
def _validation_error(request_type: StructuredOutputOptions, grammar_spec: str) -> str | None:
    """Why this constraint cannot be served (None: it can). Cached: see validate_xgrammar_grammar."""
    x = _xgr()
    what = {StructuredOutputOptions.JSON: "json schema", StructuredOutputOptions.REGEX: "regex",
            StructuredOutputOptions.CHOICE: "choices", StructuredOutputOptions.GRAMMAR: "grammar"}[request_type]
    try:
        ctx = _compile_byte_level(request_type, grammar_spec)
    except VLLMValidationError as err:
        return str(err)
    except RecursionError:
        return f"The {what} is nested too deeply to be compiled."
    except Exception as err:  # noqa: BLE001 - xgrammar's errors: RuntimeError, ValueError, ...
        return f"Failed to transform {what} into a grammar: {_compiler_message(err)}"
    bitmask = x.allocate_token_bitmask(1, _BYTE_VOCAB_SIZE)
    x.GrammarMatcher(ctx).fill_next_token_bitmask(bitmask, 0)
    if not bitmask.any():
        return (f"The structured_outputs {what} can match no output at all (no text satisfies it), "
                f"so no answer could be generated.")
    return None


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
