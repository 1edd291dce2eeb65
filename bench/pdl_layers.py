"""PDL on a decode layer's kernel chain, in CUDA graphs, without the engine: GPU time per layer
with VLLM_ANATOMY_PDL's launches (kernels/pdl.py) against the same kernels without, and with
each way of choosing a GEMM the engine has (VLLM_ANATOMY_SKINNY_GEMM = 0, tuned, 1).

    python bench/pdl_layers.py [--ms 1 16 32 64 128 256] [--out bench/results/pdl_layers_h100.json]
    python bench/pdl_layers.py --tiny --out /tmp/pdl_layers.json     # CPU smoke (interpreter, no graphs, no PDL)

Per layer (Qwen3-0.6B's shapes, bf16): fused add + rms_norm -> qkv GEMM -> o GEMM (attention
left out: its input here is the qkv output's first columns) -> fused add + rms_norm -> gate_up
GEMM -> silu_and_mul -> down GEMM. LAYERS layers with their own weights (so W comes from HBM,
not L2, as in the model) are captured into one graph per (M, variant) and replayed; the table
is microseconds per layer, the median of REPEATS timings of ITERS replays. Variants:

    cublas          every GEMM F.linear (SKINNY_GEMM=0); the norms and silu Triton, no PDL
    cublas+pdl      the same, the Triton kernels with PDL (cuBLAS stays an ordinary barrier)
    tuned, tuned+pdl  each GEMM as the engine's default picks it: the split-K kernel where
                    TUNED_CONFIGS holds a config for its (shape, bucket), else F.linear
    skinny, skinny+pdl  as SKINNY_GEMM=1: the split-K kernel (pick_config) for every GEMM but
                    those whose TUNED_CONFIGS row is None (cuBLAS measured faster)

What PDL can save is at kernel boundaries, and a GEMM's weight prefetch only happens in the
split-K kernel, so the question this answers is which GEMM choice wins once PDL is on: the
TUNED_CONFIGS rows were measured per GEMM, alone, without PDL (bench/skinny_gemm.py), where
cuBLAS won most shapes by fractions of a microsecond. Outputs of a variant with and without
PDL must be bit-equal (the run stops otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

H, INTER, Q, KV, LAYERS, ITERS, REPEATS = 1024, 3072, 2048, 1024, 28, 20, 7
VARIANTS = {"cublas": ("0", False), "cublas+pdl": ("0", True), "tuned": ("tuned", False),
            "tuned+pdl": ("tuned", True), "skinny": ("1", False), "skinny+pdl": ("1", True)}


def make_layers(dev: str, dtype: torch.dtype, dims: dict, layers: int) -> list[dict]:
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev) / k ** 0.5).to(dtype)
    h, q, kv, inter = dims["H"], dims["Q"], dims["KV"], dims["INTER"]
    return [dict(norm1=torch.randn(h, device=dev, dtype=dtype), norm2=torch.randn(h, device=dev, dtype=dtype),
                 qkv=w(q + 2 * kv, h), o=w(h, q), gate_up=w(2 * inter, h), down=w(h, inter))
            for _ in range(layers)]


def make_gemm(mode: str, pdl: bool, counters: dict):
    """gemm(name, x, w) as the engine's layer picks it at VLLM_ANATOMY_SKINNY_GEMM=mode
    (layers/utils.py, through the same takes_skinny): F.linear or the split-K kernel."""
    import torch.nn.functional as F

    from vllm_anatomy.kernels.skinny_gemm import skinny_gemm, takes_skinny

    def gemm(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, (n, k) = x.shape[0], w.shape
        if mode != "0" and takes_skinny(m, n, k, x.dtype, tuned_only=mode == "tuned"):   # the engine's choice
            return skinny_gemm(x, w, counters=counters[name], pdl=pdl)
        return F.linear(x, w)
    return gemm


def forward(layers: list[dict], x: torch.Tensor, r: torch.Tensor, gemm, pdl: bool, q: int):
    from vllm_anatomy.kernels.rms_norm import rms_norm
    from vllm_anatomy.kernels.silu_and_mul import silu_and_mul
    for lw in layers:
        h, r = rms_norm(x, lw["norm1"], 1e-6, r, pdl=pdl)
        qkv = gemm("qkv", h, lw["qkv"])
        h = gemm("o", qkv[:, :q], lw["o"])
        h, r = rms_norm(h, lw["norm2"], 1e-6, r, pdl=pdl)
        h = silu_and_mul(gemm("gate_up", h, lw["gate_up"]), pdl=pdl)
        x = gemm("down", h, lw["down"])
    return x, r


def time_graph(graph: torch.cuda.CUDAGraph) -> float:
    """Median microseconds per replay."""
    samples = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ITERS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / ITERS)
    return statistics.median(samples)


def run_variant(layers, x, r, gemm, pdl: bool, q: int, tiny: bool) -> tuple[float, list[torch.Tensor]]:
    """(microseconds per replay, the outputs) of one variant: a CUDA graph's replays, or on the
    CPU one eager pass timed by the host clock."""
    if tiny:
        t = time.perf_counter()
        out = forward(layers, x, r, gemm, pdl, q)
        return (time.perf_counter() - t) * 1e6, [o.clone() for o in out]
    forward(layers, x, r, gemm, pdl, q)                    # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(layers, x, r, gemm, pdl, q)
    graph.replay()
    torch.cuda.synchronize()
    outs = [t.clone() for t in out]
    us = time_graph(graph)
    del graph
    return us, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    ap.add_argument("--out", default="bench/results/pdl_layers.json")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: interpreter, tiny shapes, no PDL variants")
    args = ap.parse_args()
    if not args.tiny and (not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9):
        sys.exit("needs a CUDA device of compute capability >= 9 (PDL), or --tiny")
    from vllm_anatomy.kernels.skinny_gemm import new_counters
    torch.manual_seed(0)
    dev, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    dims = dict(H=32, Q=32, KV=16, INTER=48) if args.tiny else dict(H=H, Q=Q, KV=KV, INTER=INTER)
    num_layers = 2 if args.tiny else LAYERS
    ms = [1, 3] if args.tiny else args.ms
    variants = {k: v for k, v in VARIANTS.items() if not (args.tiny and v[1])}
    layers = make_layers(dev, dtype, dims, num_layers)
    counters = {name: new_counters(n, 256, dev) for name, n in
                (("qkv", dims["Q"] + 2 * dims["KV"]), ("o", dims["H"]), ("gate_up", 2 * dims["INTER"]),
                 ("down", dims["H"]))}
    rows = []
    print(f"{'M':>4}" + "".join(f" {name:>12}" for name in variants) + "   us per layer")
    for m in ms:
        x = torch.randn(m, dims["H"], device=dev, dtype=dtype)
        r = torch.randn(m, dims["H"], device=dev, dtype=dtype)
        row: dict = {"m": m, "us_per_layer": {}, "bit_equal_with_pdl": {}}
        outs = {}
        for name, (mode, pdl) in variants.items():
            us, outs[name] = run_variant(layers, x, r, make_gemm(mode, pdl, counters), pdl, dims["Q"], args.tiny)
            row["us_per_layer"][name] = round(us / num_layers, 2)
        for name in variants:
            if name.endswith("+pdl"):
                base = name[:-len("+pdl")]
                row["bit_equal_with_pdl"][base] = all(torch.equal(a, b) for a, b in zip(outs[base], outs[name]))
        want = outs["cublas"][0].float()
        row["rel_err_vs_cublas"] = {name: float((o[0].float() - want).norm() / want.norm()) for name, o in outs.items()}
        best = min(row["us_per_layer"], key=row["us_per_layer"].get)
        row["best"] = best
        rows.append(row)
        flags = "" if all(row["bit_equal_with_pdl"].values()) else "  PDL CHANGED A RESULT"
        print(f"{m:>4}" + "".join(f" {row['us_per_layer'][name]:12.2f}" for name in variants) + f"   best {best}{flags}",
              flush=True)
    result = {"device": torch.cuda.get_device_name() if not args.tiny else "cpu", "torch": torch.__version__,
              "triton": __import__("triton").__version__, "tiny": args.tiny, "layers": num_layers,
              "variants": {k: {"skinny_gemm": v[0], "pdl": v[1]} for k, v in variants.items()}, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    if not all(all(row["bit_equal_with_pdl"].values()) for row in rows):
        sys.exit("PDL changed a result")


if __name__ == "__main__":
    main()
