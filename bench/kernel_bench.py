"""Kernel benchmark on the GPU: achieved bytes/s and FLOP/s against ceilings measured here.

    python bench/kernel_bench.py [--out bench/results/kernels_h200.json] [--quick]
    python bench/kernel_bench.py --decode-sweep [--out bench/results/decode_split_kv_h200.json] [--quick]
    python bench/kernel_bench.py --decode-mixed [--out bench/results/decode_mixed_h100.json]

Ceilings, measured in the same run: a large device-to-device copy (bytes read
+ bytes written per second) and a large bf16 matmul (FLOP/s), both on random
data. Then, with Qwen3-0.6B attention heads (16 query heads, 8 KV heads,
head_dim 128), bf16, KV block size 16:

  decode attention   256 sequences x context 1024, one query token each;
                     bytes = K and V of every sequence + q + out + block table;
                     target >= 70 % of copy bandwidth.
  reshape_and_cache  32768 new tokens scattered to random slots;
                     bytes = K, V read + written + slot_mapping; target >= 60 %.
  prefill attention  one 4096-token sequence, causal;
                     FLOPs = 4 * heads * head_dim * (visible query-key pairs);
                     target >= 35 % of the matmul rate.

Each attention case sweeps a few block shapes (the kernel's default is
reported too). Times: median of CUDA-event timings of CUDA-graph replays
(10 launches per graph) after warm-up; "eager ms" adds the host launch cost.
Prints a table and writes the JSON. DESIGN.md §8 states the targets.

--decode-sweep measures only the split-KV ("3D") decode path against the 2D
kernel (to choose seq_threshold_3D): decode batches {1, 4, 16, 24, 32, 48, 64, 256}
x context {1k, 4k, 8k} (24-48: where 2D's (KV head, sequence) grid is one ragged
wave on 132 multiprocessors), and three realistic batches (256, 32 and 16 decodes, contexts
uniform in [100, 2048], seeded); 2D with its default shape, 3D with
{8, 16, 32} segments x tile {16, 32, 64} (--quick: 16 segments, tiles 16, 64),
forced whatever the batch size. Bytes = the K/V actually read (sum of
seq_lens) + q + out + block table.

--decode-mixed measures the 2D kernel's decode order (attention/backends/decode_order.py)
on nano-vllm's throughput workload (bench/vs_vllm.py nano_vllm_workload: 256 prompts
and output lengths uniform in [100, 1024]): the decode batches at steps s = 0, 200,
400, 600, 800 (the sequences still running, each at its prompt + s + 1 keys: 256, 218,
153, 101, 59 of them), in the engine's batch order (rows condensed as InputBatch does
when sequences finish), over one paged cache whose blocks of 16 were handed out as the
engine does (each prompt's blocks at its prefill, then one block per sequence whenever
a decode crosses a block boundary: interleaved). Per batch, graph-timed: the kernel's
search path in batch order (VLLM_ANATOMY_DECODE_LPT=0), the ordered path in batch order
(the grid change alone), longest context first (the default) and, as a control, shortest
first (slower than LPT only if blocks start in blockIdx order); ms, fraction of the copy
ceiling, LPT's speed-up over batch order; outputs checked equal. Default JSON:
bench/results/decode_mixed_<card>.json. About a minute on an H100/H200.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys

import numpy as np
import torch
import triton

from vllm_anatomy.attention.backends.decode_order import lpt_order
from vllm_anatomy.kernels.reshape_and_cache import reshape_and_cache
from vllm_anatomy.kernels.unified_attention import (pick_config, unified_attention,
                                                    unified_attention_ref)

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "kernels_h200.json")
DEFAULT_SWEEP_OUT = os.path.join(os.path.dirname(__file__), "results", "decode_split_kv_h200.json")

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DTYPE = torch.bfloat16
TARGETS = {"decode_attention": 0.70, "reshape_and_cache": 0.60, "prefill_attention": 0.35}


def time_ms(fn, warmup: int = 3, reps: int = 15, per_graph: int = 10) -> float:
    """Median over `reps` of the time of one fn() call, from CUDA-graph replays.

    NOTE: fn is captured `per_graph` times into one CUDA graph and the replay
    is timed with CUDA events. Timing eager launches instead would add the
    host's launch cost (tens of microseconds per Triton launch: compare each
    kernel's `ms` with its `eager_ms` in bench/results/kernels_h200.json) to
    kernels that run for little longer than that; the engine replays decode
    steps as CUDA graphs for the same reason.
    """
    for _ in range(warmup):                       # compile, autotune caches, allocator
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_graph)
    del graph
    return statistics.median(times)


def time_eager_ms(fn, warmup: int = 3, reps: int = 15) -> float:
    """Median of event-timed eager calls: includes the host's launch cost (for information)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_ceiling(quick: bool) -> dict:
    n = (1 << 28) if quick else (1 << 30)                          # bf16 elements: 0.5 / 2 GiB
    src = torch.randn(n, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    # NOTE: timed eagerly (a millisecond-scale copy: launch cost is noise, see
    # copy_ceiling in bench/results/kernels_h200.json). Captured in a CUDA graph,
    # a device-to-device copy_ becomes a memcpy node run by the copy engines,
    # which measured well below the eager copy on the H200: not the ceiling.
    ms = time_eager_ms(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    return {"bytes": nbytes, "ms": ms, "bytes_per_s": nbytes / ms * 1e3}


def matmul_ceiling() -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=DTYPE)
    b = torch.randn(n, n, device="cuda", dtype=DTYPE)
    ms = time_eager_ms(lambda: a @ b)
    flops = 2 * n ** 3
    return {"shape": [n, n, n], "ms": ms, "flop_per_s": flops / ms * 1e3}


def paged_batch(requests, seed=0):
    """q, key/value caches (random, every slot), shuffled block table, qsl, seq_lens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + q for c, q in requests]
    blocks_per_seq = [triton.cdiv(s, BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    width = max(blocks_per_seq)
    perm = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    block_table = torch.zeros(len(requests), width, dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[start:start + n]
        start += n
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g,
                        device="cuda", dtype=DTYPE)
    num_tokens = sum(q for _, q in requests)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g, device="cuda", dtype=DTYPE)
    qsl = torch.tensor([0] + list(itertools.accumulate(q for _, q in requests)),
                       dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, cache, block_table, qsl, lens


def attention_case(requests, configs, work_fn, seed=0) -> dict:
    """Time the default config and each config of the sweep; check the best against the reference."""
    q, cache, block_table, qsl, seq_lens = paged_batch(requests, seed)
    out = torch.empty_like(q)
    max_q, max_k = max(r[1] for r in requests), int(seq_lens.max())
    scale = HEAD_DIM ** -0.5

    def launch(cfg):
        return lambda: unified_attention(q, cache[0], cache[1], out, qsl, max_q, seq_lens, max_k,
                                         scale, block_table, **cfg)
    default = pick_config(max_q, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
    results = []
    for cfg in [default] + [c for c in configs if c != default]:
        try:
            ms = time_ms(launch(cfg))
        except Exception as e:                      # e.g. out of shared memory for a shape
            results.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        results.append({"config": cfg, "ms": ms, **work_fn(ms)})
    results[0]["eager_ms"] = time_eager_ms(launch(results[0]["config"]))
    ok = [r for r in results if "ms" in r]
    best = min(ok, key=lambda r: r["ms"])
    # Correctness of what we report: the best config against the torch reference.
    out.fill_(float("nan"))
    launch(best["config"])()
    ref = unified_attention_ref(q, cache[0], cache[1], qsl, seq_lens, scale, block_table)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    return {"default": results[0], "best": best, "sweep": results, "rel_err_vs_ref": err}


def decode_attention(copy_bw: float, quick: bool) -> dict:
    batch, context = 256, 1024
    requests = [(context - 1, 1)] * batch                 # seq_len = 1024, one new token
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    io_bytes = 2 * batch * NUM_HEADS * HEAD_DIM * 2 + batch * (context // BLOCK_SIZE) * 4
    nbytes = kv_bytes + io_bytes

    def work(ms):
        bw = nbytes / ms * 1e3
        return {"bytes": nbytes, "bytes_per_s": bw, "fraction": bw / copy_bw}
    configs = [dict(block_m=16, tile_size=t, num_warps=w, num_stages=s)
               for t, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
    if quick:
        configs = configs[::4]
    return {"shape": {"batch": batch, "context": context}, **attention_case(requests, configs, work)}


def prefill_attention(matmul_rate: float, quick: bool, num_seqs: int = 1) -> dict:
    seq = 4096
    requests = [(0, seq)] * num_seqs
    pairs = num_seqs * seq * (seq + 1) // 2             # causal: visible (query, key) pairs
    flops = 4 * NUM_HEADS * HEAD_DIM * pairs            # QK^T and PV, 2 FLOPs per multiply-add

    def work(ms):
        rate = flops / ms * 1e3
        return {"flops": flops, "flop_per_s": rate, "fraction": rate / matmul_rate}
    configs = [dict(block_m=m, tile_size=t, num_warps=w, num_stages=s)
               for m, t, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
    if quick:
        configs = configs[::4]
    return {"shape": {"num_seqs": num_seqs, "seq_len": seq},
            **attention_case(requests, configs, work)}


def sdpa_prefill(matmul_rate: float) -> dict:
    """For scale: PyTorch's own fused causal attention (dense, not paged) on the same shape."""
    seq = 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, NUM_HEADS, seq, HEAD_DIM, generator=g, device="cuda", dtype=DTYPE)
    k = torch.randn(1, NUM_KV_HEADS, seq, HEAD_DIM, generator=g, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, enable_gqa=True)
    ms = time_ms(fn)
    flops = 4 * NUM_HEADS * HEAD_DIM * seq * (seq + 1) // 2
    return {"ms": ms, "flop_per_s": flops / ms * 1e3, "fraction": flops / ms * 1e3 / matmul_rate}


