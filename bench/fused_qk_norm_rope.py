"""Qwen3's q_norm + k_norm + RoPE on the GPU: unfused (three Triton launches) vs fused (one).

    python bench/fused_qk_norm_rope.py [--out bench/results/fused_qk_norm_rope_h200.json]
    python bench/fused_qk_norm_rope.py --mode kvcache [--out bench/results/fused_qk_norm_rope_kvcache_h200.json]

Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128, bf16,
positions < 4096) at T = 1, 16, 256 and 4096 tokens, on one packed qkv output:

  unfused   what LlamaAttention does with VLLM_ANATOMY_ENABLE_QK_NORM_ROPE_FUSION=0
            on CUDA: q_norm and k_norm (RMSNorm.forward_cuda, one `_rms_norm_kernel`
            each, on [T, heads, 128] views) then rotary_emb (one
            `_rotary_embedding_kernel`, new q and k tensors);
  fused     vllm_anatomy/kernels/fused_qk_norm_rope.py: one launch, in place on qkv.

Times: `graph_us` = median GPU time per call from CUDA-graph replays (20 calls
per graph; what a decode step pays inside the engine's graphs); `eager_us` =
per call of 50 back-to-back eager calls (adds the host's launch cost, what an
eager prefill step pays). `saved_per_step_us` = (unfused - fused) x 28 layers.
Also checks the fused result against the unfused one (max abs difference, and
the fraction of elements not bit-equal). About 20 s on an H200.

--mode kvcache: the KV-cache write fused in too, at T = 1, 16, 64, 256 (the fusion's
range: compilation/qk_norm_rope_kvcache_fusion.py), same shape, a bf16 paged cache
[2, 2048 blocks, 16, 8, 128] and T distinct random slots (the last one -1, a padding token):

  pair      fused_qk_norm_rope then reshape_and_cache of qkv's k and v columns
            (two launches: what a Qwen3 layer ran before, and still runs above 256 tokens);
  fused     vllm_anatomy/kernels/fused_qk_norm_rope_kvcache.py: one launch.

Same columns (graph_us, eager_us, saved per step over 28 layers), and `bit_equal`:
whether qkv and the whole cache after `fused` equal those after `pair`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from vllm_anatomy.kernels.fused_qk_norm_rope import fused_qk_norm_rope
from vllm_anatomy.model_executor.layers.layernorm import RMSNorm
from vllm_anatomy.model_executor.layers.rotary_embedding import RotaryEmbedding

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import time_ms  # noqa: E402  (bench/kernel_bench.py)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 16, 8, 128, 28
MAX_POSITION, EPS, DTYPE = 4096, 1e-6, torch.bfloat16
TOKENS = [1, 16, 256, 4096]


def graph_us(fn) -> float:
    """Median GPU time of one fn() call in µs, from CUDA-graph replays (bench/kernel_bench.py's time_ms)."""
    return time_ms(fn, per_graph=20) * 1e3


def eager_us(fn, calls: int = 50, reps: int = 5) -> float:
    """Wall time per call of `calls` eager calls back to back (host launch cost included)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


def make_case(num_tokens: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen, device="cuda").mul_(3).to(DTYPE)
    q_norm, k_norm = RMSNorm(HEAD_DIM, EPS).cuda().to(DTYPE), RMSNorm(HEAD_DIM, EPS).cuda().to(DTYPE)
    with torch.no_grad():
        for norm in (q_norm, k_norm):
            norm.weight.copy_(1 + 0.2 * torch.randn(HEAD_DIM, generator=gen, device="cuda"))
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POSITION, 1000000.0, True).cuda()
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen, device="cuda")

    def unfused(src=qkv):
        q, k, _ = src.split([q_size, kv_size, kv_size], dim=-1)
        q = q_norm.forward_cuda(q.view(num_tokens, NUM_HEADS, HEAD_DIM))
        k = k_norm.forward_cuda(k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM))
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
        return rope.forward_cuda(positions, q.view(num_tokens, q_size), k.view(num_tokens, kv_size))

    def fused(dst=qkv):
        fused_qk_norm_rope(dst, NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS, HEAD_DIM, EPS, q_norm.weight,
                           k_norm.weight, rope.cos_sin_cache, True, positions)

    # Correctness on a fresh copy (the timing loops below rewrite qkv in place).
    ref_q, ref_k = unfused()
    out = qkv.clone()
    fused(out)
    got = torch.cat([out[:, :q_size], out[:, q_size:q_size + kv_size]], dim=-1)
    ref = torch.cat([ref_q, ref_k], dim=-1)
    check = {"max_abs_diff": float((got.float() - ref.float()).abs().max()),
             "frac_not_bit_equal": float((got != ref).float().mean()),
             "max_abs_ref": float(ref.float().abs().max())}
    return unfused, fused, check


def timed_row(num_tokens: int, base_name: str, base, base_launches: int, fused, **extra) -> dict:
    """Both timings of `base` (the unfused launches) and `fused` (one launch), and the per-step saving."""
    row = {"num_tokens": num_tokens,
           f"{base_name}_graph_us": graph_us(base), "fused_graph_us": graph_us(fused),
           f"{base_name}_eager_us": eager_us(base), "fused_eager_us": eager_us(fused),
           f"launches_{base_name}": base_launches, "launches_fused": 1, **extra}
    row["graph_speedup"] = row[f"{base_name}_graph_us"] / row["fused_graph_us"]
    for how in ("graph", "eager"):
        row[f"saved_per_step_us_{how}"] = NUM_LAYERS * (row[f"{base_name}_{how}_us"] - row[f"fused_{how}_us"])
    return row


KVCACHE_TOKENS = [1, 16, 64, 256]
NUM_BLOCKS, BLOCK_SIZE = 2048, 16


def make_kvcache_case(num_tokens: int, seed: int = 0, device: str = "cuda", num_blocks: int = NUM_BLOCKS,
                      dtype: torch.dtype = DTYPE):
    """(pair, fused, bit_equal): the two paths on one qkv, positions, cache and slots
    (device "cpu", fp32, with TRITON_INTERPRET=1: the CPU smoke test)."""
    from vllm_anatomy.kernels.fused_qk_norm_rope_kvcache import (
        fused_qk_norm_rope_kvcache,
        fused_qk_norm_rope_kvcache_ref,
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(num_tokens, width, generator=gen, device=device).mul_(3).to(dtype)
    q_weight = (1 + 0.2 * torch.randn(HEAD_DIM, generator=gen, device=device)).to(dtype)
    k_weight = (1 + 0.2 * torch.randn(HEAD_DIM, generator=gen, device=device)).to(dtype)
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POSITION, 1000000.0, True).to(device)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen, device=device)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen,
                        device=device).to(dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=device)[:num_tokens]
    slots[-1] = -1

    def run(fn, dst=qkv, kv=cache):
        fn(dst, NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS, HEAD_DIM, EPS, q_weight, k_weight,
           rope.cos_sin_cache, True, positions, kv[0], kv[1], slots)

    outs = []
    for fn in (fused_qk_norm_rope_kvcache_ref, fused_qk_norm_rope_kvcache):
        dst, kv = qkv.clone(), cache.clone()
        run(fn, dst, kv)
        outs.append((dst, kv))
    bit_equal = torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    return (lambda: run(fused_qk_norm_rope_kvcache_ref)), (lambda: run(fused_qk_norm_rope_kvcache)), bit_equal


def kvcache_main(out: str) -> None:
    rows = []
    with torch.inference_mode():
        for num_tokens in KVCACHE_TOKENS:
            pair, fused, bit_equal = make_kvcache_case(num_tokens)
            rows.append(timed_row(num_tokens, "pair", pair, 2, fused, bit_equal=bit_equal))
    print(f"{'T':>5} {'pair graph us':>14} {'fused graph us':>15} {'x':>6} {'pair eager us':>14} "
          f"{'fused eager us':>15} {'saved/step us (graph)':>22} {'saved/step us (eager)':>22} {'bit-equal':>10}")
    for r in rows:
        print(f"{r['num_tokens']:>5} {r['pair_graph_us']:>14.2f} {r['fused_graph_us']:>15.2f} "
              f"{r['graph_speedup']:>6.2f} {r['pair_eager_us']:>14.2f} {r['fused_eager_us']:>15.2f} "
              f"{r['saved_per_step_us_graph']:>22.1f} {r['saved_per_step_us_eager']:>22.1f} {str(r['bit_equal']):>10}")
    write_result(out, {
        "what": "Qwen3 q/k norm + RoPE + KV-cache write: fused_qk_norm_rope + reshape_and_cache (2 launches) "
                "vs fused_qk_norm_rope_kvcache (1)",
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": str(DTYPE), "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
                  "num_layers_for_per_step": NUM_LAYERS},
        "rows": rows})


def write_result(out: str, result: dict) -> None:
    result.update(device=torch.cuda.get_device_name(), torch=torch.__version__, host=platform.node())
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["qk_norm_rope", "kvcache"], default="qk_norm_rope",
                        help="kvcache: the KV-cache write fused in too (see the docstring)")
    parser.add_argument("--out", default=None, help="default: bench/results/fused_qk_norm_rope[_kvcache]_h200.json")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    if args.mode == "kvcache":
        kvcache_main(args.out or "bench/results/fused_qk_norm_rope_kvcache_h200.json")
        return
    rows = []
    with torch.inference_mode():
        for num_tokens in TOKENS:
            unfused, fused, check = make_case(num_tokens)
            rows.append(timed_row(num_tokens, "unfused", unfused, 3, fused, **check))
    print(f"{'T':>5} {'unfused graph us':>17} {'fused graph us':>15} {'x':>6} {'unfused eager us':>17} "
          f"{'fused eager us':>15} {'saved/step us (graph)':>22} {'max|diff|':>10} {'!=bits':>8}")
    for r in rows:
        print(f"{r['num_tokens']:>5} {r['unfused_graph_us']:>17.2f} {r['fused_graph_us']:>15.2f} "
              f"{r['graph_speedup']:>6.2f} {r['unfused_eager_us']:>17.2f} {r['fused_eager_us']:>15.2f} "
              f"{r['saved_per_step_us_graph']:>22.1f} {r['max_abs_diff']:>10.3g} "
              f"{r['frac_not_bit_equal']:>8.2%}")
    write_result(args.out or "bench/results/fused_qk_norm_rope_h200.json", {
        "what": "Qwen3 q_norm + k_norm + RoPE: unfused (3 Triton launches) vs fused_qk_norm_rope (1)",
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": str(DTYPE), "num_layers_for_per_step": NUM_LAYERS},
        "rows": rows})


if __name__ == "__main__":
    main()
