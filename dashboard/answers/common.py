"""The shape of an answer: what the Self-test page shows and the tests check."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ShowMe:
    """A deep link: `page` of the open run at `step`, on inspector tab `tab` (a key of
    components/tabs.TABS), with `request` selected."""
    label: str
    page: str
    step: int | None
    tab: str | None = None
    request: str | None = None

    @property
    def where(self) -> str:
        """"Step inspector, KV cache tab, step 52, request 7": where the link lands, in words."""
        from dashboard.components.tabs import TABS
        page = {"inspector": "Step inspector", "journey": "Request journey", "processes": "Processes"}.get(
            self.page, self.page)
        return ", ".join(x for x in (page, f"{TABS[self.tab]} tab" if self.tab else "",
                                     f"step {self.step}" if self.step is not None else "",
                                     f"request {self.request}" if self.request else "") if x)


@dataclass
class Answer:
    ok: bool                                     # False: this run cannot answer (why_not says why)
    why_not: str = ""
    subject: str = ""                            # "request 3 at step 14"
    summary: str = ""                            # markdown, with the run's values
    chain: list[dict] = field(default_factory=list)     # rows: {"①": .., "call": .., "what happened here": ..}
    tables: dict[str, list[dict]] = field(default_factory=dict)
    show_me: list[ShowMe] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # where a value comes from, what is derived
    facts: dict[str, Any] = field(default_factory=dict)  # machine-readable: what the tests compare


# What a table cell or sentence says where the run lacks a figure it should have (a figure that cannot
# exist says why instead: "none (one output token: no gap between two tokens)"), never a bare "—".
NOT_RECORDED = "not recorded in this run"


def cannot(why: str) -> Answer:
    return Answer(ok=False, why_not=why)


def ids(xs) -> str:
    return "[" + ", ".join(str(x) for x in xs) + "]"
