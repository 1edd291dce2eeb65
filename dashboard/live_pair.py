"""A pair of live runs: the same prompts twice, one engine argument changed, run one after the other
(two engine processes at once would share the cores and skew each other's times).

    pair = LivePair.start(spec_a, spec_b, trace_dir)   # A starts now
    pair.poll()          # starts B once A is done; {"state": running|done|error, "side", "a", "b"}

Each side is a dashboard/live.py LiveRun (its own engine process, its own run store). The page
(views/compare.py) polls; nothing waits on a child.
"""
from __future__ import annotations

from dashboard.live import LiveRun

TERMINAL = ("done", "stopped", "error", "crashed")


class LivePair:
    def __init__(self, specs: tuple[dict, dict], trace_dir: str, a: LiveRun) -> None:
        self.specs, self.trace_dir = specs, trace_dir
        self.runs: dict[str, LiveRun | None] = {"a": a, "b": None}

    @classmethod
    def start(cls, spec_a: dict, spec_b: dict, trace_dir: str) -> "LivePair":
        return cls((spec_a, spec_b), trace_dir, LiveRun.start(spec_a, trace_dir))

    def poll(self) -> dict:
        """Where the pair is; starts B when A has finished (never when A failed)."""
        run_a = self.runs["a"]
        assert run_a is not None, "A starts in __init__"
        a = run_a.status()
        if a["state"] in ("error", "crashed", "stopped"):
            return {"state": "error", "side": "a", "a": a, "b": None,
                    "error": a.get("error") or f"run A {a['state']}"}
        if a["state"] != "done":
            return {"state": "running", "side": "a", "a": a, "b": None}
        run_b = self.runs["b"]
        if run_b is None:
            run_b = self.runs["b"] = LiveRun.start(self.specs[1], self.trace_dir)
        b = run_b.status()
        if b["state"] in ("error", "crashed", "stopped"):
            return {"state": "error", "side": "b", "a": a, "b": b, "error": b.get("error") or f"run B {b['state']}"}
        return {"state": "done" if b["state"] == "done" else "running", "side": "b", "a": a, "b": b}

    def stop(self) -> None:
        for run in self.runs.values():
            if run is not None:
                run.stop()
