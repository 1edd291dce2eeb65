"""Sampler benchmark on the GPU: the torch path vs the fused gumbel_sample path.

    python bench/sampling.py [--out bench/results/sampling_h200.json] [--block-sizes 1024,2048,8192]

Qwen3's vocabulary (V = 151,936), every row random at temperature 0.6 (the
throughput benchmark's setting: no top-k/top-p), batches R in {1, 16, 64,
256}, logits in bf16 (what the model computes) and fp32 (what compute_logits
hands over today, after its .float()). For each case:

  torch        Sampler.forward with USE_FUSED_SAMPLING off: logits -> fp32,
               / temperature, softmax, exponential_ noise, probs / q, argmax
  fused        Sampler.forward with USE_FUSED_SAMPLING on: one draw of the
               seed, gumbel_sample (one read of the logits), best block per row
  fused_bNNNN  gumbel_sample alone at another BLOCK_SIZE (the kernel's
               default is vllm_anatomy/kernels/sampling.py BLOCK_SIZE)

Times: "gpu ms" is the median of CUDA-event timings of CUDA-graph replays (10
calls per graph), i.e. device time without the host's launch cost; "eager ms"
times 20 back-to-back eager calls (what the engine pays: the sampler runs
outside CUDA graphs). "GB/s" = the logits' bytes / gpu ms (one read).
Prints a table and writes the JSON (~30 s on an H200, most of it compiling).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch
import triton

import vllm_anatomy.model_executor.sampler as sampler_mod
from vllm_anatomy.kernels.sampling import BLOCK_SIZE, gumbel_sample
from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import time_ms  # noqa: E402  (bench/kernel_bench.py)

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "sampling_h200.json")
VOCAB = 151936
ROWS = (1, 16, 64, 256)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TEMPERATURE = 0.6


def gpu_ms(fn) -> float:
    """Median device time of one fn() call, from CUDA-graph replays (bench/kernel_bench.py's time_ms)."""
    return time_ms(fn)


def eager_ms(fn, calls: int = 20, reps: int = 5) -> float:
    """Median over `reps` of `calls` back-to-back eager calls, per call (host launch cost included)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def sampler_fn(logits: torch.Tensor, fused: bool):
    rows = logits.shape[0]
    md = SamplingMetadata(temperature=torch.full((rows,), TEMPERATURE, device=logits.device),
                          all_greedy=False, all_random=True, top_p=None, top_k=None, min_p=None,
                          generators={}, max_num_logprobs=None)
    sampler = sampler_mod.Sampler()

    def fn():
        sampler_mod.USE_FUSED_SAMPLING = fused
        return sampler(logits, md).sampled_token_ids
    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--block-sizes", default="1024,2048,8192",
                        help="gumbel_sample BLOCK_SIZEs to time besides the default")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "bench/sampling.py needs a CUDA device"
    block_sizes = [int(b) for b in args.block_sizes.split(",") if b and int(b) != BLOCK_SIZE]
    saved = sampler_mod.USE_FUSED_SAMPLING
    torch.manual_seed(0)
    results = []
    print(f"{'dtype':>5} {'R':>4} {'path':>12} {'gpu ms':>8} {'eager ms':>9} {'GB/s':>7}")
    try:
        for dname, dtype in DTYPES.items():
            for rows in ROWS:
                logits = (torch.randn(rows, VOCAB, device="cuda") * 3).to(dtype)
                nbytes = logits.numel() * logits.element_size()
                temp = torch.full((rows,), TEMPERATURE, device="cuda")
                seed = torch.tensor([1], dtype=torch.int64, device="cuda")
                cases = [("torch", sampler_fn(logits, fused=False), None),
                         ("fused", sampler_fn(logits, fused=True), BLOCK_SIZE)]
                cases += [(f"fused_b{b}", (lambda b=b: gumbel_sample(logits, temp, seed, block_size=b)), b)
                          for b in block_sizes]
                for path, fn, block in cases:
                    g, e = gpu_ms(fn), eager_ms(fn)
                    gbps = nbytes / (g * 1e-3) / 1e9
                    results.append({"dtype": dname, "rows": rows, "path": path, "block_size": block,
                                    "gpu_ms": round(g, 5), "eager_ms": round(e, 5), "gbps": round(gbps, 1)})
                    print(f"{dname:>5} {rows:>4} {path:>12} {g:8.4f} {e:9.4f} {gbps:7.0f}")
    finally:
        sampler_mod.USE_FUSED_SAMPLING = saved

    def pick(dname, rows, path):
        return next(r for r in results if r["dtype"] == dname and r["rows"] == rows and r["path"] == path)
    speedup = {f"{d}_R{r}": round(pick(d, r, "torch")["gpu_ms"] / pick(d, r, "fused")["gpu_ms"], 2)
               for d in DTYPES for r in ROWS}
    print("torch / fused gpu time:", speedup)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "host": platform.node(),
                   "torch": torch.__version__, "triton": triton.__version__, "vocab": VOCAB,
                   "temperature": TEMPERATURE, "default_block_size": BLOCK_SIZE,
                   "results": results, "speedup_gpu": speedup}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