def reshape_and_cache_case(copy_bw: float, num_tokens: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = triton.cdiv(2 * num_tokens, BLOCK_SIZE)        # cache twice the tokens
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g,
                        device="cuda", dtype=DTYPE)
    # K and V as views into a fused qkv output, as the model hands them over.
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g, device="cuda", dtype=DTYPE)
    key = qkv[:, q_size:q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, q_size + kv_size:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g, device="cuda")[:num_tokens]
    fn = lambda: reshape_and_cache(key, value, cache[0], cache[1], slots)  # noqa: E731
    ms, eager_ms = time_ms(fn), time_eager_ms(fn)
    expected = cache.clone()
    expected[0].flatten(0, 1)[slots] = key
    expected[1].flatten(0, 1)[slots] = value
    assert torch.equal(cache, expected), "reshape_and_cache wrote the wrong slots"
    nbytes = 2 * 2 * num_tokens * kv_size * 2 + num_tokens * 8
    bw = nbytes / ms * 1e3
    return {"num_tokens": num_tokens, "ms": ms, "eager_ms": eager_ms, "bytes": nbytes, "bytes_per_s": bw,
            "fraction": bw / copy_bw}


# -- split-KV ("3D") decode vs 2D --------------------------------------------------------------

SWEEP_BATCHES = (1, 4, 16, 24, 32, 48, 64, 256)
SWEEP_CONTEXTS = (1024, 4096, 8192)
REALISTIC_BATCHES, REALISTIC_CONTEXTS = (256, 32, 16), (100, 2048)   # contexts uniform in [lo, hi]


