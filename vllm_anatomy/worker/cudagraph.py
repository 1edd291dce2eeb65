"""CUDA graphs for pure-decode batches: which steps replay a graph, padded to what size.

Mirrors vllm/v1/cudagraph_dispatcher.py (CudagraphDispatcher), the FULL
graph path of vllm/compilation/cuda_graph.py (CUDAGraphWrapper), and the
names those use: CUDAGraphMode (vllm/config/compilation.py) and
BatchDescriptor (vllm/forward_context.py). We implement one configured mode,
FULL_DECODE_ONLY (a full graph for uniform decode batches, eager otherwise),
besides NONE; PIECEWISE and FULL_AND_PIECEWISE need torch.compile's graph
splitting, which we do not have, so CUDAGraphMode keeps only the three values
we use (NONE and FULL are also the two runtime modes a step can get).

Why graphs: a decode step of a 28-layer model is ~400 small kernel launches.
Each launch costs the CPU several microseconds (tens on a busy or sandboxed
host) while the kernel itself may run for less; the GPU then waits for the
CPU. A CUDA graph records the launches once and replays them all with one
call, so the GPU runs back to back.

What a graph cannot do: change shapes or host-side values. A graph captured
for N tokens replays exactly the same kernels on exactly the same addresses.
So:
- inputs live in static buffers (GPUModelRunner's persistent input_ids,
  positions, query_start_loc, seq_lens, block_table, slot_mapping): each step
  writes new *values* into them and replays;
- a batch of B decodes is padded up to the next capture size N >= B: the N - B
  padding tokens have slot -1 (no KV write), query_len 0 and seq_len 0 (the
  attention kernel's programs for them exit at once), and their hidden states
  are never read (logits_indices point at the real rows only);
- prefill chunks vary in query length: a batch with one runs eager.

The decision and its reason go into the trace — a CudagraphReason code to
switch on, and a sentence to read — so a learner sees per step why the GPU
replayed a graph of 40 for 37 requests, or why it ran eager.
"""
from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_anatomy.config import CompilationConfig


class CUDAGraphMode(enum.Enum):
    """vLLM's cudagraph modes, the ones implemented here (vllm/config/compilation.py).

    FULL_DECODE_ONLY is a configured mode: its value (FULL, NONE) says which
    runtime mode a uniform-decode batch and a mixed batch get. A step's
    runtime mode is NONE or FULL."""
    NONE = 0
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)

    def decode_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class BatchDescriptor:
    """The padded batch a graph is captured for and replayed on (vllm/forward_context.py;
    no LoRA fields). With FULL_DECODE_ONLY, num_tokens alone keys a graph."""
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False    # every request has the same query length (here: 1, a decode)


class CudagraphReason(str, enum.Enum):
    """Why a step got its runtime mode: a code (recorded as `reason_code`) beside the sentence."""
    CUDAGRAPHS_OFF = "cudagraphs_off"        # mode NONE (a CPU, the torch backend, enforce_eager)
    PREFILL_IN_BATCH = "prefill_in_batch"    # a query longer than one token: not a uniform decode
    BATCH_TOO_LARGE = "batch_too_large"      # more decodes than the largest captured graph
    PURE_DECODE = "pure_decode"              # replay, padded up to a capture size if needed


@dataclass(frozen=True)
class CudagraphDecision:
    """What the dispatcher decided for one step (plain data, recorded in the trace)."""
    mode: CUDAGraphMode                # runtime mode: FULL (replay a graph) | NONE (eager)
    batch_descriptor: BatchDescriptor  # num_tokens: what the forward runs on (padded for a graph)
    num_tokens: int                    # tokens scheduled
    reason_code: CudagraphReason
    reason: str

    @property
    def num_padded_tokens(self) -> int:
        return self.batch_descriptor.num_tokens

    def to_dict(self) -> dict:
        return {"mode": self.mode.name, "num_tokens": self.num_tokens,
                "num_padded_tokens": self.num_padded_tokens, "reason": self.reason,
                "reason_code": self.reason_code.value}


class CudagraphDispatcher:
    """Pure decision logic: no CUDA needed (tested on a CPU)."""

    def __init__(self, compilation_config: CompilationConfig) -> None:
        name = compilation_config.cudagraph_mode
        if name not in ("NONE", "FULL_DECODE_ONLY"):
            raise ValueError(f"cudagraph_mode must be NONE or FULL_DECODE_ONLY, got {name!r}")
        self.cudagraph_mode = CUDAGraphMode[name]
        self.capture_sizes = sorted(compilation_config.cudagraph_capture_sizes)
        self.max_size = self.capture_sizes[-1] if self.capture_sizes else 0

    @property
    def enabled(self) -> bool:
        return self.cudagraph_mode is not CUDAGraphMode.NONE and bool(self.capture_sizes)

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest capture size >= num_tokens (None past the largest)."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def dispatch(self, num_tokens: int, num_reqs: int, max_query_len: int) -> CudagraphDecision:
        # NOTE: "uniform decode" = every request has exactly one query token,
        # so the batch's shape is fully described by its size: the only kind
        # of batch one graph per size can serve.
        def eager(code: CudagraphReason, reason: str) -> CudagraphDecision:
            return CudagraphDecision(CUDAGraphMode.NONE, BatchDescriptor(num_tokens), num_tokens, code, reason)
        if not self.enabled:
            return eager(CudagraphReason.CUDAGRAPHS_OFF, "CUDA graphs off (eager mode)")
        if max_query_len != 1 or num_tokens != num_reqs:
            return eager(CudagraphReason.PREFILL_IN_BATCH, f"prefill in batch (max query_len {max_query_len}): eager")
        padded = self.padded_size(num_tokens)
        if padded is None:
            return eager(CudagraphReason.BATCH_TOO_LARGE,
                         f"{num_tokens} decodes > largest graph ({self.max_size}): eager")
        pad = f", padded {num_tokens} -> {padded}" if padded != num_tokens else ""
        return CudagraphDecision(self.cudagraph_mode.decode_mode(), BatchDescriptor(padded, padded, uniform=True),
                                 num_tokens, CudagraphReason.PURE_DECODE, f"pure decode{pad}")


class CUDAGraphRunner:
    """Captured graphs, one per size, sharing one memory pool; replay by size.

    NOTE: sizes are captured largest first. Every graph allocates its
    intermediates from the shared pool, so a smaller graph captured later
    reuses the larger one's memory instead of adding its own. That is safe
    because only one graph runs at a time, and its output (the hidden states)
    is consumed (compute_logits) before the next replay overwrites it.
    """

    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        # With tensor parallelism (set by the Worker): the rank's CollectiveTracer,
        # and per size the collectives its graph captured, counted again at each replay.
        self.collective_tracer = None
        self.collectives: dict[int, dict[str, tuple[int, int]]] = {}

    def capture(self, size: int, forward: Callable[[], torch.Tensor]) -> None:
        # A warm-up run first, outside capture: Triton compiles its kernels and
        # cuBLAS picks its algorithms here (neither may happen inside a capture).
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        tracer = self.collective_tracer
        before = tracer.snapshot_counts() if tracer is not None else {}
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        if tracer is not None:
            after = tracer.snapshot_counts()
            self.collectives[size] = {op: (after[op][0] - n, after[op][1] - b) for op, (n, b) in before.items()}
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = graph
        self.outputs[size] = output

    def replay(self, size: int) -> torch.Tensor:
        self.graphs[size].replay()
        if self.collective_tracer is not None:
            self.collective_tracer.add_replayed(self.collectives[size])
        return self.outputs[size]

    def __contains__(self, size: int) -> bool:
        return size in self.graphs
