"""Counts in words: a number and its noun agree ("1 token", "2 tokens", "1 step/s"), so the pages
never read "1 tokens" or "1 steps/s" whatever the run's numbers are."""
from __future__ import annotations


def n_of(n: object, noun: str, plural: str | None = None) -> str:
    """"1 token", "0 tokens", "3 tokens", "2.5 tokens"; a count that is not a number ("?") keeps the plural.

    NOTE: English takes the singular for exactly one, the plural for everything else (0, 1.5, 2, …)."""
    one = isinstance(n, (int, float)) and not isinstance(n, bool) and n == 1
    return f"{n} {noun if one else (plural or noun + 's')}"


def rate_text(per_s: float, noun: str = "step") -> str:
    """A rate as it reads aloud: "1 step every 2 s" (below one a second), "1 step/s", "4 steps/s"."""
    if 0 < per_s < 1:
        return f"1 {noun} every {1 / per_s:g} s"
    return f"{per_s:g} {noun if per_s == 1 else noun + 's'}/s"
