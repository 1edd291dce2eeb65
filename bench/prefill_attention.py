"""Prefill attention on the GPU: our prefill kernel's variants vs unified_attention vs torch SDPA.

    python bench/prefill_attention.py --out $OUT/prefill_attention_h100.json [--quick]
    python bench/prefill_attention.py --tiny --out /tmp/p.json      # CPU smoke (Triton interpreter)

Qwen3-0.6B attention heads (16 query heads, 8 KV heads, head_dim 128), bf16,
fresh prefills (causal, no cached context) of 1 x 512, 32 x 512 (a 16k-token
step of short prompts), 1 x 4096, 4 x 4096, 1 x 8192 and 2 x 8192 tokens; q/k/v are views of one qkv tensor, as the model
hands them over. For each case:

  ours      vllm_anatomy/kernels/prefill_attention.py, the default config and the
            named rows of VARIANTS: switches (plain pointer loads, pack_gqa, TMA
            through device-side or host-side descriptors, warp specialisation,
            fold_scale) x block shapes (BLOCK_M, BLOCK_N, warps, stages), host
            descriptors first;
  unified   unified_attention (the engine's default path) on the same prefill,
            its K/V in a paged cache of contiguous blocks (block size 16);
  sdpa      torch.nn.functional.scaled_dot_product_attention per request, on three
            backends: flash (FlashAttention-2 in PyTorch) and cuDNN with K/V repeated to 16
            heads outside the timing (ceilings), and cuDNN on the engine's own layout
            (strided per-request views, GQA by enable_gqa, the output copied back into the
            [tokens, heads, head_dim] buffer: what a wired-in cuDNN path would pay).

FLOPs = 4 * heads * head_dim * (visible query-key pairs); each time is the
median of CUDA-event-timed CUDA-graph replays (bench/kernel_bench.py's time_ms;
eager if a capture fails), reported in ms and as a fraction of a bf16 8192^3
matmul measured in the same run. Every variant's output is checked against the
fp32 torch reference (max abs error; a variant off by > 0.05 is flagged).
Every variant is first launched once on a small prefill (compiling it; those
that fail to compile are listed and skipped); the timed sweep then stops adding
configs after --budget-s seconds (default 120), so the whole run should stay
under 4 minutes on an H100; what was skipped is listed. The JSON is rewritten
after every case (a crash keeps what was measured) and ends with a ranking:
each variant's mean fraction of the matmul rate over the 4k/8k cases and its
speed-up over the default (geometric mean of default ms / variant ms).
Prints a table and writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Any

if "--tiny" in sys.argv:
    # Before any Triton kernel is imported: the interpreter is chosen at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from vllm_anatomy.kernels.prefill_attention import (  # noqa: E402
    block_q_of,
    context_attention_fwd,
    default_config,
    prefill_attention_ref,
    prefill_work_list,
)
from vllm_anatomy.kernels.unified_attention import unified_attention  # noqa: E402

CASES = [(1, 512), (32, 512), (1, 4096), (4, 4096), (1, 8192), (2, 8192)]      # (num_seqs, seq_len)
# (block_m, block_n, num_warps, num_stages)
DEFAULT_SHAPE = (64, 64, 4, 3)
HOST_SHAPES = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 2), (128, 64, 4, 3),
               (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)]
# NOTE: warp specialisation only with 8 warps: with 4, Triton's NVGPUWarpSpecialization pass fails
# on Hopper (Triton 3.6 on the H100, bench/results/prefill_attention_h100.json; 3.9 offline for sm_90).
WS_SHAPES = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)]
# Named rows: (switch name, the switches, its block shapes, its --quick shapes). The tutorial's
# Hopper kernel (triton python/tutorials/06-fused-attention.py) is host descriptors + folded scale
# (+ warp specialisation): those rows come first, so that the time budget never cuts them.
Shape = tuple[int, int, int, int]
VARIANTS: list[tuple[str, dict[str, Any], list[Shape], list[Shape]]] = [
    ("host", dict(tma="host"), HOST_SHAPES, [(64, 64, 4, 3), (128, 64, 4, 2), (128, 128, 8, 3)]),
    ("host+fold", dict(tma="host", fold_scale=True), HOST_SHAPES,
     [(64, 64, 4, 3), (128, 64, 4, 2), (128, 128, 8, 3)]),
    ("host+ws", dict(tma="host", warp_specialize=True), WS_SHAPES, [(128, 128, 8, 3)]),
    ("host+fold+ws", dict(tma="host", fold_scale=True, warp_specialize=True), WS_SHAPES, [(128, 128, 8, 3)]),
    ("tma", dict(tma="device"), [(128, 64, 4, 2), (128, 128, 8, 3)], [(128, 64, 4, 2)]),
    ("tma+fold", dict(tma="device", fold_scale=True), [DEFAULT_SHAPE], [DEFAULT_SHAPE]),
    ("tma+ws", dict(tma="device", warp_specialize=True), [(128, 128, 8, 3)], []),
    ("plain", dict(tma="off"), [DEFAULT_SHAPE, (128, 128, 8, 3)], [DEFAULT_SHAPE]),
    ("pack_gqa", dict(tma="off", pack_gqa=True), [DEFAULT_SHAPE], []),
    ("ws", dict(tma="off", warp_specialize=True), [(128, 128, 8, 3)], []),
]
TINY_SHAPES = [(16, 16, 4, 1)]
LONG_TOKENS = 4096                      # the ranking's cases: a request of >= this many tokens
MAX_ERR = 0.05


class Setup:
    """Heads, dtype, device and timing of a run (the GPU's or the CPU smoke test's)."""

    def __init__(self, tiny: bool):
        self.tiny = tiny
        if tiny:
            self.num_heads, self.num_kv_heads, self.head_dim = 4, 2, 32
            self.dtype, self.device = torch.float32, "cpu"
            self.cases = [(1, 20), (2, 17)]
        else:
            self.num_heads, self.num_kv_heads, self.head_dim = 16, 8, 128
            self.dtype, self.device = torch.bfloat16, "cuda"
            self.cases = CASES

    def time_ms(self, fn) -> tuple[float, str]:
        if self.tiny:
            t0 = time.perf_counter()      # (the caller ran fn once already)
            fn()
            return (time.perf_counter() - t0) * 1e3, "cpu"
        sys.path.insert(0, HERE)
        from kernel_bench import time_eager_ms, time_ms
        try:
            return time_ms(fn), "graph"
        except Exception:                     # e.g. a launch that cannot be captured
            torch.cuda.synchronize()
            return time_eager_ms(fn), "eager"


def matmul_rate(setup: Setup) -> dict:
    if not setup.tiny:
        sys.path.insert(0, HERE)
        from kernel_bench import matmul_ceiling
        return matmul_ceiling()             # kernel_bench's: an 8192^3 bf16 matmul, timed eagerly
    n = 256
    a = torch.randn(n, n, device=setup.device, dtype=setup.dtype)
    b = torch.randn(n, n, device=setup.device, dtype=setup.dtype)
    ms, _ = setup.time_ms(lambda: a @ b)
    return {"shape": [n, n, n], "ms": ms, "flop_per_s": 2 * n ** 3 / ms * 1e3}


def make_case(setup: Setup, num_seqs: int, seq_len: int, seed: int = 0):
    nh, nkv, hd = setup.num_heads, setup.num_kv_heads, setup.head_dim
    num_tokens = num_seqs * seq_len
    g = torch.Generator(device=setup.device).manual_seed(seed)
    qkv = torch.randn(num_tokens, (nh + 2 * nkv) * hd, generator=g, device=setup.device, dtype=setup.dtype)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    starts, lens = [i * seq_len for i in range(num_seqs)], [seq_len] * num_seqs
    return (q.view(num_tokens, nh, hd), k.view(num_tokens, nkv, hd), v.view(num_tokens, nkv, hd),
            starts, lens)


def ours_variants(setup: Setup, quick: bool) -> list[tuple[str, dict]]:
    """("default", {}) then every named row of VARIANTS (tiny: each switch on TINY_SHAPES)."""
    out: list[tuple[str, dict]] = [("default", {})]
    for name, switch, shapes, quick_shapes in VARIANTS:
        for bm, bn, w, s in TINY_SHAPES if setup.tiny else quick_shapes if quick else shapes:
            out.append((f"{name} m{bm} n{bn} w{w} s{s}",
                        dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s, **switch)))
    return out


def run_ours(setup, q, k, v, starts, lens, scale, ref, cfg) -> tuple[float, str, float]:
    """Time one variant (ref None: one launch only, the compile pass)."""
    group = setup.num_heads // setup.num_kv_heads
    merged = dict(default_config(group, setup.head_dim, setup.dtype), **cfg)
    block_q = block_q_of(merged["block_m"], group, merged["pack_gqa"])
    work_list = prefill_work_list(starts, lens, block_q).to(setup.device)
    out = torch.full_like(q, float("nan"))
    fn = lambda: context_attention_fwd(q, k, v, out, None, None, scale, work_list=work_list, **cfg)  # noqa: E731
    fn()
    if ref is None:
        return 0.0, "compile", 0.0
    err = float((out.float() - ref).abs().max())
    ms, how = setup.time_ms(fn)
    return ms, how, err


def run_unified(setup, q, k, v, starts, lens, scale, ref) -> tuple[float, str, float]:
    """The same prefill through unified_attention: K/V in a paged cache of contiguous blocks."""
    block_size = 16
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks)
    cache = torch.zeros(2, num_blocks, block_size, setup.num_kv_heads, setup.head_dim,
                        device=setup.device, dtype=setup.dtype)
    block_table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=setup.device)
    first = 0
    for i, (start, n) in enumerate(zip(starts, lens)):
        flat = cache[:, first:first + blocks[i]].flatten(1, 2)              # [2, blocks * 16, nkv, hd]
        flat[0, :n], flat[1, :n] = k[start:start + n], v[start:start + n]
        block_table[i, :blocks[i]] = torch.arange(first, first + blocks[i], dtype=torch.int32)
        first += blocks[i]
    qsl = torch.tensor([0] + [s + n for s, n in zip(starts, lens)], dtype=torch.int32, device=setup.device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=setup.device)
    out = torch.full_like(q, float("nan"))
    fn = lambda: unified_attention(q, cache[0], cache[1], out, qsl, max(lens), seq_lens,  # noqa: E731
                                   max(lens), scale, block_table)
    fn()
    err = float((out.float() - ref).abs().max())
    ms, how = setup.time_ms(fn)
    return ms, how, err


# The torch SDPA rows: (name, SDPBackend member, K/V handed over as the engine has them).
#   "repeat": K/V repeated to all query heads and made contiguous outside the timing (a ceiling);
#   "views":  the engine's own layout, strided per-request views of q/k/v, GQA by enable_gqa,
#             the output copied back into the [T, heads, head_dim] buffer (what a wired-in path pays).
SDPA_ROWS = [("sdpa_flash", "FLASH_ATTENTION", "repeat"), ("sdpa_cudnn", "CUDNN_ATTENTION", "repeat"),
             ("sdpa_cudnn_views", "CUDNN_ATTENTION", "views")]


def run_sdpa(setup, q, k, v, starts, lens, scale, ref, backend="FLASH_ATTENTION",
             layout="repeat") -> tuple[float, str, float]:
    """torch SDPA per request (causal), on one backend (the GPU's; the CPU smoke test: any)."""
    group = setup.num_heads // setup.num_kv_heads
    per_req = []
    for start, n in zip(starts, lens):
        qq = q[start:start + n].transpose(0, 1).unsqueeze(0)                        # [1, nh, n, hd]
        kk, vv = k[start:start + n], v[start:start + n]                             # [n, nkv, hd]
        if layout == "repeat":
            kk = kk.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0).contiguous()
            vv = vv.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0).contiguous()
        else:
            kk, vv = kk.transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0)  # [1, nkv, n, hd]
        per_req.append((start, n, qq, kk, vv))
    out = torch.full_like(q, float("nan"))
    gqa = layout == "views"

    def fn():
        for start, n, qq, kk, vv in per_req:
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale,
                                                                 enable_gqa=gqa)
            out[start:start + n].copy_(o.squeeze(0).transpose(0, 1))
    if setup.tiny:
        call = fn
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        member = getattr(SDPBackend, backend)

        def call():
            with sdpa_kernel(member):
                fn()
    call()
    err = float((out.float() - ref).abs().max())
    ms, how = setup.time_ms(call)
    return ms, how, err


