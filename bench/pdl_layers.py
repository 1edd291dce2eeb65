"""PDL on a decode layer's kernel chain, in CUDA graphs, without the engine: GPU time per layer
with VLLM_ANATOMY_PDL's launches (kernels/pdl.py) against the same kernels without.

Per layer (Qwen3-0.6B's shapes, bf16, every GEMM through the split-K kernel with its
pick_config, as VLLM_ANATOMY_SKINNY_GEMM=1 runs it): fused add + rms_norm -> qkv GEMM ->
o GEMM (attention left out: its input here is the qkv output's first columns) -> fused add +
rms_norm -> gate_up GEMM -> silu_and_mul -> down GEMM. LAYERS layers with their own weights
(so W comes from HBM, not L2, as in the model) are captured into one graph per (M, pdl) and
replayed; the table is microseconds per layer, the median of REPEATS timings of ITERS replays.
Each pair's outputs are checked bit-equal first.

    python bench/pdl_layers.py [--ms 1 16 32 64 128 256] [--out bench/results/pdl_layers.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

H, INTER, Q, KV, LAYERS, ITERS, REPEATS = 1024, 3072, 2048, 1024, 28, 20, 7


def make_layers(dev: str) -> list[dict]:
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
    return [dict(norm1=torch.randn(H, device=dev, dtype=torch.bfloat16),
                 norm2=torch.randn(H, device=dev, dtype=torch.bfloat16),
                 qkv=w(Q + 2 * KV, H), o=w(H, Q), gate_up=w(2 * INTER, H), down=w(H, INTER)) for _ in range(LAYERS)]


def forward(layers: list[dict], x: torch.Tensor, r: torch.Tensor, counters: dict, pdl: bool):
    from vllm_anatomy.kernels.rms_norm import rms_norm
    from vllm_anatomy.kernels.silu_and_mul import silu_and_mul
    from vllm_anatomy.kernels.skinny_gemm import skinny_gemm
    for lw in layers:
        h, r = rms_norm(x, lw["norm1"], 1e-6, r, pdl=pdl)
        qkv = skinny_gemm(h, lw["qkv"], counters=counters["qkv"], pdl=pdl)
        h = skinny_gemm(qkv[:, :Q], lw["o"], counters=counters["o"], pdl=pdl)
        h, r = rms_norm(h, lw["norm2"], 1e-6, r, pdl=pdl)
        h = silu_and_mul(skinny_gemm(h, lw["gate_up"], counters=counters["gate_up"], pdl=pdl), pdl=pdl)
        x = skinny_gemm(h, lw["down"], counters=counters["down"], pdl=pdl)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    ap.add_argument("--out", default="bench/results/pdl_layers.json")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("needs a CUDA device of compute capability >= 9 (PDL)")
    from vllm_anatomy.kernels.skinny_gemm import new_counters
    torch.manual_seed(0)
    dev = "cuda"
    layers = make_layers(dev)
    counters = {name: new_counters(n, 256, dev) for name, n in
                (("qkv", Q + 2 * KV), ("o", H), ("gate_up", 2 * INTER), ("down", H))}
    rows = []
    for m in args.ms:
        x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
        r = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
        us, outs = {}, {}
        for pdl in (False, True):
            forward(layers, x, r, counters, pdl)            # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = forward(layers, x, r, counters, pdl)
            graph.replay()
            torch.cuda.synchronize()
            outs[pdl] = [t.clone() for t in out]
            us[pdl] = time_graph(graph) / LAYERS
            del graph
        equal = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
        rows.append({"m": m, "us_per_layer_off": round(us[False], 2), "us_per_layer_pdl": round(us[True], 2),
                     "pdl_over_off": round(us[True] / us[False], 4), "bit_equal": equal})
        print(f"M={m:4d}  off {us[False]:7.2f} us/layer  pdl {us[True]:7.2f}  ratio {us[True] / us[False]:.3f}"
              f"  {'bit-equal' if equal else 'DIFFERENT'}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "layers": LAYERS, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if not all(row["bit_equal"] for row in rows):
        sys.exit("PDL changed a result")


if __name__ == "__main__":
    main()
