"""Errors the frontend raises when the engine cannot serve a request.

Mirrors vllm/v1/engine/exceptions.py.
"""
from __future__ import annotations


class EngineGenerateError(Exception):
    """Raised by AsyncLLM.generate() when one request failed; the engine still runs."""


class EngineDeadError(Exception):
    """Raised when the EngineCore process died: nothing more can be served.

    NOTE: every waiting caller (generate(), utility calls, new requests) gets
    this error instead of waiting forever; the cause, when the engine could
    still say it, is part of the message.
    """

    def __init__(self, *args, suppress_context: bool = False, **kwargs) -> None:
        msg = ("EngineCore encountered an issue. See stack trace (above) for the root cause."
               if not args else args[0])
        super().__init__(msg, *args[1:], **kwargs)
        # Hide the chained internal error from the user's traceback when asked.
        self.__suppress_context__ = suppress_context
