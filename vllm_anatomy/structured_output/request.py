"""StructuredOutputRequest: one request's constraint and its (future) grammar.

Mirrors vllm/v1/structured_output/request.py. The grammar starts as a Future
(compiling in StructuredOutputManager's thread pool); the scheduler polls it
(is_grammar_ready, never blocking) while the request waits in
WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR. A failed compile leaves the exception
in its place, and the scheduler finishes that request with FINISHED_ERROR.
Simplified: no reasoning parser (the grammar constrains the whole output).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TYPE_CHECKING

from vllm_anatomy.structured_output.backend_types import (StructuredOutputGrammar, StructuredOutputKey,
                                                          StructuredOutputOptions)

if TYPE_CHECKING:
    from vllm_anatomy.sampling_params import SamplingParams, StructuredOutputsParams


@dataclasses.dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    _grammar: Future[StructuredOutputGrammar] | StructuredOutputGrammar | Exception | None = None
    # Teaching extra: when compilation started and ended (time.monotonic(),
    # the clock of engine events), so the trace can draw the compile window.
    compile_start: float | None = None
    compile_end: float | None = None

    @staticmethod
    def from_sampling_params(sampling_params: SamplingParams | None) -> StructuredOutputRequest | None:
        if sampling_params is None:
            return None
        params = sampling_params.structured_outputs
        if params is None or params.all_constraints_none():
            return None
        return StructuredOutputRequest(params=params)

    def _check_grammar_completion(self) -> bool:
        if isinstance(self._grammar, Future):
            try:
                # NOTE: 100 us at most: the scheduler asks every step, it must not wait.
                self._grammar = self._grammar.result(timeout=0.0001)
            except FutureTimeoutError:
                return False
            except Exception as e:
                self._grammar = e
        return True

    @property
    def is_grammar_ready(self) -> bool:
        return self._check_grammar_completion()

    @property
    def grammar(self) -> StructuredOutputGrammar | Exception | None:
        """The grammar, the compile error, or None while it is still compiling."""
        if not self._check_grammar_completion():
            return None
        grammar = self._grammar
        assert not isinstance(grammar, Future)      # (resolved by _check_grammar_completion)
        return grammar

    @grammar.setter
    def grammar(self, grammar: StructuredOutputGrammar | Future[StructuredOutputGrammar]) -> None:
        self._grammar = grammar

    @functools.cached_property
    def structured_output_key(self) -> StructuredOutputKey:
        return get_structured_output_key(self.params)


def get_structured_output_key(params: StructuredOutputsParams) -> StructuredOutputKey:
    if params.json is not None:
        return StructuredOutputOptions.JSON, params.json if isinstance(params.json, str) else json.dumps(params.json)
    if params.json_object:
        return StructuredOutputOptions.JSON_OBJECT, ""
    if params.regex is not None:
        return StructuredOutputOptions.REGEX, params.regex
    if params.choice is not None:
        return StructuredOutputOptions.CHOICE, json.dumps(params.choice)
    if params.grammar is not None:
        return StructuredOutputOptions.GRAMMAR, params.grammar
    raise ValueError("No valid structured output parameter found")
