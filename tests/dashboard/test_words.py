"""Counts and their nouns agree on every page (dashboard/words.py): found at 1440x900, the scrubber's
speed read "1 steps/s" and the first step's panels "over 1 requests", "1 tokens"."""
from __future__ import annotations

import os
import re

import pytest

from dashboard.words import agree, n_of, rate_text

# "1 <plural>" as the pages would write it (a digit before the 1 is another number: "11 tokens" is right).
ONE_PLURAL = re.compile(r"(?<![\d.,])1\*{0,2} (tokens|steps|requests|blocks|rows|slots|launches|spans|points|"
                        r"ranks|layers|waits|sync points|finished requests|steps/s)\b")


def test_a_count_and_its_noun_agree():
    assert n_of(1, "token") == "1 token" and n_of(2, "token") == "2 tokens" and n_of(0, "step") == "0 steps"
    assert n_of(1.5, "block") == "1.5 blocks" and n_of("?", "token") == "? tokens"
    assert n_of(1, "sync point") == "1 sync point" and n_of(3, "query", "queries") == "3 queries"


def test_a_verb_agrees_with_its_count():
    """"1 of 3 rows was kept as it was", "2 of 3 rows were kept as they were": the words after a count agree
    with it as its noun does (found on Self-test Q2: "1 of 3 rows was **kept as they were**")."""
    assert agree(1, "was", "were") == "was" and agree(0, "was", "were") == "were" and agree(2, "was", "were") == "were"
    assert agree(1.5, "it was", "they were") == "they were" and agree("?", "gets", "get") == "get"
    assert agree(True, "was", "were") == "were"          # a flag is not a count
    assert f"{n_of(1, 'padding row')} {agree(1, 'gets', 'get')}" == "1 padding row gets"


def test_no_page_chooses_a_verb_inline():
    """Every choice of a verb or pronoun by a count goes through words.agree (one rule for "exactly one"),
    never an inline `'was' if n == 1 else 'were'` that the next page would write its own way."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "dashboard")
    inline = re.compile(r"""['"](?:[\w ]+ )?(?:was|were|is|are|has|have|gets|get|it|they|its|their)['"] if .{0,60}?"""
                        r"""(?:==|!=) ?1\b""")
    found = [f"{os.path.relpath(os.path.join(d, f), root)}:{i}" for d, _, fs in os.walk(root) for f in fs
             if f.endswith(".py") for i, line in enumerate(open(os.path.join(d, f), encoding="utf-8"), 1)
             if inline.search(line)]
    assert not found, found


def test_no_page_makes_a_plural_inline():
    """Every count's noun goes through words.n_of, never an inline `{n} block{'s' * (n != 1)}` (seven
    were left: kv_memory, device_lane, slot_mapping, block_pool, timeline, processes)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "dashboard")
    inline = re.compile(r"""\{['"](?:s|es)['"] (?:\*|if)""")
    found = [f"{os.path.relpath(os.path.join(d, f), root)}:{i}" for d, _, fs in os.walk(root) for f in fs
             if f.endswith(".py") for i, line in enumerate(open(os.path.join(d, f), encoding="utf-8"), 1)
             if inline.search(line)]
    assert not found, found


def test_a_rate_reads_as_it_is_said():
    assert rate_text(1.0) == "1 step/s" and rate_text(2.0) == "2 steps/s" and rate_text(4) == "4 steps/s"
    assert rate_text(0.5) == "1 step every 2 s"


@pytest.mark.model
def test_no_page_says_one_of_a_plural(make_app, run_facts):
    """The first step schedules one request: its panels, and the scrubber's speeds, count it in the singular."""
    steps = run_facts["steps"]
    at = make_app("inspector", steps[0])
    assert not at.exception, [e.value for e in at.exception]
    speeds = at.selectbox(key="speed")
    assert speeds.options == ["1 step every 2 s", "1 step/s", "2 steps/s", "4 steps/s"], speeds.options
    pages = [at]
    for tab in ("Worker (model runner)", "KV cache"):
        pages.append(_with_tab(make_app, steps[0], tab))
    worker = "\n".join(m.value for m in pages[1].markdown)
    assert "**prepare_inputs** · " in worker and "1 request ·" in worker, worker[:300]     # one request, singular
    for page in ("timeline", "journey"):
        pages.append(make_app(page, steps[0]))
    for view in pages:
        assert not view.exception, [e.value for e in view.exception]
        text = "\n".join([m.value for m in view.markdown] + [c.value for c in view.caption]
                         + [e.label for e in view.expander])
        assert not ONE_PLURAL.findall(text), [line for line in text.splitlines() if ONE_PLURAL.search(line)]


def _with_tab(make_app, step: int, tab: str):
    """The inspector on `step`, then its tab `tab` asked for through the URL."""
    at = make_app("inspector", step)
    at.query_params["tab"] = tab
    return at.run()


@pytest.mark.model
def test_no_count_hedges_its_noun(make_app):
    """Found at 1440x900 on Self-test: "preempted 2 time(s)", "**0 condense move(s)**", "1 request(s)": the
    count is known, so its noun agrees with it."""
    at = make_app("selftest")
    assert not at.exception, [e.value for e in at.exception]
    text = "\n".join([m.value for m in at.markdown] + [c.value for c in at.caption])
    hedged = re.findall(r"\d+\*{0,2} [\w-]+(?: [\w-]+)?\(s\)", text)
    assert not hedged, hedged
    assert not ONE_PLURAL.findall(text), [line for line in text.splitlines() if ONE_PLURAL.search(line)]