def compile_variants(setup: Setup, quick: bool) -> dict[str, str]:
    """Launch every variant once on a small prefill, so that compilation is paid
    here, outside the timed sweep's budget. Returns {variant: error} of those
    that do not compile or run (skipped later, their error reported)."""
    q, k, v, starts, lens = make_case(setup, 1, 16 if setup.tiny else 256, seed=1)
    failed = {}
    for name, cfg in ours_variants(setup, quick):
        try:
            run_ours(setup, q, k, v, starts, lens, setup.head_dim ** -0.5, None, cfg)
            if setup.device == "cuda":
                torch.cuda.synchronize()     # a launch error surfaces here, charged to its variant
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return failed


def run_case(setup: Setup, num_seqs: int, seq_len: int, rate: float, quick: bool, deadline: float,
             failed: dict[str, str]) -> dict:
    q, k, v, starts, lens = make_case(setup, num_seqs, seq_len)
    scale = setup.head_dim ** -0.5
    ref = prefill_attention_ref(q.float(), k.float(), v.float(), starts, lens, scale)
    pairs = sum(n * (n + 1) // 2 for n in lens)
    flops = 4 * setup.num_heads * setup.head_dim * pairs

    def entry(name, fn, *args) -> dict[str, Any]:
        try:
            ms, how, err = fn(*args)
        except Exception as e:                      # a config that does not compile here, out of memory
            return {"name": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        return {"name": name, "ms": ms, "timing": how, "tflop_per_s": flops / ms / 1e9,
                "fraction": flops / ms * 1e3 / rate, "max_err": err, "ok": err <= MAX_ERR}

    ours: list[dict[str, Any]] = []
    skipped: list[str] = []
    for name, cfg in ours_variants(setup, quick):
        if name in failed:
            ours.append({"name": name, "config": cfg, "error": failed[name]})
            continue
        if time.monotonic() > deadline and name != "default":
            skipped.append(name)
            continue
        e = entry(name, run_ours, setup, q, k, v, starts, lens, scale, ref, cfg)
        e["config"] = cfg
        ours.append(e)
    unified = entry("unified_attention", run_unified, setup, q, k, v, starts, lens, scale, ref)
    sdpa = [entry(name, run_sdpa, setup, q, k, v, starts, lens, scale, ref, backend, layout)
            for name, backend, layout in SDPA_ROWS]
    timed = [e for e in ours if "ms" in e and e["ok"]]
    best = min(timed, key=lambda e: e["ms"]) if timed else None
    del ref
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    return {"num_seqs": num_seqs, "seq_len": seq_len, "flops": flops, "ours": ours, "skipped": skipped,
            "best": best, "unified": unified, "sdpa": sdpa}


def print_case(case: dict) -> None:
    print(f"\n{case['num_seqs']} x {case['seq_len']}  ({case['flops'] / 1e9:.1f} GFLOP)")
    rows = case["ours"] + [case["unified"], *case["sdpa"]]
    for e in rows:
        if "error" in e:
            print(f"  {e['name']:<30} error: {e['error'][:90]}")
        else:
            flag = "" if e["ok"] else "  WRONG"
            print(f"  {e['name']:<30} {e['ms']:9.3f} ms {e['tflop_per_s']:8.1f} TFLOP/s "
                  f"{100 * e['fraction']:6.1f} % of matmul  err {e['max_err']:.2e} ({e['timing']}){flag}")
    if case["skipped"]:
        print(f"  skipped (time budget): {len(case['skipped'])} configs")


def summarize(cases: list[dict]) -> list[dict]:
    """One row per case: default and best ours, unified, the SDPA rows (fractions and ratios)."""
    summary = []
    print("\nsummary (fraction of the matmul rate; ratio = unified ms / best ours ms, sdpa ms / best ours ms)")
    for c in cases:
        best, uni = c["best"], c["unified"]
        sd = {e["name"]: e for e in c["sdpa"]}
        row = {"case": f"{c['num_seqs']}x{c['seq_len']}",
               "default_ours": next((e.get("fraction") for e in c["ours"] if e["name"] == "default"), None),
               "best_ours": best and best["fraction"], "best_ours_name": best and best["name"],
               "unified": uni.get("fraction"),
               **{name: sd[name].get("fraction") for name, _, _ in SDPA_ROWS},
               "speedup_vs_unified": best and "ms" in uni and uni["ms"] / best["ms"],
               **{f"{name}_over_best_ours": best and "ms" in sd[name] and sd[name]["ms"] / best["ms"]
                  for name, _, _ in SDPA_ROWS}}
        summary.append(row)
        fmt = lambda x: "   -  " if not x else f"{100 * x:5.1f}%"  # noqa: E731
        print(f"  {row['case']:<8} default {fmt(row['default_ours'])}  best {fmt(row['best_ours'])} "
              f"({row['best_ours_name']})  unified {fmt(row['unified'])}  "
              + "  ".join(f"{name[5:]} {fmt(row[name])}" for name, _, _ in SDPA_ROWS))
    return summary


def rank_variants(cases: list[dict], long_tokens: int) -> list[dict]:
    """Variants timed (and correct) on every long case (seq_len >= long_tokens), best first:
    mean fraction of the matmul rate there, and speed-up over the default (geometric mean of
    default ms / variant ms; > 1: faster than the default)."""
    long_cases = [c for c in cases if c["seq_len"] >= long_tokens]
    timed: dict[str, list[tuple[float, float]]] = {}
    for c in long_cases:
        default = next((e for e in c["ours"] if e["name"] == "default" and "ms" in e), None)
        for e in c["ours"]:
            if "ms" in e and e["ok"] and default is not None:
                timed.setdefault(e["name"], []).append((e["fraction"], default["ms"] / e["ms"]))
    rows: list[dict[str, Any]]
    rows = [{"name": name, "mean_fraction": sum(f for f, _ in vals) / len(vals),
             "speedup_vs_default": math.exp(sum(math.log(r) for _, r in vals) / len(vals)),
             "cases": len(vals)}
            for name, vals in timed.items() if len(vals) == len(long_cases)]
    rows.sort(key=lambda r: -r["speedup_vs_default"])
    print(f"\nranking over the {len(long_cases)} cases of >= {long_tokens} tokens per request "
          f"(speed-up over the default, mean fraction of the matmul rate):")
    for r in rows[:15]:
        print(f"  {r['name']:<30} {r['speedup_vs_default']:6.3f}x  {100 * r['mean_fraction']:5.1f} %")
    return rows


def write_result(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prefill_attention.json"))
    ap.add_argument("--quick", action="store_true", help="a few block shapes per switch")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode (Triton interpreter, tiny shapes)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop adding sweep configs after this")
    args = ap.parse_args()
    setup = Setup(args.tiny)
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --tiny for the CPU smoke mode)")
    start = time.monotonic()
    ceiling = matmul_rate(setup)
    rate = ceiling["flop_per_s"]
    print(f"matmul ceiling: {rate / 1e12:.1f} TFLOP/s ({ceiling['shape']})")
    t1 = time.monotonic()
    failed = compile_variants(setup, args.quick)
    print(f"compiled {len(ours_variants(setup, args.quick))} variants in {time.monotonic() - t1:.0f} s; "
          f"{len(failed)} failed: {sorted(failed)}")
    result = {
        "device": torch.cuda.get_device_name() if setup.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": __import__("triton").__version__, "tiny": args.tiny,
        "heads": {"num_heads": setup.num_heads, "num_kv_heads": setup.num_kv_heads, "head_dim": setup.head_dim},
        "dtype": str(setup.dtype), "matmul_ceiling": ceiling, "compile_failed": failed,
        "variants": [{"name": name, "config": cfg} for name, cfg in ours_variants(setup, args.quick)],
        "cases": [], "case_errors": {},
    }
    t0 = time.monotonic()                   # the budget is for timing, not compiling
    # Later cases get an equal share of what is left, so every case is swept somewhat.
    for i, (num_seqs, seq_len) in enumerate(setup.cases):
        left = args.budget_s - (time.monotonic() - t0)
        deadline = time.monotonic() + max(0.0, left / (len(setup.cases) - i))
        try:
            case = run_case(setup, num_seqs, seq_len, rate, args.quick, deadline, failed)
        except Exception as e:              # e.g. out of memory for the reference: the other cases go on
            result["case_errors"][f"{num_seqs}x{seq_len}"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"\n{num_seqs} x {seq_len}: error {result['case_errors'][f'{num_seqs}x{seq_len}']}")
            continue
        print_case(case)
        result["cases"].append(case)
        write_result(args.out, dict(result, wall_s=time.monotonic() - start))   # a crash keeps the cases so far
    result["summary"] = summarize(result["cases"])
    result["ranking"] = rank_variants(result["cases"], 1 if args.tiny else LONG_TOKENS)
    result["wall_s"] = time.monotonic() - start
    write_result(args.out, result)
    print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
