"""Chrome trace-event JSON, for ui.perfetto.dev or chrome://tracing.

Processes and tracks (pid / tid):
    one process per engine process   "main" (tid 1): step and start-up spans; "input thread" /
                                     "output thread" (tids 2, 3): EngineCoreProc's ZMQ threads;
                                     one track per request (tids 100+i, "request <id>"): the
                                     spans of that request's trace made by this process
    one "device" process             one track per process that timed device work (a rank):
                                     device-lane spans (`vllm_anatomy.lane` = "device"); without
                                     any (a CPU run), the host timings of the forward / logits /
                                     sample spans, labelled timing="host"
Counters ("C") from the step snapshots: KV cache usage, free blocks, batch tokens,
running/waiting requests. Flows ("s" -> "f") from each request's slice to the
steps that served it: from the step spans' links when present, else from the
step snapshot's scheduled request ids.

NOTE: Perfetto wants the slices of one track strictly nested. Work that really
overlaps (two requests, an async step launched while the previous one finishes, a
call whose reply is read later) is put on a track of its own: within each group
above, a slice that would partly overlap one already on the track goes to the
next track of the group ("main (2)", ...), so no track has a partial overlap
(tracing/trace_check.py: perfetto_problems).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

DEVICE_MIRRORS = ("GPUModelRunner._model_forward", "GPUModelRunner.compute_logits", "GPUModelRunner._sample")
MAIN_TID, INPUT_TID, OUTPUT_TID, REQUEST_TID0, SPILL_TID0 = 1, 2, 3, 100, 10_000
THREAD_TIDS = {"input": (INPUT_TID, "input thread"), "output": (OUTPUT_TID, "output thread")}


class _Tracks:
    """The tracks of one group: slices go to the first track they nest on."""

    def __init__(self, builder: "_Builder", pid: int, tid: int, name: str) -> None:
        self.builder, self.pid, self.name = builder, pid, name
        self.tids = [tid]
        self.stacks: list[list[int]] = [[]]       # end times (ns) of the open slices, per track
        builder.meta("thread_name", pid, tid, name)

    def place(self, start: int, end: int) -> int:
        """The tid of the first track where [start, end] nests (a new one if none)."""
        for tid, stack in zip(self.tids, self.stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or stack[-1] >= end:
                stack.append(end)
                return tid
        tid = self.builder.spill_tid(self.pid)
        self.tids.append(tid)
        self.stacks.append([end])
        self.builder.meta("thread_name", self.pid, tid, f"{self.name} ({len(self.tids)})")
        return tid


class _Builder:

    def __init__(self, run) -> None:
        from vllm_anatomy.tracing.exporters import process_key
        from vllm_anatomy.tracing.span_names import REQUEST_SPAN
        self.key = process_key
        self.spans = run.spans()
        self.steps = list(run.snapshots("step"))
        starts = [s.start_ns for s in self.spans] + [s.time_ns for s in self.steps]
        self.t0 = min(starts) if starts else 0
        self.events: list[dict[str, Any]] = []
        self.pids: dict[tuple, int] = {}
        self.groups: dict[tuple, _Tracks] = {}
        self.next_spill: dict[int, int] = defaultdict(lambda: SPILL_TID0)
        self.placed: dict[str, tuple[int, int]] = {}          # span_id -> (pid, tid) of its slice
        self.request_tracks: dict[tuple[int, str], int] = {}  # (pid, trace_id) -> base tid
        # The request traces: their request id, by trace.
        self.request_of_trace = {s.trace_id: str(s.request_id or s.attributes.get("vllm_anatomy.request_id"))
                                 for s in self.spans if s.name == REQUEST_SPAN}
        self.request_span_ids = {s.span_id for s in self.spans if s.name == REQUEST_SPAN}
        self._device_pid: int | None = None

    def device_lane(self) -> int:
        """The device process's pid, named on first use."""
        if self._device_pid is None:
            self._device_pid = len(self.pids) + 1000
            self.meta("process_name", self._device_pid, 0, "device")
        return self._device_pid

    def ts(self, ns: int) -> float:
        return (ns - self.t0) / 1000.0

    def pid(self, key: tuple) -> int:
        if key not in self.pids:
            self.pids[key] = len(self.pids) + 1
            self.meta("process_name", self.pids[key], 0, f"{key[0]} {key[1]} (pid {key[2]})")
        return self.pids[key]

    def spill_tid(self, pid: int) -> int:
        tid = self.next_spill[pid]
        self.next_spill[pid] = tid + 1
        return tid

    def meta(self, what: str, pid: int, tid: int, name: str) -> None:
        self.events.append({"ph": "M", "name": what, "pid": pid, "tid": tid, "args": {"name": name}})

    def group(self, pid: int, tid: int, name: str) -> _Tracks:
        g = self.groups.get((pid, tid))
        if g is None:
            g = self.groups[(pid, tid)] = _Tracks(self, pid, tid, name)
        return g

    def slice(self, s, pid: int, group: _Tracks, **args: Any) -> None:
        end = max(s.end_ns, s.start_ns)
        tid = group.place(s.start_ns, end)
        if not args:
            self.placed[s.span_id] = (pid, tid)
        self.events.append({"ph": "X", "name": s.name, "cat": s.process_kind or "span", "pid": pid, "tid": tid,
                            "ts": self.ts(s.start_ns), "dur": (end - s.start_ns) / 1000.0,
                            "args": {"span_id": s.span_id, **s.attributes, **args}})

    def host_group(self, s, pid: int) -> _Tracks:
        """The track group of a host span: its request's, its thread's, or the process' main one."""
        request = self.request_of_trace.get(s.trace_id)
        if request is not None:
            base = self.request_tracks.get((pid, s.trace_id))
            if base is None:
                base = self.request_tracks[(pid, s.trace_id)] = REQUEST_TID0 + len(self.request_tracks)
            return self.group(pid, base, f"request {request}")
        thread = s.attributes.get("vllm_anatomy.thread")
        if thread in THREAD_TIDS:
            tid, name = THREAD_TIDS[thread]
            return self.group(pid, tid, name)
        return self.group(pid, MAIN_TID, "main")

    def device_group(self, s) -> _Tracks:
        """The device track of the process (rank) that timed it."""
        device_pid = self.device_lane()
        source = self.pid(self.key(s))
        return self.group(device_pid, source, f"{s.process_kind} pid {s.pid}")

    def add_spans(self) -> None:
        is_device = [s.attributes.get("vllm_anatomy.lane") == "device" for s in self.spans]
        mirror = not any(is_device)
        order = sorted(range(len(self.spans)), key=lambda i: (self.spans[i].start_ns, -self.spans[i].end_ns))
        for i in order:
            s = self.spans[i]
            pid = self.pid(self.key(s))
            if is_device[i]:
                self.slice(s, self.device_lane(), self.device_group(s))
                continue
            self.slice(s, pid, self.host_group(s, pid))
            if mirror and s.name in DEVICE_MIRRORS:
                self.slice(s, self.device_lane(), self.device_group(s), timing="host", mirror_of=s.span_id)

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
                 for lk in s.links if lk["span_id"] in self.request_span_ids]
        if pairs:
            return pairs
        by_req = {str(s.request_id): s.span_id for s in self.spans if s.span_id in self.request_span_ids}
        step_spans = {s.step_id: s for s in self.spans if s.name == "EngineCore.step"}
        for snap in self.steps:
            step = step_spans.get(snap.step_id)
            for rid in snap.data["scheduler_output"]["num_scheduled_tokens"] if step else ():
                if str(rid) in by_req:
                    pairs.append((step, by_req[str(rid)]))
        return pairs

    def add_flows(self) -> None:
        requests = {s.span_id: s for s in self.spans if s.span_id in self.request_span_ids}
        for i, (step, req_span_id) in enumerate(self.served()):
            req = requests[req_span_id]
            if req_span_id not in self.placed or step.span_id not in self.placed:
                continue
            (rpid, rtid), (spid, stid) = self.placed[req_span_id], self.placed[step.span_id]
            ts = self.ts(min(max(step.start_ns, req.start_ns), req.end_ns))
            common = {"name": "serves", "cat": "flow", "id": i + 1}
            self.events.append({**common, "ph": "s", "pid": rpid, "tid": rtid, "ts": ts})
            self.events.append({**common, "ph": "f", "bp": "e", "pid": spid, "tid": stid,
                                "ts": self.ts(step.start_ns)})


def export(run) -> dict[str, Any]:
    b = _Builder(run)
    b.add_spans()
    b.add_counters()
    b.add_flows()
    return {"traceEvents": b.events, "displayTimeUnit": "ms",
            "otherData": {"run_id": run.meta.get("run_id"), "model": run.meta.get("model")}}
