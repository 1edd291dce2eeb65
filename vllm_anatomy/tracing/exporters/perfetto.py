"""Chrome trace-event JSON, for ui.perfetto.dev or chrome://tracing.

Lanes (pid/tid):
    one process per engine process   tid 1 = its main thread (nested "X" slices),
                                     tid 100+i = request i's `llm_request` span
    one "device" process             device-lane spans (`vllm_anatomy.lane` = "device",
                                     from record_span); without any (a CPU run), the
                                     host timings of the forward/logits/sample spans,
                                     labelled timing="host"
Counters ("C") from the step snapshots: KV cache usage, free blocks, batch tokens,
running/waiting requests. Flows ("s" -> "f") from each request's slice to the
steps that served it: from the step spans' links when present, else from the
step snapshot's scheduled request ids.

NOTE: Perfetto wants slices on one track strictly nested; requests overlap one
another, so each gets its own track instead of sharing one.
"""
from __future__ import annotations

from typing import Any

DEVICE_MIRRORS = ("GPUModelRunner._model_forward", "GPUModelRunner.compute_logits", "GPUModelRunner._sample")
MAIN_TID, REQUEST_TID0 = 1, 100


class _Builder:

    def __init__(self, run) -> None:
        from vllm_anatomy.tracing.exporters import process_key
        self.key = process_key
        self.spans = run.spans()
        self.steps = list(run.snapshots("step"))
        starts = [s.start_ns for s in self.spans] + [s.time_ns for s in self.steps]
        self.t0 = min(starts) if starts else 0
        self.events: list[dict[str, Any]] = []
        self.pids: dict[tuple, int] = {}
        self.request_lane: dict[str, tuple[int, int]] = {}   # span_id -> (pid, tid)
        self._device_pid: int | None = None

    def device_lane(self) -> int:
        """The device lane's pid, named on first use."""
        if self._device_pid is None:
            self._device_pid = len(self.pids) + 1000
            self.meta("process_name", self._device_pid, 0, "device")
            self.meta("thread_name", self._device_pid, MAIN_TID, "device lane")
        return self._device_pid

    def ts(self, ns: int) -> float:
        return (ns - self.t0) / 1000.0

    def pid(self, key: tuple) -> int:
        if key not in self.pids:
            self.pids[key] = len(self.pids) + 1
            self.meta("process_name", self.pids[key], 0, f"{key[0]} {key[1]} (pid {key[2]})")
            self.meta("thread_name", self.pids[key], MAIN_TID, "main")
        return self.pids[key]

    def meta(self, what: str, pid: int, tid: int, name: str) -> None:
        self.events.append({"ph": "M", "name": what, "pid": pid, "tid": tid, "args": {"name": name}})

    def slice(self, s, pid: int, tid: int, **args: Any) -> None:
        self.events.append({"ph": "X", "name": s.name, "cat": s.process_kind or "span", "pid": pid, "tid": tid,
                            "ts": self.ts(s.start_ns), "dur": max(s.duration_ns, 0) / 1000.0,
                            "args": {"span_id": s.span_id, **s.attributes, **args}})

    def add_spans(self) -> None:
        is_device = [s.attributes.get("vllm_anatomy.lane") == "device" for s in self.spans]
        mirror = not any(is_device)
        for s, dev in zip(self.spans, is_device):
            pid = self.pid(self.key(s))
            if s.attributes.get("vllm_anatomy.span_type") == "request":
                tid = REQUEST_TID0 + len(self.request_lane)
                self.request_lane[s.span_id] = (pid, tid)
                self.meta("thread_name", pid, tid, f"request {s.request_id}")
                self.slice(s, pid, tid)
                continue
            if dev:
                self.slice(s, self.device_lane(), MAIN_TID)
            elif mirror and s.name in DEVICE_MIRRORS:
                device_pid = self.device_lane()         # (named before the host slice)
                self.slice(s, pid, MAIN_TID)
                self.slice(s, device_pid, MAIN_TID, timing="host", mirror_of=s.span_id)
            else:
                self.slice(s, pid, MAIN_TID)

    def add_counters(self) -> None:
        step_end = {s.step_id: s.end_ns for s in self.spans if s.name == "EngineCore.step"}
        for snap in self.steps:
            d = snap.data
            kv, so, sched = d["scheduler"]["kv_cache"], d["scheduler_output"], d["scheduler"]
            ts = self.ts(step_end.get(snap.step_id, snap.time_ns))
            for name, args in (("KV cache usage", {"usage": kv["usage"]}),
                               ("KV free blocks", {"free": kv["num_free_blocks"]}),
                               ("batch tokens", {"tokens": so["total_num_scheduled_tokens"]}),
                               ("requests", {"running": len(sched["running"]), "waiting": len(sched["waiting"])})):
                self.events.append({"ph": "C", "name": name, "pid": 1, "tid": 0, "ts": ts, "args": args})

    def served(self) -> list[tuple[Any, str]]:
        """(step span, request span id) pairs: links first, snapshots as the fallback."""
        pairs = [(s, lk["span_id"]) for s in self.spans if s.name == "EngineCore.step"
                 for lk in s.links if lk["span_id"] in self.request_lane]
        if pairs:
            return pairs
        by_req = {s.request_id: s.span_id for s in self.spans if s.span_id in self.request_lane}
        step_spans = {s.step_id: s for s in self.spans if s.name == "EngineCore.step"}
        for snap in self.steps:
            step = step_spans.get(snap.step_id)
            for rid in snap.data["scheduler_output"]["num_scheduled_tokens"] if step else ():
                if rid in by_req:
                    pairs.append((step, by_req[rid]))
        return pairs

    def add_flows(self) -> None:
        requests = {s.span_id: s for s in self.spans if s.span_id in self.request_lane}
        for i, (step, req_span_id) in enumerate(self.served()):
            req = requests[req_span_id]
            pid, tid = self.request_lane[req_span_id]
            ts = self.ts(min(max(step.start_ns, req.start_ns), req.end_ns))
            common = {"name": "serves", "cat": "flow", "id": i + 1}
            self.events.append({**common, "ph": "s", "pid": pid, "tid": tid, "ts": ts})
            self.events.append({**common, "ph": "f", "bp": "e", "pid": self.pid(self.key(step)), "tid": MAIN_TID,
                                "ts": self.ts(step.start_ns)})


def export(run) -> dict[str, Any]:
    b = _Builder(run)
    b.add_spans()
    b.add_counters()
    b.add_flows()
    return {"traceEvents": b.events, "displayTimeUnit": "ms",
            "otherData": {"run_id": run.meta.get("run_id"), "model": run.meta.get("model")}}