def split_kv_case(requests, configs_3d, copy_bw: float, segm: dict, seed: int = 0) -> dict:
    """One decode batch: the 2D kernel (default shape) and the 3D kernel per (segments, tile),
    each forced (seq_threshold_3D = the batch size); 3D checked against 2D."""
    q, cache, block_table, qsl, seq_lens = paged_batch(requests, seed)
    batch = len(requests)
    num_keys = int(seq_lens.sum())
    nbytes = (2 * num_keys * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * batch * NUM_HEADS * HEAD_DIM * 2
              + int(sum(triton.cdiv(int(s), BLOCK_SIZE) for s in seq_lens.tolist())) * 4)
    max_k, scale = int(seq_lens.max()), HEAD_DIM ** -0.5
    out2, out3 = torch.empty_like(q), torch.empty_like(q)

    def launch_2d():
        unified_attention(q, cache[0], cache[1], out2, qsl, 1, seq_lens, max_k, scale, block_table)

    def launch_3d(num_segments, tile_size):
        return lambda: unified_attention(
            q, cache[0], cache[1], out3, qsl, 1, seq_lens, max_k, scale, block_table,
            seq_threshold_3D=batch, num_par_softmax_segments=num_segments, tile_size=tile_size,
            softmax_segm_output=segm["output"], softmax_segm_max=segm["max"],
            softmax_segm_expsum=segm["expsum"])

    def stats(ms):
        return {"ms": ms, "bytes_per_s": nbytes / ms * 1e3, "fraction": nbytes / ms * 1e3 / copy_bw}
    res_2d = stats(time_ms(launch_2d))
    launch_2d()
    res_3d = []
    for num_segments, tile_size in configs_3d:
        r = {"num_segments": num_segments, "tile_size": tile_size,
             **stats(time_ms(launch_3d(num_segments, tile_size)))}
        out3.fill_(float("nan"))
        launch_3d(num_segments, tile_size)()
        r["rel_err_vs_2d"] = float((out3.double() - out2.double()).norm() / out2.double().norm())
        res_3d.append(r)
    best = min(res_3d, key=lambda r: r["ms"])
    default_16 = next((r for r in res_3d if r["num_segments"] == 16
                       and r["tile_size"] == pick_config(1, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM,
                                                         use_3d=True)["tile_size"]), best)
    return {"batch": batch, "num_keys": num_keys, "bytes": nbytes, "2d": res_2d, "3d": res_3d,
            "3d_default": default_16, "3d_best": best,
            "speedup_3d_default": res_2d["ms"] / default_16["ms"],
            "speedup_3d_best": res_2d["ms"] / best["ms"]}


