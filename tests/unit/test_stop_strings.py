"""Stop strings through the Aho-Corasick automaton (engine/stop_strings.py, issue 29).

Pinned: the automaton finds what vLLM 0.27.1's check_stop_strings finds (the stop
string that ends first in the text, ties by list order, looking only at matches
that end in the new characters) for any text fed in any chunks; its work per
character does not grow with the number of stop strings; the bounds give a 400
naming `stop`.
"""
from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_anatomy.engine.stop_strings import (MAX_STOP_STRINGS, MAX_STOP_STRINGS_CHARS, StopStringAutomaton,
                                              stop_strings_limit_error)
from vllm_anatomy.sampling_params import SamplingParams


def vllm_check_stop_strings(output_text: str, new_char_count: int, stop: list[str]) -> tuple[str, int] | None:
    """v0.27.1's algorithm (vllm/v1/engine/detokenizer.py), restated: (stop string, its start)."""
    best, best_start, best_end = None, 0, sys.maxsize
    for s in stop:
        i = output_text.find(s, max(0, len(output_text) + 1 - new_char_count - len(s)))
        if i != -1 and i + len(s) < best_end:
            best, best_start, best_end = s, i, i + len(s)
    return None if best is None else (best, best_start)


def automaton_scan(stop: list[str], chunks: list[str]) -> tuple[str, int] | None:
    automaton, state, text = StopStringAutomaton(tuple(stop)), 0, ""
    for chunk in chunks:
        start, text = len(text), text + chunk
        state, match = automaton.scan(state, text, start, report=True)
        if match is not None:
            end, index = match
            return stop[index], end - len(stop[index])
    return None


def reference_scan(stop: list[str], chunks: list[str]) -> tuple[str, int] | None:
    text = ""
    for chunk in chunks:
        text += chunk
        if chunk and (found := vllm_check_stop_strings(text, len(chunk), stop)) is not None:
            return found
    return None


ALPHABET = "abc"


@settings(max_examples=300, deadline=None)
@given(stop=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=6),
       chunks=st.lists(st.text(ALPHABET, max_size=5), max_size=12))
def test_same_match_as_vllm(stop, chunks):
    assert automaton_scan(stop, chunks) == reference_scan(stop, chunks)


def test_ties_and_overlaps():
    # "b" ends before "abc": it wins although "abc" starts first (as tokens arriving one by one).
    assert automaton_scan(["abc", "b"], ["abc"]) == ("b", 1)
    # Same end: the earlier one in the list.
    assert automaton_scan(["bc", "abc"], ["xabc"]) == ("bc", 2)
    assert automaton_scan(["abc", "bc"], ["xabc"]) == ("abc", 1)
    # A stop string straddling chunks, and one found through a fail link.
    assert automaton_scan(["hello"], ["hel", "lo"]) == ("hello", 0)
    assert automaton_scan(["abd", "bc"], ["ab", "c"]) == ("bc", 1)


def test_work_per_character_does_not_grow_with_the_number_of_stop_strings():
    """Count the automaton's transitions (goto lookups and fail links followed) for the same
    text with 4 and with MAX_STOP_STRINGS stop strings: both at most 2 per character."""
    text = "the quick brown fox jumps over the lazy dog " * 50

    def steps(stop: list[str]) -> int:
        automaton = StopStringAutomaton(tuple(stop))
        count, state = 0, 0
        for ch in text:
            while state and ch not in automaton.goto[state]:
                state = automaton.fail[state]
                count += 1
            state = automaton.goto[state].get(ch, 0)
            count += 1
        return count

    few = ["STOP", "END", "###", "zzz"]
    many = [f"stop-{i:04d}-{'x' * 20}" for i in range(MAX_STOP_STRINGS - 4)] + few
    assert steps(few) <= 2 * len(text) and steps(many) <= 2 * len(text)


def test_bounds():
    assert stop_strings_limit_error(["x"] * MAX_STOP_STRINGS) is None
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS}") as info:
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    assert info.value.parameter == "stop"
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS_CHARS} are accepted"):
        SamplingParams(stop=["y" * (MAX_STOP_STRINGS_CHARS // 2 + 1)] * 2)
