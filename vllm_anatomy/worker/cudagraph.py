"""CUDA graphs: which steps replay a graph, padded to what size, and the captured graphs.

Mirrors vllm/v1/cudagraph_dispatcher.py (CudagraphDispatcher), the FULL
graph path of vllm/compilation/cuda_graph.py (CUDAGraphWrapper), and the
names those use: CUDAGraphMode (vllm/config/compilation.py) and
BatchDescriptor (vllm/forward_context.py). Two configured modes besides NONE:
- FULL_DECODE_ONLY: a full graph for uniform decode batches, eager otherwise;
- FULL_AND_PIECEWISE (vLLM's default, ours on a GPU): the same full graphs
  for uniform decodes, and *piecewise* graphs for every other batch up to the
  largest capture size: graph pieces around eager attention. vLLM gets its
  pieces from torch.compile; we get them as vLLM's breakable capture does
  (compilation/breakable_cudagraph.py), no compiler needed.

Why graphs: a step of a 28-layer model is ~400 small kernel launches.
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
- attention's launch depends on the batch's shape (how many requests, how long
  each query), which a full graph fixes: so only uniform decodes get one. A
  mixed batch of T tokens is padded to N >= T for the pieces (slot -1 again)
  while its attention runs eager on the T real tokens, with the step's metadata.

The decision and its reason go into the trace — a CudagraphReason code to
switch on, and a sentence to read — so a learner sees per step why the GPU
replayed a graph of 40 for 37 requests, replayed pieces, or ran eager.
"""
from __future__ import annotations

import bisect
import enum
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from vllm_anatomy.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
from vllm_anatomy.config import CompilationConfig

if TYPE_CHECKING:
    from vllm_anatomy.tracing.collectives import CollectiveTracer


class CUDAGraphMode(enum.Enum):
    """vLLM's cudagraph modes (vllm/config/compilation.py).

    FULL_DECODE_ONLY and FULL_AND_PIECEWISE are configured modes: their value
    (decode, mixed) says which runtime mode a uniform-decode batch and any other
    batch get. A step's runtime mode is NONE, PIECEWISE or FULL. (vLLM also
    accepts PIECEWISE and FULL as configured modes; we do not.)"""
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

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
    """The padded batch a graph is captured for and replayed on (vllm/forward_context.py).
    A full graph is keyed by (num_tokens, num_reqs, uniform=True), piecewise
    graphs by num_tokens alone (num_reqs None)."""
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False    # every request has the same query length (uniform_decode_query_len: 1, or 1 + K drafts)
    # NOTE: vLLM captures graphs per number of active LoRA adapters; no LoRA here.
    has_lora: bool = False
    num_active_loras: int = 0


class CudagraphReason(str, enum.Enum):
    """Why a step got its runtime mode: a code (recorded as `reason_code`) beside the sentence."""
    CUDAGRAPHS_OFF = "cudagraphs_off"        # mode NONE (a CPU, the torch backend, enforce_eager)
    PREFILL_IN_BATCH = "prefill_in_batch"    # a query longer than one token, no piecewise graphs: eager
    BATCH_TOO_LARGE = "batch_too_large"      # more tokens than the largest captured graph: eager
    PURE_DECODE = "pure_decode"              # full graph replay (uniform decode), padded up to a capture size if needed
    MIXED_BATCH = "mixed_batch"              # piecewise replay: graph pieces, attention eager


