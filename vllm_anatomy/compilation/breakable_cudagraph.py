"""Piecewise CUDA graphs without torch.compile: a capture that breaks around attention.

Mirrors vllm/compilation/breakable_cudagraph.py (BreakableCUDAGraphCapture,
eager_break_during_capture) and vllm/utils/torch_utils.py (weak_ref_tensor);
v0.27.1 turns the breakable capture on with an environment variable,
VLLM_USE_BREAKABLE_CUDAGRAPH.
vLLM's usual PIECEWISE graphs come from torch.compile splitting the model's FX
graph at the attention ops; the breakable capture gets the same pieces at run
time instead: one capture context drives the whole forward, and when the
forward reaches an attention op the capture of the current piece ends, the op
is recorded as an *eager* segment, and a new piece begins.

    capture:  [graph 0: embed, norm, qkv, rope, cache write] attn 0 [graph 1: o_proj, mlp, ..., qkv] attn 1 ...
    replay:   graph0.replay(); attn0(metadata); graph1.replay(); attn1(metadata); ...

Why pieces: attention is the one op whose launch depends on the batch's
*shape* (how many requests, how long each query: its grid and block sizes),
so one graph per token count cannot hold it for every mix of prefills and
decodes. Everything else in a layer depends only on the number of tokens. A
mixed batch padded to a captured size then replays ~29 graphs and launches 28
attention kernels, instead of launching ~400 kernels one by one.

The rule that makes it work: an eager segment reads and writes only tensors
whose addresses the graphs know — its inputs were allocated by the piece
before it, and its output buffer too (the op writes into it in place, never
returns a new tensor). At replay, each eager segment gets the step's
attn_metadata (vLLM's ops read it from the forward context; ours take it as an
argument, so replay passes it in).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch


class _DeviceMemory:
    """Device memory described by __cuda_array_interface__, for torch.as_tensor (no ownership)."""

    def __init__(self, data_ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (data_ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "version": 3}


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory that does not keep it alive (vLLM: a C++ op).

    NOTE: a recorded eager segment must not hold its arguments' storage: they
    live in the graphs' shared memory pool, and a strong reference would pin
    them for every captured size (~0.5 MB per token of the size, summed over
    all sizes). Weak, the pool reuses that memory for the next size's capture;
    that is safe for the same reason sharing the pool is (worker/cudagraph.py):
    one graph runs at a time."""
    if tensor.numel() == 0:
        return tensor
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    raw = torch.as_tensor(_DeviceMemory(tensor.data_ptr(), span * tensor.element_size()), device=tensor.device)
    return raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())


class BreakableCUDAGraphCapture:
    """A capture of one forward as graph segments and eager segments, replayed in order."""

    _tls = threading.local()

    @classmethod
    def current(cls) -> BreakableCUDAGraphCapture | None:
        return getattr(cls._tls, "active", None)

    def __init__(self, pool: Any = None) -> None:
        # One pool for all the pieces (and, passed in, for every captured size).
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        # Each segment: a graph's replay (no arguments), or an eager op and the
        # (weakly referenced) arguments it was called with at capture.
        self.segments: list[torch.cuda.CUDAGraph | tuple[Callable, tuple, dict]] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def __enter__(self) -> BreakableCUDAGraphCapture:
        if self.current() is not None:
            raise RuntimeError("nested BreakableCUDAGraphCapture")
        BreakableCUDAGraphCapture._tls.active = self
        self._begin_segment()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._end_segment()
        finally:
            BreakableCUDAGraphCapture._tls.active = None

    def _begin_segment(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def _end_segment(self) -> None:
        if self._graph is not None:
            self._graph.capture_end()
            self.segments.append(self._graph)
            self._graph = None

    def add_eager(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """End the current piece, run fn now (its capture-time call), record it, begin the next piece."""
        self._end_segment()
        result = fn(*args, **kwargs)
        weak = lambda v: weak_ref_tensor(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
        self.segments.append((fn, tuple(weak(a) for a in args), {k: weak(v) for k, v in kwargs.items()}))
        self._begin_segment()
        return result

    def replay(self, **runtime_kwargs: Any) -> None:
        """Every segment in capture order; eager ones get runtime_kwargs (the step's attn_metadata)."""
        for segment in self.segments:
            if isinstance(segment, torch.cuda.CUDAGraph):
                segment.replay()
            else:
                fn, args, kwargs = segment
                fn(*args, **{**kwargs, **runtime_kwargs})

    @property
    def num_graphs(self) -> int:
        return sum(isinstance(s, torch.cuda.CUDAGraph) for s in self.segments)

    @property
    def num_eager_breaks(self) -> int:
        return len(self.segments) - self.num_graphs


def eager_break_during_capture(fn: Callable) -> Callable:
    """Make fn a break point: inside a BreakableCUDAGraphCapture it runs eagerly
    between two graph pieces (and at every replay); anywhere else it is a plain call.

    fn must write its result into a tensor the caller passed in (see the module docstring)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        capture = BreakableCUDAGraphCapture.current()
        if capture is None:
            return fn(*args, **kwargs)
        return capture.add_eager(fn, args, kwargs)
    return wrapper
