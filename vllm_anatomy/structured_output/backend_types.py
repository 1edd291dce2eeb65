"""What a structured-output backend provides: a compiler and per-request grammars.

Mirrors vllm/v1/structured_output/backend_types.py. One backend per engine
(here always xgrammar: backend_xgrammar.py) compiles a constraint into a
StructuredOutputGrammar: a matcher that follows one request's output token by
token and says, at each point, which tokens may come next (its bitmask row).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vllm_anatomy.config import VllmConfig


class StructuredOutputOptions(enum.Enum):
    JSON = enum.auto()
    JSON_OBJECT = enum.auto()
    REGEX = enum.auto()
    GRAMMAR = enum.auto()
    CHOICE = enum.auto()


# (what kind of constraint, its text): the compiler's input (and cache key).
StructuredOutputKey = tuple[StructuredOutputOptions, str]


class StructuredOutputGrammar(ABC):
    """Request-level: one request's position in its grammar."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over `tokens`; False (and no advance past it) at the first one the grammar refuses."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest accepted prefix of `tokens`, without advancing."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Write the allowed next tokens into row batch_index of bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted a stop token (the output is complete)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar."""

    # NOTE: ours, not in v0.27.1's interface (issue 29): what the scheduler asks
    # to end a request cleanly where vLLM would fail it (docs/architecture.md).
    @abstractmethod
    def is_completed(self) -> bool:
        """True if the output so far is a complete match: a stop token may come next."""

    @abstractmethod
    def allows_any_token(self) -> bool:
        """True if at least one token may come next (the next bitmask row is not all zeros)."""


@dataclass
class StructuredOutputBackend(ABC):
    """Engine-level: the compiler, bound to the model's tokenizer and vocabulary."""

    vllm_config: VllmConfig
    tokenizer: Any
    vocab_size: int

    @abstractmethod
    def compile_grammar(self, request_type: StructuredOutputOptions, grammar_spec: str) -> StructuredOutputGrammar:
        """Compile one request's constraint (slow: runs in the manager's thread pool)."""

    @abstractmethod
    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """A [max_num_seqs, ceil(vocab_size / 32)] int32 bitmask, reused every step."""

    @abstractmethod
    def destroy(self) -> None:
        """Release the compiler."""

    # Threads the compiler may use for one compile (vLLM: always 8; here sized
    # by StructuredOutputManager so compiles leave the forward pass its cores).
    max_threads: int = 8