def decode_sweep(copy_bw: float, quick: bool) -> dict:
    configs_3d = ([(16, 16), (16, 64)] if quick
                  else list(itertools.product((8, 16, 32), (16, 32, 64))))
    max_segments = max(n for n, _ in configs_3d)
    shape = (max(SWEEP_BATCHES + REALISTIC_BATCHES), NUM_HEADS, max_segments)
    segm = {"output": torch.empty(shape + (HEAD_DIM,), device="cuda", dtype=torch.float32),
            "max": torch.empty(shape, device="cuda", dtype=torch.float32),
            "expsum": torch.empty(shape, device="cuda", dtype=torch.float32)}
    cases = []
    for context in SWEEP_CONTEXTS:
        for batch in SWEEP_BATCHES:
            case = split_kv_case([(context - 1, 1)] * batch, configs_3d, copy_bw, segm)
            cases.append({"context": context, **case})
    realistic = []
    lo, hi = REALISTIC_CONTEXTS
    for batch in REALISTIC_BATCHES:
        g = torch.Generator().manual_seed(batch)
        ctx = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
        realistic.append({"context": f"uniform[{lo}, {hi}]", "seed": batch,
                          **split_kv_case([(c - 1, 1) for c in ctx], configs_3d, copy_bw, segm)})
    return {"configs_3d": configs_3d, "cases": cases, "realistic": realistic}


def print_decode_sweep(sweep: dict) -> None:
    print(f"{'context':>18} {'batch':>5} {'2D ms':>8} {'2D of copy':>10} {'3D16 ms':>8} "
          f"{'best 3D ms':>10} {'(segs, tile)':>12} {'best of copy':>12} {'2D/best3D':>9} {'err':>8}")
    for c in sweep["cases"] + sweep["realistic"]:
        b = c["3d_best"]
        print(f"{c['context']:>18} {c['batch']:5d} {c['2d']['ms']:8.4f} {c['2d']['fraction']:10.1%} "
              f"{c['3d_default']['ms']:8.4f} {b['ms']:10.4f} {str((b['num_segments'], b['tile_size'])):>12} "
              f"{b['fraction']:12.1%} {c['speedup_3d_best']:9.2f} {b['rel_err_vs_2d']:8.1e}")
    for context in SWEEP_CONTEXTS:
        wins = [c["batch"] for c in sweep["cases"] if c["context"] == context and c["speedup_3d_default"] > 1]
        print(f"context {context}: 3D (16 segments, default tile) faster than 2D at batches {wins}")


