"""What one eager launch costs the host, on a GPU: python bench/launch_overhead.py [--launches 2000]

Why: a fresh 4k-token prompt's forward is host-bound on an H100 (bench/ttft_host.py,
bench/results/gpu_breakdown_ttft4096_host_h100.json): ~17 ms to launch its 353 kernels
while the GPU needs ~11 ms, and under cProfile a Triton launch through JITFunction.run
took ~53 us. Before building a faster launch path, this measures where a launch's host
time goes, per launch, each path timed over --launches back-to-back launches of a kernel
that does almost nothing on the device (the host, not the GPU, sets the pace; one sync
at the end):

  triton_jit        kernel[grid](...) as the engine calls it: binder (specialisation of
                    every argument), cache key, launch metadata, then the C launcher
  triton_compiled   the CompiledKernel that call returned, launched directly
                    (compiled[grid](*args)): no binder, no key, no lookup
  torch_empty       torch.empty of a small tensor (the wrappers allocate their outputs)
  torch_add_        a small in-place torch op (one ATen kernel launch)
  torch_linear      F.linear of 16 x 1024 by 1024 x 1024 bf16 (one cuBLAS launch)
  reshape_and_cache the engine's wrapper (vllm_anatomy/kernels/reshape_and_cache.py) with
                    its checks, at 16 tokens: what a wrapper adds over the JIT launch

The direct path's output is checked against the JIT path's (a kernel writing x + c).
Prints a table (us per launch) and writes bench/results/launch_overhead_<card>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import card_name  # noqa: E402  (bench/kernel_bench.py)


def per_launch_us(fn: Callable[[], object], launches: int, repeats: int = 5) -> dict:
    """Host microseconds per call of fn: the best and the median of `repeats` timed loops of
    `launches` calls (a warm-up loop first; one synchronize after each loop, outside the clock)."""
    for _ in range(min(launches, 200)):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(launches):
            fn()
        samples.append((time.perf_counter() - t0) / launches * 1e6)
        torch.cuda.synchronize()
    samples.sort()
    return {"best_us": samples[0], "median_us": samples[len(samples) // 2], "samples_us": samples}


def triton_paths(launches: int) -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_kernel(x_ptr, out_ptr, n, c, s0, s1, s2, s3, s4, s5, s6, s7,
                    BLOCK: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
        # (twelve runtime arguments, three constexprs: about what reshape_and_cache passes)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + c + (s0 * 0), mask=mask)

    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    out_jit, out_direct = torch.empty_like(x), torch.empty_like(x)
    grid = (triton.cdiv(x.numel(), 256),)
    strides = (16, 32, 64, 128, 256, 512, 1024, 2048)

    def jit_out(out):
        return _add_kernel[grid](x, out, x.numel(), 3.0, *strides, BLOCK=256, A=1, B=2)

    compiled = jit_out(out_jit)
    result: dict = {"triton_jit": per_launch_us(lambda: jit_out(out_jit), launches)}
    try:
        args = (x, out_direct, x.numel(), 3.0, *strides, 256, 1, 2)
        runner = compiled[grid]
        runner(*args)
        torch.cuda.synchronize()
        if not torch.equal(out_direct, out_jit):
            raise RuntimeError("the direct launch wrote another result than the JIT launch")
        result["triton_compiled"] = per_launch_us(lambda: runner(*args), launches)
    except Exception as exc:        # noqa: BLE001  (the API differs between Triton releases: say so)
        result["triton_compiled"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


def torch_paths(launches: int) -> dict:
    import torch.nn.functional as F
    small = torch.zeros(256, device="cuda")
    a = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    return {"torch_empty": per_launch_us(lambda: torch.empty(16, 1024, device="cuda", dtype=torch.bfloat16), launches),
            "torch_add_": per_launch_us(lambda: small.add_(1.0), launches),
            "torch_linear": per_launch_us(lambda: F.linear(a, w), launches)}


def wrapper_path(launches: int) -> dict:
    from vllm_anatomy.kernels.reshape_and_cache import reshape_and_cache
    tokens, heads, dim, blocks, block_size = 16, 8, 128, 64, 16
    key = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    key_cache = torch.zeros(blocks, block_size, heads, dim, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.arange(tokens, device="cuda", dtype=torch.int64)
    return {"reshape_and_cache": per_launch_us(lambda: reshape_and_cache(key, value, key_cache, value_cache, slots),
                                               launches)}


def print_table(rows: dict) -> None:
    print(f"{'path':<20}{'best us':>10}{'median us':>11}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<20}  {r['error']}")
        else:
            print(f"{name:<20}{r['best_us']:>10.2f}{r['median_us']:>11.2f}")
    jit, direct = rows.get("triton_jit", {}), rows.get("triton_compiled", {})
    if "median_us" in jit and "median_us" in direct:
        print(f"JIT path over the direct launch: {jit['median_us'] - direct['median_us']:.2f} us a launch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=2000, help="launches per timed loop")
    ap.add_argument("--out", help="default: bench/results/launch_overhead_<card>.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/launch_overhead.py times CUDA launches: it needs a GPU")
    import triton
    name = torch.cuda.get_device_name()
    rows = triton_paths(args.launches) | torch_paths(args.launches) | wrapper_path(args.launches)
    print(f"{name}, Triton {triton.__version__}, torch {torch.__version__}, {args.launches} launches a loop")
    print_table(rows)
    out = args.out or f"bench/results/launch_overhead_{card_name()}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"bench": "launch_overhead", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "gpu": name,
                   "triton": triton.__version__, "torch": torch.__version__, "launches": args.launches,
                   "python": platform.python_version(), "paths": rows}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
