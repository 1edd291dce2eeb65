"""Stop strings: their bounds, and an Aho-Corasick automaton that finds them as text streams in.

Ours; vLLM 0.27.1 (check_stop_strings in vllm/v1/engine/detokenizer.py) runs
`text.find(s, ...)` over the tail of the text for every stop string after every
token, so each token costs O(number of stop strings): issue 29 sent 700,000 of
them (7.7 MB, under the body limit) and /health stalled for 5-9 s, because the
frontend detokenizes on the event loop.

Here the stop strings are compiled once per request (cached by the list) into one
automaton (Aho & Corasick, 1975): a trie of the strings whose nodes also know
their longest proper suffix that is a trie prefix ("fail" links). The detokenizer
feeds it each new character; a step follows at most a few fail links (amortised
O(1)), so a token costs O(its characters), whatever the number of stop strings.
The result is vLLM's: the stop string that *ends* first in the text, ties broken
by the order of the stop list (as if tokens arrived one by one).

Bounds (a 400 naming `stop` past them): MAX_STOP_STRINGS strings and
MAX_STOP_STRINGS_CHARS characters in all, which bounds the automaton's size and
the time to build it (~1 us a character), and the text a stream holds back.
"""
from __future__ import annotations

import functools

MAX_STOP_STRINGS = 256
MAX_STOP_STRINGS_CHARS = 16 * 1024


def stop_strings_limit_error(stop: list[str]) -> str | None:
    """Why `stop` is too large (None: it is not)."""
    if len(stop) > MAX_STOP_STRINGS:
        return f"has {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted."
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_STRINGS_CHARS:
        return f"has {total} characters in all; at most {MAX_STOP_STRINGS_CHARS} are accepted."
    return None


class StopStringAutomaton:
    """Aho-Corasick over characters. Node 0 is the root; a match is (end, index in the stop list)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.goto: list[dict[str, int]] = [{}]
        self.fail: list[int] = [0]
        # The stop string reported when a node is reached: the lowest list index
        # among the strings ending here (this node's own, and those along its fail links).
        self.output: list[int] = [-1]
        for index, s in enumerate(stop):
            node = 0
            for ch in s:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.fail.append(0)
                    self.output.append(-1)
                node = nxt
            if self.output[node] == -1:     # a duplicate keeps its first index
                self.output[node] = index
        self._link()

    def _link(self) -> None:
        """Breadth first: a node's fail link is known once every shallower node's is."""
        queue = list(self.goto[0].values())
        head = 0
        while head < len(queue):
            node = queue[head]
            head += 1
            for ch, child in self.goto[node].items():
                queue.append(child)
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                link = self.goto[f].get(ch, 0)
                self.fail[child] = link if link != child else 0
                inherited = self.output[self.fail[child]]
                if inherited != -1 and (self.output[child] == -1 or inherited < self.output[child]):
                    self.output[child] = inherited

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)

    def scan(self, state: int, text: str, start: int, report: bool) -> tuple[int, tuple[int, int] | None]:
        """Feed text[start:]; (the new state, the first match (end, index) or None).
        With report=False only the state advances (text before min_tokens)."""
        output = self.output
        for pos in range(start, len(text)):
            state = self.step(state, text[pos])
            if report and output[state] != -1:
                return state, (pos + 1, output[state])
        return state, None


@functools.lru_cache(maxsize=64)
def get_stop_string_automaton(stop: tuple[str, ...]) -> StopStringAutomaton:
    """One automaton per distinct stop list (clients tend to reuse theirs)."""
    return StopStringAutomaton(stop)
