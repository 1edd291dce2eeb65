"""DeviceTimer: where a step's time went on the device, without an extra sync.

CUDA events are recorded between the step's device phases (H2D copies of the
prepared inputs, the forward, logits, sampling, the D2H copy of the sampled
ids). Reading an event's time needs the device to have reached it — so they are
read only after the step's one existing sync point (`_bookkeeping_sync`), when
all of them have. The spans go to the recorder with explicit timestamps on the
"device" lane.

NOTE: device and host clocks differ; we anchor the device timeline at the sync:
the last event completed just before `synchronize()` returned, so a mark's host
time is `t_sync - elapsed(mark, last)`. (Anchoring at the first *enqueue* would
be wrong: the device may start the step long after the CPU enqueued it.)
On a CPU there is no device lane: every op runs synchronously on the host, and
the host spans (GPUModelRunner._model_forward, ...) are that timeline.
"""
from __future__ import annotations

import torch

from vllm_anatomy.tracing.recorder import Recorder


class DeviceTimer:

    def __init__(self, device: torch.device, recorder: Recorder) -> None:
        self.recorder = recorder
        self.enabled = recorder.enabled and device.type == "cuda"
        self.marks: list[tuple[str, torch.cuda.Event]] = []

    def mark(self, phase: str) -> None:
        """The device work enqueued from here on belongs to `phase` (until the next mark)."""
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase, event))

    def resolve(self, step_id: int) -> None:
        """After the sync point: turn the marks into device-lane spans."""
        if not self.enabled or len(self.marks) < 2:
            self.marks.clear()
            return
        t_sync = self.recorder.now_ns()
        last = self.marks[-1][1]
        for (phase, ev), (_, nxt) in zip(self.marks, self.marks[1:]):
            start = t_sync - int(ev.elapsed_time(last) * 1e6)
            end = t_sync - int(nxt.elapsed_time(last) * 1e6)
            self.recorder.record_span(f"GPU.{phase}", start, end, **{
                "vllm_anatomy.lane": "device", "vllm_anatomy.step_id": step_id,
                "vllm_anatomy.timing": "cuda_event"})
        self.marks.clear()