@dataclass(frozen=True)
class CudagraphDecision:
    """dispatch()'s (mode, batch descriptor) for one step, with why (ours: plain data, recorded in the trace)."""
    mode: CUDAGraphMode                # runtime mode: FULL (a graph) | PIECEWISE (pieces) | NONE (eager)
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

    MODES = ("NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

    def __init__(self, compilation_config: CompilationConfig, max_num_reqs: int | None = None,
                 uniform_decode_query_len: int = 1) -> None:
        name = compilation_config.cudagraph_mode
        if name not in self.MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(self.MODES)}, got {name!r}")
        self.cudagraph_mode = CUDAGraphMode[name]
        self.capture_sizes = sorted(compilation_config.cudagraph_capture_sizes)
        self.max_size = self.capture_sizes[-1] if self.capture_sizes else 0
        # NOTE: a full decode graph holds uniform_decode_query_len tokens per
        # request (1, or 1 + K with K drafts: a verify step): as vLLM, only the
        # sizes from one request's worth up to max_num_seqs requests' get one,
        # and only multiples of it (the config rounds the sizes:
        # CompilationConfig.adjust_cudagraph_sizes_for_spec_decode); piecewise
        # graphs take every size.
        self.uniform_decode_query_len = q = uniform_decode_query_len
        limit = q * max_num_reqs if max_num_reqs is not None else self.max_size
        self.decode_sizes = [s for s in self.capture_sizes if q <= s <= limit and s % q == 0] \
            if self.cudagraph_mode.decode_mode() is CUDAGraphMode.FULL else []
        self.piecewise_sizes = self.capture_sizes \
            if self.cudagraph_mode.mixed_mode() is CUDAGraphMode.PIECEWISE else []

    @property
    def enabled(self) -> bool:
        return self.cudagraph_mode is not CUDAGraphMode.NONE and bool(self.capture_sizes)

    @staticmethod
    def _padded(sizes: list[int], num_tokens: int) -> int | None:
        """The smallest size >= num_tokens (None past the largest)."""
        i = bisect.bisect_left(sizes, num_tokens)
        return sizes[i] if i < len(sizes) else None

    def padded_size(self, num_tokens: int) -> int | None:
        return self._padded(self.capture_sizes, num_tokens)

    def dispatch(self, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False,
                 num_active_loras: int = 0, valid_modes: AbstractSet[CUDAGraphMode] | None = None,
                 invalid_modes: AbstractSet[CUDAGraphMode] | None = None) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode of a batch of num_tokens tokens and the (padded) batch it replays.

        uniform_decode: every request has exactly uniform_decode_query_len
        query tokens (one; 1 + K when verifying K drafts), so the batch's shape
        is fully described by its size: the only kind of batch one full graph
        per size can serve (attention included).
        valid_modes / invalid_modes: restrict the modes (vLLM: cascade attention
        rules out FULL; a forced-eager step allows only NONE).
        has_lora / num_active_loras: NOTE: LoRA batches replay graphs captured
        per adapter count; no LoRA here.
        """
        assert not has_lora, "LoRA is not implemented here"
        allowed = set(valid_modes or (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL))
        allowed -= set(invalid_modes or ())
        assert allowed, f"No allowed cudagraph modes: valid_modes={valid_modes}, invalid_modes={invalid_modes}"
        eager = CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        if not self.enabled or num_tokens > self.max_size or allowed <= {CUDAGraphMode.NONE}:
            return eager
        if CUDAGraphMode.FULL in allowed and uniform_decode:
            padded = self._padded(self.decode_sizes, num_tokens)
            if padded is not None:
                return CUDAGraphMode.FULL, BatchDescriptor(padded, padded // self.uniform_decode_query_len,
                                                           uniform=True)
        if CUDAGraphMode.PIECEWISE in allowed:
            padded = self._padded(self.piecewise_sizes, num_tokens)
            if padded is not None:
                return CUDAGraphMode.PIECEWISE, BatchDescriptor(padded)
        return eager

    def describe(self, mode: CUDAGraphMode, batch_descriptor: BatchDescriptor, num_tokens: int,
                 max_query_len: int, uniform_decode: bool) -> CudagraphDecision:
        """Ours: dispatch()'s answer with the reason for it, as a code and a sentence (for the trace)."""
        def decision(code: CudagraphReason, reason: str) -> CudagraphDecision:
            return CudagraphDecision(mode, batch_descriptor, num_tokens, code, reason)
        padded = batch_descriptor.num_tokens
        q = self.uniform_decode_query_len
        if mode is CUDAGraphMode.FULL:
            what = "pure decode" if q == 1 else f"uniform decode (query_len {q}: 1 + {q - 1} drafts)"
            return decision(CudagraphReason.PURE_DECODE, f"{what}{_pad(num_tokens, padded)}")
        if mode is CUDAGraphMode.PIECEWISE:
            what = f"{num_tokens // q} decodes" if uniform_decode else f"mixed batch (max query_len {max_query_len})"
            return decision(CudagraphReason.MIXED_BATCH,
                            f"{what}: piecewise graphs, attention eager{_pad(num_tokens, padded)}")
        if not self.enabled:
            return decision(CudagraphReason.CUDAGRAPHS_OFF, "CUDA graphs off (eager mode)")
        if not uniform_decode and not self.piecewise_sizes:
            return decision(CudagraphReason.PREFILL_IN_BATCH, f"prefill in batch (max query_len {max_query_len}): eager")
        what = "decode tokens" if uniform_decode else "tokens"
        largest = max(self.decode_sizes + self.piecewise_sizes)
        return decision(CudagraphReason.BATCH_TOO_LARGE, f"{num_tokens} {what} > largest graph ({largest}): eager")

    def decide(self, num_tokens: int, num_reqs: int, max_query_len: int) -> CudagraphDecision:
        """Ours: dispatch() and describe() for a batch of num_reqs requests, the longest query max_query_len."""
        uniform_decode = is_uniform_decode(max_query_len, self.uniform_decode_query_len, num_tokens, num_reqs)
        mode, batch_descriptor = self.dispatch(num_tokens, uniform_decode=uniform_decode)
        return self.describe(mode, batch_descriptor, num_tokens, max_query_len, uniform_decode)


