"""LogGuard: the server's log lines carry no raw control characters, and a flood of them is rate-limited.

Ours (issue 29): a request id holding ANSI escape sequences was written raw into
the server log (log injection: it can rewrite what an operator's terminal
shows), and 1,100 idle sockets made asyncio log a traceback for every refused
accept(): 29.5 MB in ~10 s. vLLM's logging has neither guard.

LogGuard is a logging.Filter installed on every handler the server writes
through (install_log_guard: the root logger's and uvicorn's). For each record:

  * Escaping: the formatted message and any traceback have their control
    characters (other than newline and tab) escaped as \\xNN / \\uNNNN, so what
    reaches the file is printable text.
  * Rate limit per message template (logger, level, format string): a burst of
    PER_KEY_BURST records, then one every PER_KEY_INTERVAL_S seconds. A flood
    repeats a few templates, so it is cut to a trickle; a new kind of message
    still gets through.
  * A global rate limit (GLOBAL_BURST, then GLOBAL_PER_S a second), for messages
    that differ every time, and a cap on one record's length (MAX_RECORD_CHARS).
  * When records were dropped, the next one that passes says how many.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

PER_KEY_BURST = 20
PER_KEY_INTERVAL_S = 5.0
GLOBAL_BURST = 200
GLOBAL_PER_S = 20.0
MAX_RECORD_CHARS = 8192

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def escape_control_characters(text: str) -> str:
    """Every control character except newline and tab as an escape (\\x1b, \\u2028)."""
    return _CONTROL.sub(lambda m: ascii(m.group(0))[1:-1], text)


class _Bucket:
    """A token bucket: `burst` records at once, refilled at `rate` per second."""

    __slots__ = ("tokens", "rate", "burst", "stamp")

    def __init__(self, burst: float, rate: float, now: float) -> None:
        self.tokens, self.rate, self.burst, self.stamp = burst, rate, burst, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class LogGuard(logging.Filter):

    def __init__(self, max_keys: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._keys: dict[tuple, _Bucket] = {}
        self._max_keys = max_keys
        self._clock = clock
        self._global = _Bucket(GLOBAL_BURST, GLOBAL_PER_S, clock())
        self.num_dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_log_guard_passed", False):
            return True     # (one record, several handlers: decided once)
        now = self._clock()
        key = (record.name, record.levelno, str(record.msg)[:200])
        with self._lock:
            bucket = self._keys.get(key)
            if bucket is None:
                if len(self._keys) >= self._max_keys:
                    self._keys.clear()
                bucket = self._keys[key] = _Bucket(PER_KEY_BURST, 1.0 / PER_KEY_INTERVAL_S, now)
            if not (bucket.take(now) and self._global.take(now)):
                self.num_dropped += 1
                return False
            dropped, self.num_dropped = self.num_dropped, 0
        self._sanitize(record, dropped)
        record._log_guard_passed = True
        return True

    @staticmethod
    def _sanitize(record: logging.LogRecord, dropped: int) -> None:
        message = escape_control_characters(record.getMessage())
        if dropped:
            message = f"({dropped} log records dropped by the rate limit) {message}"
        record.msg, record.args = message[:MAX_RECORD_CHARS], None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = escape_control_characters(record.exc_text)[:MAX_RECORD_CHARS]
        if record.stack_info:
            record.stack_info = escape_control_characters(record.stack_info)[:MAX_RECORD_CHARS]


def install_log_guard(guard: LogGuard | None = None) -> LogGuard:
    """Put one LogGuard on the root logger's handlers and uvicorn's (a stderr handler
    on the root if it has none, so that asyncio's and our records pass the guard too)."""
    guard = guard or LogGuard()
    root = logging.getLogger()
    if not root.handlers:
        stderr = logging.StreamHandler()
        stderr.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        root.addHandler(stderr)
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio"):
        for handler in logging.getLogger(name).handlers:
            if guard not in handler.filters:
                handler.addFilter(guard)
    return guard
