"""LogGuard (entrypoints/openai/log_guard.py, issue 29): no raw control characters reach
the server's log, and a flood of records is cut to a trickle that says how much it dropped."""
from __future__ import annotations

import io
import logging

import pytest

from vllm_anatomy.entrypoints.openai import log_guard
from vllm_anatomy.entrypoints.openai.log_guard import (GLOBAL_BURST, PER_KEY_BURST, LogGuard,
                                                       escape_control_characters)


@pytest.fixture
def logged():
    """(a logger writing through a fresh LogGuard, what it wrote). The guard's clock stands
    still (no bucket refills while a test logs), so the counts are exact."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(LogGuard(clock=lambda: 1000.0))
    logger = logging.getLogger(f"test_log_guard.{id(out)}")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger, out
    logger.removeHandler(handler)


def test_control_characters_are_escaped(logged):
    logger, out = logged
    logger.warning("request %s failed", "id\x1b[31mRED\rFAKE\u2028LINE")
    try:
        raise ValueError("bad \x1b[2J value")
    except ValueError:
        logger.exception("with a traceback\tand a tab")
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text and "\u2028" not in text
    assert "id\\x1b[31mRED\\rFAKE\\u2028LINE" in text and "bad \\x1b[2J value" in text
    assert "with a traceback\tand a tab" in text        # (tab and newline stay)
    assert escape_control_characters("a\nb\tc\x00") == "a\nb\tc\\x00"


def test_a_repeated_message_is_rate_limited_and_the_drop_is_reported(logged):
    logger, out = logged
    for i in range(1000):
        logger.warning("Invalid HTTP request received. (%d)", i)
    assert out.getvalue().count("Invalid HTTP request") == PER_KEY_BURST
    logger.warning("something else")           # another template still passes, and says what was dropped
    assert f"({1000 - PER_KEY_BURST} log records dropped by the rate limit) something else" in out.getvalue()


def test_messages_that_differ_every_time_hit_the_global_limit(logged):
    logger, out = logged
    for i in range(2000):
        logger.warning(f"unique message {i}")      # an f-string: a new template each time
    assert out.getvalue().count("unique message") == GLOBAL_BURST


def test_a_record_is_capped(logged):
    logger, out = logged
    logger.warning("x" * 100_000)
    assert len(out.getvalue()) <= log_guard.MAX_RECORD_CHARS + 1