# -- decode order on the throughput workload's batches (--decode-mixed) --------------------------

MIXED_STEPS = (0, 200, 400, 600, 800)


def decode_mixed_steps(prompt_lens: list[int], output_lens: list[int], steps=MIXED_STEPS,
                       block_size: int = BLOCK_SIZE) -> tuple[list[dict], int]:
    """The decode batches of a workload at the given decode steps, with the engine's block
    allocation and batch order, simulated on the host.

    Decode step s runs the sequences with more than s + 1 output tokens to make (the prefill
    sampled the first), each at seq_len = prompt + s + 1. Blocks: each prompt's in one go,
    requests in order (its prefill), then at every decode step each running sequence, in row
    order, takes the next free block when its new token starts one; a finished sequence's
    blocks are not reused. Rows: request order, and when sequences finish, the last row
    moves into the smallest hole (InputBatch.condense). Returns ([{step, seqs (request
    ids in row order), seq_lens, block_ids (each row's blocks)}], num_blocks)."""
    blocks = []
    next_block = 0
    for p in prompt_lens:
        n = triton.cdiv(p, block_size)
        blocks.append(list(range(next_block, next_block + n)))
        next_block += n
    rows: list[int | None] = list(range(len(prompt_lens)))
    cases = []
    for s in range(max(steps) + 1):
        holes = [r for r, i in enumerate(rows) if i is not None and output_lens[i] <= s + 1]
        for r in holes:
            rows[r] = None
        for hole in holes:                                   # InputBatch.condense
            while rows and rows[-1] is None:
                rows.pop()
            if hole >= len(rows):
                break
            rows[hole] = rows.pop()
        while rows and rows[-1] is None:
            rows.pop()
        live = [i for i in rows if i is not None]
        assert len(live) == len(rows), "decode_mixed_steps: condense left a hole"
        seq_lens = [prompt_lens[i] + s + 1 for i in live]
        for i, n in zip(live, seq_lens):
            if n > len(blocks[i]) * block_size:
                blocks[i].append(next_block)
                next_block += 1
        if s in steps:
            cases.append({"step": s, "seqs": live, "seq_lens": seq_lens,
                          "block_ids": [blocks[i][:triton.cdiv(n, block_size)] for i, n in zip(live, seq_lens)]})
    return cases, next_block


def decode_mixed(copy_bw: float, workload: tuple[list[int], list[int]] | None = None, steps=MIXED_STEPS,
                 device: str = "cuda", timer=time_ms) -> dict:
    """The --decode-mixed measurement. workload: (prompt lengths, output lengths), by default
    nano-vllm's; device / timer: for the test on the interpreter."""
    if workload is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from vs_vllm import nano_vllm_workload
        prompts, output_lens = nano_vllm_workload()
        workload = ([len(p) for p in prompts], output_lens)
    cases, num_blocks = decode_mixed_steps(*workload, steps=steps)
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g, device=device, dtype=DTYPE)
    scale = HEAD_DIM ** -0.5
    results = []
    for case in cases:
        batch, seq_lens_l = len(case["seqs"]), case["seq_lens"]
        width = max(map(len, case["block_ids"]))
        block_table = torch.tensor([b + [0] * (width - len(b)) for b in case["block_ids"]], dtype=torch.int32,
                                   device=device)
        seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32, device=device)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=g, device=device, dtype=DTYPE)
        lpt = torch.tensor(lpt_order(np.array(seq_lens_l)), dtype=torch.int32, device=device)
        orders = {"batch_order": None,
                  "batch_order_no_search": torch.arange(batch, dtype=torch.int32, device=device),
                  "lpt": lpt}
        # The control: shortest first. Slower than LPT only if the hardware starts blocks in
        # blockIdx order, i.e. if the order reaches the multiprocessors at all.
        orders["spt"] = lpt.flip(0)
        outs = {name: torch.empty_like(q) for name in orders}
        nbytes = (2 * sum(seq_lens_l) * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * batch * NUM_HEADS * HEAD_DIM * 2
                  + sum(map(len, case["block_ids"])) * 4)

        def launch(name):
            return lambda: unified_attention(q, cache[0], cache[1], outs[name], qsl, 1, seq_lens, max(seq_lens_l),
                                             scale, block_table, seq_order=orders[name])
        row = {"step": case["step"], "batch": batch, "num_keys": sum(seq_lens_l),
               "min_seq_len": min(seq_lens_l), "max_seq_len": max(seq_lens_l), "bytes": nbytes}
        for name in orders:
            ms = timer(launch(name))
            row[name] = {"ms": ms, "bytes_per_s": nbytes / ms * 1e3, "fraction": nbytes / ms * 1e3 / copy_bw}
        for name in orders:
            launch(name)()
        row["outputs_equal"] = all(torch.equal(outs[name], outs["batch_order"]) for name in orders)
        row["max_abs_diff"] = max(float((outs[name].float() - outs["batch_order"].float()).abs().max())
                                  for name in orders)
        row["speedup_lpt"] = row["batch_order"]["ms"] / row["lpt"]["ms"]
        results.append(row)
    total = {name: sum(r[name]["ms"] for r in results) for name in ("batch_order", "batch_order_no_search", "lpt", "spt")}
    total_bytes = sum(r["bytes"] for r in results)
    summary = {name: {"ms": ms, "fraction": total_bytes / ms * 1e3 / copy_bw} for name, ms in total.items()}
    return {"workload": "nano-vllm bench.py (bench/vs_vllm.py nano_vllm_workload)", "steps": list(steps),
            "num_blocks": num_blocks, "cases": results, "total": summary,
            "speedup_lpt": total["batch_order"] / total["lpt"]}


