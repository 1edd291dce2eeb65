"""Counts in words: a number and its noun agree ("1 token", "2 tokens", "1 step/s"), and so do the
verb and pronoun that follow it ("1 row was", "2 rows were"), so the pages never read "1 tokens",
"1 steps/s" or "1 of 3 rows were" whatever the run's numbers are."""
from __future__ import annotations


def agree(n: object, one: str, many: str) -> str:
    """The form of a word that agrees with the count n: agree(1, "was", "were") is "was", agree(2, "was",
    "were") "were"; for any words the count governs ("it was" / "they were", "row gets" / "rows get").

    NOTE: English takes the singular for exactly one, the plural for everything else (0, 1.5, 2, …);
    a count that is not a number ("?") takes the plural."""
    return one if isinstance(n, (int, float)) and not isinstance(n, bool) and n == 1 else many


def n_of(n: object, noun: str, plural: str | None = None) -> str:
    """"1 token", "0 tokens", "3 tokens", "2.5 tokens"; a count that is not a number ("?") keeps the plural."""
    return f"{n} {agree(n, noun, plural or noun + 's')}"


def rate_text(per_s: float, noun: str = "step") -> str:
    """A rate as it reads aloud: "1 step every 2 s" (below one a second), "1 step/s", "4 steps/s"."""
    if 0 < per_s < 1:
        return f"1 {noun} every {1 / per_s:g} s"
    return f"{per_s:g} {agree(per_s, noun, noun + 's')}/s"
