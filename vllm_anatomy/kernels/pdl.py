"""pdl: Programmatic Dependent Launch (Hopper's griddepcontrol) for the decode step's Triton kernels.

A decode step is a chain of short kernels (per Qwen3 layer: rms_norm, qkv GEMM, q/k norm +
RoPE + KV write, attention, o GEMM, rms_norm, gate_up GEMM, silu_and_mul, down GEMM), each of
them a few microseconds, each waiting for the previous one to finish completely before its
first program is even scheduled. Between two kernels of a CUDA-graph replay the GPU drains the
old grid, then ramps the new one up: an H100 profile of the 256-sequence workload found 0.19 s
in ~321,000 gaps under 10 us, and a decode GEMM taking 5.7-8 us where reading its weight at the
copy rate takes 1-4 us. With PDL (sm_90+, CUDA's cudaLaunchAttributeProgrammaticStreamSerialization;
Triton's `kernel[grid](..., launch_pdl=True)`) the next kernel's programs may become resident
while the current one still runs, up to a `griddepcontrol.wait` (tl.extra.cuda.gdc_wait) that
returns once the previous grid has finished and its writes are visible. What a kernel does
before the wait overlaps the previous kernel: the GEMMs prefetch their weight tiles into L2
(CUTLASS's example 63, "hopper gemm with weight prefetch", does the same), the others just
skip the launch latency.

Used by: skinny_gemm.py, rms_norm.py, silu_and_mul.py, fused_qk_norm_rope(_kvcache).py,
unified_attention.py (2D, 3D and reduce_segments), behind VLLM_ANATOMY_PDL (envs.py, off by
default), read once when a layer or the attention backend is built; each kernel wrapper asks
`use_pdl(tensor, switch)` once per launch and passes the answer as `USE_PDL=` and `launch_pdl=`.

NOTE: (a) what may run before the wait. A PDL-launched kernel must gdc_wait before it reads
anything an earlier kernel wrote (activations, metadata, the KV cache) AND before it writes
anything at all: its output tensor comes from the caching allocator, which may hand out memory
that an earlier kernel, still running, reads (a write-after-read race the allocator's stream
order no longer prevents). Only constant inputs (weights) may be touched before the wait, and
only read: here, only L2 prefetches of a GEMM's weight (`prefetch_l2`), which change no value.
NOTE: (b) where to trigger. gdc_launch_dependents lets the next kernel launch once every
program of this grid has triggered or exited. Triggered at a multi-wave kernel's start, the
dependents' programs (parked at their wait) would take SM slots the later waves still need, so
the kernels trigger after their main loop (before the epilogue's stores). A kernel that never
triggers (cuBLAS, torch ops) lets its dependent launch only when it completes.
NOTE: (c) mixing stays correct. A kernel launched without PDL is an ordinary full barrier: it
starts after everything before it has finished, and a PDL kernel after it waits for it to
finish. So cuBLAS GEMMs, torch ops (a zero_ of padding rows) and our kernels with the switch
off can sit anywhere in the chain; they only cost the overlap at their own edges.
NOTE: (d) the wait comes first in every program, before any early exit. The order is transitive
only so: a grid completes when all its programs have exited, and a program that has passed its
wait knows the previous grid is done; a program that exited *without* waiting would let its
grid "complete" before its predecessor and the next kernel's wait would then guard nothing.
So every kernel here waits at its very top (the GEMMs after their prefetches), before any
`return` of a surplus program.
NOTE: (e) CUDA graphs. Stream capture records a PDL launch as a programmatic edge between the
two kernel nodes (CUDA 12.3+), so the decode graphs replay with the overlap; a graph's first
kernel has no kernel before it and starts as usual.
NOTE: (f) results do not change. The wait and the trigger move no arithmetic and a prefetch
changes no value: every kernel computes the same numbers in the same order with the switch on
or off (tests/gpu/test_pdl_engine.py checks whole greedy runs and graph replays bit for bit).
When USE_PDL is False the helpers below compile to nothing, so neither the interpreter nor a
pre-Hopper GPU ever sees the griddepcontrol / prefetch instructions.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_anatomy.kernels.launch import is_interpreted


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous grid has finished and its writes are visible (NOTE (a), (d))."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel's programs launch (NOTE (b)); a hint, repeated calls are no-ops."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, USE_PDL: tl.constexpr):
    """A hint to bring the 128-byte lines at `ptrs` (any shape; in-bounds addresses) into L2.
    Reads nothing into registers and changes no value: allowed before pdl_wait for constant
    inputs only (NOTE (a)). The asm is not pure, so the compiler neither drops it nor moves it
    across the wait."""
    if USE_PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _device_has_pdl(device: torch.device) -> bool:
    """Compute capability 9.0 or newer (Hopper: griddepcontrol and the launch attribute)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(t: torch.Tensor, switch: bool) -> bool:
    """Whether a kernel working on `t` launches with PDL: the switch (VLLM_ANATOMY_PDL, read by
    the caller when it was built) is on, Triton compiles (not TRITON_INTERPRET), and t is on a
    CUDA device of compute capability >= 9. Host facts only: safe inside a graph capture."""
    return switch and t.is_cuda and not is_interpreted(pdl_wait) and _device_has_pdl(t.device)
