"""Programmatic Dependent Launch (PDL) on a decode-shaped kernel chain: does it pay, and does
it survive CUDA-graph capture with this torch and Triton?

    python bench/pdl_chain.py [--layers 28] [--m 1,16,64] [--out bench/results/pdl_chain_h100.json]
    python bench/pdl_chain.py --tiny --out /tmp/pdl.json     # CPU smoke (Triton interpreter, no PDL)

Why: a decode step is a chain of short kernels. On an H100 each Qwen3-0.6B decode GEMM
takes ~5.7-8 us where reading its 2-12 MB weight at the copy rate takes ~1-4 us, and the
run has ~0.19 s in sub-10-us gaps between graph-replayed kernels (README, "Where an H100's
time goes"). PDL (sm_90+) lets the next kernel of the stream become resident before the
previous one ends: a kernel launched with it waits (griddepcontrol.wait) only where it
first needs the previous kernel's results, and a GEMM's weight is no such result, so it can
be prefetched into L2 before the wait (CUTLASS's "hopper gemm with weight prefetch").

The chain here stands for a decode step without attention: per layer, an RMS-norm-like row
kernel over x [M, H] (H = 1024), a GEMV-like kernel x @ W1.T with W1 [I, H] (I = 4096), the
row kernel over [M, I], then x @ W2.T with W2 [H, I], each layer with its own weights (28
layers: 470 MB, far past L2, as in a real step). Both kernels are small Triton kernels of
this file (using vllm_anatomy/kernels/pdl.py's helpers) with a USE_PDL switch (wait before the first dependent load, launch_dependents
after the main loop) and, for the GEMV, a PREFETCH switch (prefetch.global.L2 of its
weight slice before the wait). Variants, each captured whole in one CUDA graph and timed
by its replays: "plain" (ordinary launches), "pdl" (PDL, no prefetch), "pdl+prefetch".
Outputs must be bit-equal across variants (same arithmetic; only the launch differs), and
near a torch reference of the same chain (rel_err_vs_torch).
The table gives us per layer, the copy-rate floor of the layer's weights, and each
variant's speed-up over plain. A variant whose capture or launch fails is reported with
its error (e.g. a Triton without launch_pdl), not hidden.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kernel_bench import copy_ceiling, time_ms, write_json  # noqa: E402

from vllm_anatomy.kernels.pdl import pdl_launch_dependents, pdl_wait, prefetch_l2  # noqa: E402

VARIANTS = {"plain": (False, False), "pdl": (True, False), "pdl+prefetch": (True, True)}


@triton.jit
def _row_norm_kernel(x_ptr, y_ptr, H, eps, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """y[r] = x[r] * rsqrt(mean(x[r]^2) + eps): one program per row. x [M, H] -> y [M, H]."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    pdl_wait(USE_PDL)                           # x is the previous kernel's output
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    pdl_launch_dependents(USE_PDL)              # the main work is done: let the next grid in
    tl.store(y_ptr + row * H + cols, (x * inv).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K].T, fp32 accumulation; program (i, j) owns rows
    i*BLOCK_M.. of x and rows j*BLOCK_N.. of w, the whole K (K % BLOCK_K == 0)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if PREFETCH:
        # NOTE: w is a weight: nothing earlier in the stream writes it, so it may be read
        # (here only prefetched into L2, one address per 128-byte line) before the wait.
        lines = tl.arange(0, BLOCK_K // 64) * 64
        for k0 in range(0, K, BLOCK_K):
            prefetch_l2(w_ptr + rn[:, None] * K + (k0 + lines)[None, :], USE_PDL)
    pdl_wait(USE_PDL)                           # x is the previous kernel's output
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    pdl_launch_dependents(USE_PDL)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


class Chain:
    """The buffers and weights of one chain; run(use_pdl, prefetch) launches all its kernels."""

    def __init__(self, layers: int, m: int, hidden: int, inter: int, device: str, dtype: torch.dtype):
        gen = torch.Generator(device="cpu").manual_seed(m)
        scale = hidden ** -0.5
        self.w1 = [(torch.randn(inter, hidden, generator=gen) * scale).to(device, dtype) for _ in range(layers)]
        self.w2 = [(torch.randn(hidden, inter, generator=gen) * scale).to(device, dtype) for _ in range(layers)]
        self.x0 = torch.randn(m, hidden, generator=gen).to(device, dtype)
        self.h = torch.empty(m, hidden, device=device, dtype=dtype)
        self.hn = torch.empty_like(self.h)
        self.i = torch.empty(m, inter, device=device, dtype=dtype)
        self.inn = torch.empty_like(self.i)
        self.m, self.hidden, self.inter = m, hidden, inter
        self.block_m = max(16, triton.next_power_of_2(min(m, 64)))
        self.block_n = 64
        self.block_k = 128 if device == "cuda" else 64

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.w1 + self.w2)

    def _norm(self, x, y, n, use_pdl):
        _row_norm_kernel[(self.m,)](x, y, n, 1e-6, BLOCK_H=triton.next_power_of_2(n), USE_PDL=use_pdl,
                                    **_launch(use_pdl))

    def _gemv(self, x, w, out, use_pdl, prefetch):
        n, k = w.shape
        grid = (triton.cdiv(self.m, self.block_m), triton.cdiv(n, self.block_n))
        _gemv_kernel[grid](x, w, out, self.m, n, k, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                           BLOCK_K=self.block_k, USE_PDL=use_pdl, PREFETCH=prefetch, **_launch(use_pdl))

    def run(self, use_pdl: bool, prefetch: bool) -> torch.Tensor:
        self.h.copy_(self.x0)
        for w1, w2 in zip(self.w1, self.w2):
            self._norm(self.h, self.hn, self.hidden, use_pdl)      # [M, H]
            self._gemv(self.hn, w1, self.i, use_pdl, prefetch)     # [M, H] @ [I, H].T -> [M, I]
            self._norm(self.i, self.inn, self.inter, use_pdl)      # [M, I]
            self._gemv(self.inn, w2, self.h, use_pdl, prefetch)    # [M, I] @ [H, I].T -> [M, H]
        return self.h