def print_decode_mixed(res: dict) -> None:
    print(f"{'step':>4} {'batch':>5} {'seq_len':>11} {'batch ms':>9} {'of copy':>7} {'no-search ms':>12} "
          f"{'of copy':>7} {'LPT ms':>8} {'of copy':>7} {'SPT ms':>8} {'speed-up':>8} {'equal':>5}")
    for r in res["cases"]:
        b, n, lpt = r["batch_order"], r["batch_order_no_search"], r["lpt"]
        print(f"{r['step']:4d} {r['batch']:5d} {r['min_seq_len']:5d}-{r['max_seq_len']:<5d} {b['ms']:9.4f} "
              f"{b['fraction']:7.1%} {n['ms']:12.4f} {n['fraction']:7.1%} {lpt['ms']:8.4f} {lpt['fraction']:7.1%} "
              f"{r['spt']['ms']:8.4f} {r['speedup_lpt']:8.3f} {str(r['outputs_equal']):>5}")
    t = res["total"]
    print(f"{'all':>4} {'':>5} {'':>11} {t['batch_order']['ms']:9.4f} {t['batch_order']['fraction']:7.1%} "
          f"{t['batch_order_no_search']['ms']:12.4f} {t['batch_order_no_search']['fraction']:7.1%} "
          f"{t['lpt']['ms']:8.4f} {t['lpt']['fraction']:7.1%} {t['spt']['ms']:8.4f} {res['speedup_lpt']:8.3f}")


