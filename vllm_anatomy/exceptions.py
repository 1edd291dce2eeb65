"""Errors a request can cause.

Mirrors vllm/exceptions.py (VLLMValidationError).
"""
from __future__ import annotations

from typing import Any


class VLLMValidationError(ValueError):
    """A request field failed validation; `parameter` names the field.

    NOTE: in vLLM it derives from VLLMClientError (mapped to a 4xx); here it is
    also a ValueError, so that code catching ValueError for a bad request (the
    offline LLM's users, older tests) keeps working. The HTTP server turns it
    into a 400 whose `param` is `parameter`. The value is kept for callers but
    not put in the message: it may be a 10 MB prompt.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value
