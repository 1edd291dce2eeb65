"""CollectiveTracer: the communication account of a rank, step by step.

Every collective a GroupCoordinator runs (distributed/parallel_state.py) goes
through `tracer.collective(op, tensor)`:
- always: it is counted, with its bytes (two integer adds; the trace level
  never changes what is computed, and a step's counts cost nothing to keep);
- at level `full`: one host span per collective (`GroupCoordinator.<op>`) and,
  on CUDA, a device-lane interval `GPU.collective.<op>` from two CUDA events,
  read at the step's existing sync point (DeviceTimer), never an extra sync.
The Worker puts a step's counts on its `Worker.execute_model` span
(`take_step_counts`): vllm_anatomy.num_all_reduce, vllm_anatomy.all_reduce_bytes, ...

Bytes are what this rank hands to the collective (the input tensor): an
all-reduce of a [T, H] bf16 activation counts T x H x 2 bytes, whatever the
algorithm moves on the wire (a ring all-reduce sends ~2 (N-1)/N of that).

NOTE: a CUDA graph replay runs its captured collectives without Python: the
runner replays, then `add_replayed(counts)` adds what the capture recorded for
that size (worker/cudagraph.py), so a graph step is counted like an eager one.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from vllm_anatomy.tracing.recorder import NullRecorder, Recorder
from vllm_anatomy.tracing.runner_tracer import NULL_KERNEL_TIMER

# The collectives a GroupCoordinator runs (span and attribute names use these).
OPS = ("all_reduce", "all_gather", "broadcast")


class CollectiveTracer:

    def __init__(self, recorder: Recorder | None = None, kernel_timer: Any = NULL_KERNEL_TIMER) -> None:
        self.recorder = recorder or NullRecorder()
        self.kernel_timer = kernel_timer        # the runner's (tracing/runner_tracer.py): null below level full
        self.host_spans = self.recorder.wants_snapshots
        # op -> [number of calls, bytes], since the last take_step_counts()
        self.counts: dict[str, list[int]] = {op: [0, 0] for op in OPS}

    @contextlib.contextmanager
    def collective(self, op: str, tensor: torch.Tensor, group_size: int) -> Iterator[None]:
        nbytes = tensor.numel() * tensor.element_size()
        count = self.counts[op]
        count[0] += 1
        count[1] += nbytes
        if not self.host_spans:
            yield
            return
        attrs: dict[str, Any] = {"vllm_anatomy.collective": op, "vllm_anatomy.bytes": nbytes,
                 "vllm_anatomy.group_size": group_size}
        with self.recorder.span(f"GroupCoordinator.{op}", **attrs), \
                self.kernel_timer.interval(f"GPU.collective.{op}", **attrs):
            yield

    def take_step_counts(self) -> dict[str, int]:
        """Span attributes for the collectives since the last call; the counters restart at 0."""
        attrs = {}
        for op, (num, nbytes) in self.counts.items():
            attrs[f"vllm_anatomy.num_{op}"] = num
            attrs[f"vllm_anatomy.{op}_bytes"] = nbytes
        self.reset()
        return attrs

    def reset(self) -> None:
        self.counts = {op: [0, 0] for op in OPS}

    def snapshot_counts(self) -> dict[str, tuple[int, int]]:
        """The counters as they are now (capture: what one graph's collectives add)."""
        return {op: (num, nbytes) for op, (num, nbytes) in self.counts.items()}

    def add_replayed(self, counts: dict[str, tuple[int, int]]) -> None:
        """A CUDA graph replay ran these collectives (recorded at its capture)."""
        for op, (num, nbytes) in counts.items():
            self.counts[op][0] += num
            self.counts[op][1] += nbytes