def card_name() -> str:
    """h100 / h200 / ... from the device name (for default file names)."""
    name = torch.cuda.get_device_name().lower()
    return next((c for c in ("h100", "h200", "a100", "l40s", "b200") if c in name), "gpu")


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def run_decode_mode(out: str, key: str, measure, show) -> None:
    """One of the decode-only modes (--decode-sweep, --decode-mixed): the copy ceiling, then
    measure(copy bytes/s) under `key` beside the setup, written to `out` and printed by show."""
    copy = copy_ceiling(quick=True)
    res = measure(copy["bytes_per_s"])
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "dtype": str(DTYPE),
              "heads": {"q": NUM_HEADS, "kv": NUM_KV_HEADS, "head_dim": HEAD_DIM},
              "block_size": BLOCK_SIZE, "copy_ceiling": copy, key: res}
    write_json(result, out)
    print(f"\n{result['device']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {copy['bytes_per_s'] / 1e12:.2f} TB/s")
    show(res)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT}, "
                    f"with --decode-sweep {DEFAULT_SWEEP_OUT})")
    ap.add_argument("--quick", action="store_true", help="smaller sweeps and copy")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="only the split-KV (3D) vs 2D decode sweep (see the module docstring)")
    ap.add_argument("--decode-mixed", action="store_true",
                    help="only the 2D decode order on the throughput workload's batches (module docstring)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "bench/kernel_bench.py needs a CUDA device"
    torch.manual_seed(0)
    if args.decode_mixed:
        run_decode_mode(args.out or os.path.join(os.path.dirname(__file__), "results",
                                                 f"decode_mixed_{card_name()}.json"),
                        "decode_mixed", decode_mixed, print_decode_mixed)
        return
    if args.decode_sweep:
        run_decode_mode(args.out or DEFAULT_SWEEP_OUT, "decode_split_kv",
                        lambda copy_bw: decode_sweep(copy_bw, args.quick), print_decode_sweep)
        return
    args.out = args.out or DEFAULT_OUT

    copy = copy_ceiling(args.quick)
    mm = matmul_ceiling()
    copy_bw, mm_rate = copy["bytes_per_s"], mm["flop_per_s"]
    decode = decode_attention(copy_bw, args.quick)
    rac = reshape_and_cache_case(copy_bw, 32768)
    rac_small = reshape_and_cache_case(copy_bw, 256)
    prefill = prefill_attention(mm_rate, args.quick)
    prefill4 = prefill_attention(mm_rate, True, num_seqs=4)
    sdpa = sdpa_prefill(mm_rate)

    rows = [
        ("copy ceiling", copy["ms"], f"{copy_bw / 1e12:.2f} TB/s", "", "", ""),
        ("bf16 matmul ceiling", mm["ms"], f"{mm_rate / 1e12:.0f} TFLOP/s", "", "", ""),
    ]

    def row(name, r, unit_key, target=None):
        val = r[unit_key] / 1e12
        unit = "TB/s" if unit_key == "bytes_per_s" else "TFLOP/s"
        tgt = f">= {target:.0%}" if target else ""
        verdict = ("PASS" if r["fraction"] >= target else "MISS") if target else ""
        rows.append((name, r["ms"], f"{val:.2f} {unit}", f"{r['fraction']:.1%}", tgt, verdict))
    row("decode attn (default cfg)", decode["default"], "bytes_per_s")
    row("decode attn (best cfg)", decode["best"], "bytes_per_s", TARGETS["decode_attention"])
    row("reshape_and_cache 32768 tok", rac, "bytes_per_s", TARGETS["reshape_and_cache"])
    row("reshape_and_cache 256 tok", rac_small, "bytes_per_s")
    row("prefill attn 1x4096 (default)", prefill["default"], "flop_per_s")
    row("prefill attn 1x4096 (best)", prefill["best"], "flop_per_s", TARGETS["prefill_attention"])
    row("prefill attn 4x4096 (best)", prefill4["best"], "flop_per_s")
    row("torch SDPA 1x4096 dense (info)", sdpa, "flop_per_s")

    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "dtype": str(DTYPE), "heads": {"q": NUM_HEADS, "kv": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "block_size": BLOCK_SIZE, "targets": TARGETS,
        "copy_ceiling": copy, "matmul_ceiling": mm,
        "decode_attention": decode, "reshape_and_cache": rac, "reshape_and_cache_256": rac_small,
        "prefill_attention": prefill, "prefill_attention_4x": prefill4, "torch_sdpa_prefill": sdpa,
    }
    write_json(result, args.out)

    print(f"\n{result['device']}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"best decode cfg {decode['best']['config']}  rel err {decode['rel_err_vs_ref']:.2e}")
    print(f"best prefill cfg {prefill['best']['config']}  rel err {prefill['rel_err_vs_ref']:.2e}")
    print(f"decode eager (incl. launch) {decode['default']['eager_ms']:.4f} ms, "
          f"reshape_and_cache 256 tok eager {rac_small['eager_ms']:.4f} ms")
    print(f"{'kernel':34} {'ms':>9} {'achieved':>15} {'of ceil':>8} {'target':>7} ")
    for name, ms, val, frac, tgt, verdict in rows:
        print(f"{name:34} {ms:9.4f} {val:>15} {frac:>8} {tgt:>7} {verdict}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