def reference(chain: Chain) -> torch.Tensor:
    """The chain in torch, fp32 math rounded to the chain's dtype where the kernels store."""
    def norm(x):
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(chain.x0.dtype)
    h = chain.x0
    for w1, w2 in zip(chain.w1, chain.w2):
        i = (norm(h).float() @ w1.float().T).to(h.dtype)
        h = (norm(i).float() @ w2.float().T).to(h.dtype)
    return h


def _launch(use_pdl: bool) -> dict:
    # NOTE: only named when on, so a Triton without the option still runs the plain variant.
    return {"launch_pdl": True} if use_pdl else {}


def time_graph_us(chain: Chain, use_pdl: bool, prefetch: bool, reps: int) -> tuple[float, torch.Tensor]:
    """Median microseconds of one replay of the whole chain captured as one CUDA graph
    (kernel_bench.time_ms), and the chain's output after the replays."""
    us = time_ms(lambda: chain.run(use_pdl, prefetch), warmup=2, reps=reps, per_graph=1) * 1e3
    return us, chain.h.clone()


def measure(args) -> list[dict]:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    hidden, inter = (64, 128) if args.tiny else (1024, 4096)
    rows = []
    for m in args.m:
        chain = Chain(args.layers, m, hidden, inter, device, dtype)
        row: dict = {"m": m, "layers": args.layers, "weight_bytes": chain.weight_bytes(), "variants": {}}
        ref = None
        for name, (use_pdl, prefetch) in VARIANTS.items():
            if args.tiny and use_pdl:
                row["variants"][name] = {"skipped": "the interpreter runs no PTX"}
                continue
            try:
                if args.tiny:
                    t = time.perf_counter()
                    out = chain.run(use_pdl, prefetch).clone()
                    us = (time.perf_counter() - t) * 1e6
                else:
                    us, out = time_graph_us(chain, use_pdl, prefetch, args.reps)
            except Exception as e:                                 # report, do not hide
                row["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:400]}
                continue
            ref = out if ref is None else ref
            row["variants"][name] = {"us": us, "us_per_layer": us / args.layers,
                                     "bit_equal_to_plain": bool(torch.equal(out, ref))}
        row["finite"] = ref is not None and bool(torch.isfinite(ref).all())
        if ref is not None:
            want = reference(chain).float()
            row["rel_err_vs_torch"] = float((ref.float() - want).norm() / want.norm())
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--m", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode (Triton interpreter, tiny shapes, no PDL)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "pdl_chain.json"))
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.m = min(args.layers, 2), [min(m, 4) for m in args.m][:2]
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU of compute capability 9.0+ (or --tiny)")
    copy = None if args.tiny else copy_ceiling(quick=True)
    rows = measure(args)
    result = {"device": torch.cuda.get_device_name() if not args.tiny else platform.processor() or "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "tiny": args.tiny,
              "copy_ceiling": copy, "rows": rows}
    write_json(result, args.out)
    print(f"\n{'M':>4} {'floor us/layer':>14}" + "".join(f" {n + ' us/layer':>22} {'x':>6}" for n in VARIANTS))
    for r in rows:
        floor = "-" if copy is None else f"{r['weight_bytes'] / r['layers'] / copy['bytes_per_s'] * 1e6:14.2f}"
        line = f"{r['m']:>4} {floor:>14}"
        base = r["variants"]["plain"].get("us")
        for n in VARIANTS:
            v = r["variants"][n]
            if "us" in v:
                flag = "" if v["bit_equal_to_plain"] else " NE"
                line += f" {v['us_per_layer']:22.2f} {base / v['us']:6.3f}{flag}"
            else:
                line += f" {('ERR' if 'error' in v else 'skip'):>22} {'-':>6}"
        print(line)
    for r in rows:
        for n, v in r["variants"].items():
            if "error" in v:
                print(f"M={r['m']} {n}: {v['error']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