def is_uniform_decode(max_num_scheduled_tokens: int, uniform_decode_query_len: int, num_tokens: int,
                      num_reqs: int) -> bool:
    """Every request has exactly uniform_decode_query_len tokens (vLLM: GPUModelRunner._is_uniform_decode).

    NOTE: with speculative decoding that is 1 + K: a verify step where every
    request carries its K drafts. A step of plain one-token decodes is then
    *not* uniform (as in vLLM): it replays the piecewise graphs."""
    return (max_num_scheduled_tokens == uniform_decode_query_len
            and num_tokens == max_num_scheduled_tokens * num_reqs)


def _pad(num_tokens: int, padded: int) -> str:
    return f", padded {num_tokens} -> {padded}" if padded != num_tokens else ""


class CUDAGraphRunner:
    """Captured graphs sharing one memory pool: full graphs by size, piecewise captures by size.

    NOTE: sizes are captured largest first. Every graph allocates its
    intermediates from the shared pool, so a smaller graph captured later
    reuses the larger one's memory instead of adding its own. That is safe
    because only one graph runs at a time, and its output (the hidden states)
    is consumed (compute_logits) before the next replay overwrites it.
    """

    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.piecewise: dict[int, BreakableCUDAGraphCapture] = {}
        self.outputs: dict[tuple[CUDAGraphMode, int], torch.Tensor] = {}
        self.pool: Any = None                 # the graphs' shared memory pool (an opaque handle)
        self.capture_stream: torch.cuda.Stream | None = None
        # With tensor parallelism (set by the Worker): the rank's CollectiveTracer,
        # and per graph the collectives it captured, counted again at each replay.
        self.collective_tracer: CollectiveTracer | None = None
        self.collectives: dict[tuple[CUDAGraphMode, int], dict[str, tuple[int, int]]] = {}

    def capture(self, mode: CUDAGraphMode, size: int, forward: Callable[[], torch.Tensor]) -> None:
        """Capture forward() for `size` tokens: one graph (FULL) or pieces around attention (PIECEWISE)."""
        # A warm-up run first, outside capture: Triton compiles its kernels and
        # cuBLAS picks its algorithms here (neither may happen inside a capture).
        forward()
        torch.cuda.synchronize()
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream()
        tracer = self.collective_tracer
        before: dict[str, tuple[int, int]] = tracer.snapshot_counts() if tracer is not None else {}
        if mode is CUDAGraphMode.FULL:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                output = forward()
            self.pool = self.pool or graph.pool()
            self.graphs[size] = graph
        else:
            # NOTE: a capture must not run on the default stream; torch.cuda.graph
            # switches streams itself, the breakable capture's raw capture_begin does not.
            self.capture_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.capture_stream), BreakableCUDAGraphCapture(self.pool) as capture:
                output = forward()
            torch.cuda.current_stream().wait_stream(self.capture_stream)
            self.pool = self.pool or capture.pool
            self.piecewise[size] = capture
        if tracer is not None:
            after = tracer.snapshot_counts()
            self.collectives[mode, size] = {op: (after[op][0] - n, after[op][1] - b)
                                            for op, (n, b) in before.items()}
        self.outputs[mode, size] = output

    def replay(self, size: int) -> torch.Tensor:
        """The full graph of `size` (a uniform decode batch)."""
        self.graphs[size].replay()
        return self._replayed(CUDAGraphMode.FULL, size)

    def replay_piecewise(self, size: int, attn_metadata) -> torch.Tensor:
        """The pieces of `size`, attention run eager in between with this step's metadata."""
        self.piecewise[size].replay(attn_metadata=attn_metadata)
        return self._replayed(CUDAGraphMode.PIECEWISE, size)

    def _replayed(self, mode: CUDAGraphMode, size: int) -> torch.Tensor:
        if self.collective_tracer is not None:
            self.collective_tracer.add_replayed(self.collectives[mode, size])
        return self.outputs[mode, size]
