"""What tensor parallelism costs and buys: the same workload at TP=1, 2, ..., same run.

    .venv/bin/python bench/tp.py                   # CPU: default model TP=1 vs 3, tiny model TP=1 vs 2
    python bench/tp.py --gpu [--tp 1 2 4 8]        # GPU: the 256-sequence throughput workload

CPU (gloo): the default model (SmolLM2-135M: 9 heads, 3 KV heads) at TP=1 and
TP=3, and a tiny random Llama at TP=1 and TP=2: output tokens/s of one greedy
batch, each rank one thread (OMP_NUM_THREADS=1), TP=1 also with every core.
GPU (NCCL): bench/throughput.py's workload (256 sequences, lengths uniform in
[100, 1024], temperature 0.6, random bf16 weights of the Qwen3-0.6B shape) at
each TP up to the GPU count. TP=1 runs as on one GPU by default (async
scheduling, CUDA graphs) and synchronously; TP>1 synchronously (the mp
executor has no async output thread) with CUDA graphs capturing the NCCL calls.

For every TP > 1 a short extra run at trace level full reads back, on rank 0,
the share of the forward spent in collectives: on the CPU from the host spans
`GroupCoordinator.*` within `GPUModelRunner._model_forward`; on the GPU from
the device-lane spans `GPU.collective.*` within `GPU.model_forward` (an eager
run: a graph replay has no events between its kernels).
The GPU rows also carry each TP size's roofline floor (bench/throughput.py's model with
N GPUs' measured copy and matmul rates) and the fraction of it reached; NVLink
multicast stays off in every process (distributed/utils.py: NO_NVLINK_MULTICAST).
Prints a table and writes JSON (bench/results/tp_cpu.json, tp_h200x<GPUs>.json).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CPU_PROMPTS = ["The quick brown fox jumps over the lazy dog because",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
               "What is the capital of France? The capital of France is",
               "List three prime numbers: 2, 3,", "Once upon a time, in a small village,",
               "The three laws of thermodynamics are"]


def tiny_llama(path: str) -> str:
    """A random Llama small enough that communication is most of a step: 4 layers, hidden 256."""
    import transformers
    from throughput import write_word_tokenizer
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    write_word_tokenizer(path, cfg.vocab_size)
    return path


def run_engine(model: str | None, tp: int, prompts: list, params, threads: int | None = None,
               **engine_kwargs) -> dict:
    """Output tokens/s of one generate() call (engine start and a warm-up request excluded)."""
    from vllm_anatomy import LLM, SamplingParams
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)          # the in-process engine (TP=1); ranks read OMP_NUM_THREADS
    try:
        llm = LLM(model, tensor_parallel_size=tp, **engine_kwargs)
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        if torch.cuda.is_available() and llm.llm_engine.vllm_config.model_config.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        m = llm.get_metrics()
        cfg = llm.llm_engine.vllm_config
        llm.llm_engine.shutdown()
    finally:
        torch.set_num_threads(saved)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tp": tp, "seconds": seconds, "output_tokens": n, "tok_per_s": n / seconds,
            "engine_steps": int(m["vllm_anatomy:engine_steps"]), "threads_per_process": threads or 1,
            "async_scheduling": cfg.scheduler_config.async_scheduling,
            "cudagraph_mode": cfg.compilation_config.cudagraph_mode,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def comm_share(model: str | None, tp: int, prompts: list, params, on_gpu: bool, **engine_kwargs) -> dict:
    """Rank 0's time in collectives over its forward time, from a level-full trace."""
    from vllm_anatomy import LLM
    from vllm_anatomy.tracing.reader import open_run
    with tempfile.TemporaryDirectory() as trace_dir:
        llm = LLM(model, tensor_parallel_size=tp, trace_level="full", trace_dir=trace_dir,
                  enforce_eager=True, **engine_kwargs)
        llm.generate(prompts, params, use_tqdm=False)
        rank0 = llm.llm_engine.engine_core.model_executor.rank_info[0]["pid"]
        llm.llm_engine.shutdown()
        with open_run(glob.glob(os.path.join(trace_dir, "run-*.sqlite"))[0]) as run:
            if on_gpu:
                forward = run.spans("GPU.model_forward", where="pid = ?", args=(rank0,))
                comm = run.spans(where="pid = ? AND name LIKE 'GPU.collective.%'", args=(rank0,))
            else:
                forward = run.spans("GPUModelRunner._model_forward", where="pid = ?", args=(rank0,))
                comm = run.spans(where="pid = ? AND name LIKE 'GroupCoordinator.%'", args=(rank0,))
            steps = run.spans("Worker.execute_model", where="pid = ?", args=(rank0,))
    # NOTE: the forward's collectives only (the logits all-gather follows the forward).
    inside = [c for c in comm if any(f.start_ns <= c.start_ns and c.end_ns <= f.end_ns for f in forward)]
    forward_ns = sum(f.duration_ns for f in forward)
    return {"timing": "cuda_event" if on_gpu else "host", "forward_s": forward_ns / 1e9,
            "collective_s": sum(c.duration_ns for c in inside) / 1e9,
            "collective_ms_per_step": sum(c.duration_ns for c in inside) / 1e6 / max(len(forward), 1),
            "share_of_forward": sum(c.duration_ns for c in inside) / forward_ns if forward_ns else None,
            "num_all_reduce_per_step": max((s.attributes.get("vllm_anatomy.num_all_reduce", 0) for s in steps),
                                           default=0),
            "all_reduce_bytes": sum(s.attributes.get("vllm_anatomy.all_reduce_bytes", 0) for s in steps)}


def _allreduce_rank(rank: int, world_size: int, init_method: str, shape: tuple, iters: int, results) -> None:
    from vllm_anatomy.distributed import parallel_state as ps
    torch.set_num_threads(1)
    ps.init_distributed_environment(world_size, rank, init_method, rank, "gloo")
    ps.initialize_model_parallel(world_size)
    x = torch.ones(shape)
    for _ in range(10):
        ps.get_tp_group().all_reduce(x)
    t = time.perf_counter()
    for _ in range(iters):
        ps.get_tp_group().all_reduce(x)
    if rank == 0:
        results.put((time.perf_counter() - t) / iters)
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def gloo_allreduce_us(world_size: int, shape: tuple, iters: int = 300) -> float:
    """One all-reduce of an fp32 `shape` among `world_size` gloo ranks on this host, in µs
    (what each of a step's 2 x layers + 1 all-reduces costs at least, with nothing else running)."""
    import torch.multiprocessing as mp
    from vllm_anatomy.utils.network_utils import get_distributed_init_method, get_open_port
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = get_distributed_init_method("127.0.0.1", get_open_port())
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world_size, init, shape, iters, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    seconds = results.get(timeout=300)
    for p in procs:
        p.join(60)
    return seconds * 1e6


def best_of(rounds: int, fn) -> dict:
    runs = [fn() for _ in range(rounds)]
    best = max(runs, key=lambda r: r["tok_per_s"])
    return best | {"rounds_tok_per_s": [r["tok_per_s"] for r in runs]}


def cpu(args) -> dict:
    from vllm_anatomy import SamplingParams
    os.environ["OMP_NUM_THREADS"] = "1"           # every rank: one thread (they share the cores)
    cores = os.cpu_count()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("default model (SmolLM2-135M)", None, CPU_PROMPTS, [(1, cores), (1, 1), (3, 1)]),
                 ("tiny Llama (4 layers, hidden 256)", tiny_llama(tmp),
                  [" ".join(f"t{(7 * i + j) % 4096}" for j in range(48)) for i in range(6)], [(1, cores), (1, 1),
                                                                                              (2, 1)])]
        for name, model, prompts, configs in cases:
            for tp, threads in configs:
                r = best_of(args.rounds, lambda: run_engine(model, tp, prompts, params, threads=threads,
                                                            max_model_len=512))
                if tp > 1:
                    r["comm"] = comm_share(model, tp, prompts[:2], params, on_gpu=False, max_model_len=512)
                rows.append({"model": name} | r)
    for group in ({r["model"] for r in rows}):
        one = [r for r in rows if r["model"] == group and r["tp"] == 1]
        for r in rows:
            if r["model"] == group:
                r["same_tokens_as_tp1"] = r["tokens"] == one[0]["tokens"]
                r["vs_tp1_same_threads"] = r["tok_per_s"] / next(o for o in one if o["threads_per_process"] == 1)["tok_per_s"]
    # The floor under each collective: decode-sized ([6 tokens, H]) all-reduces alone.
    latency = {f"tp{tp}_hidden{h}": gloo_allreduce_us(tp, (len(CPU_PROMPTS), h)) for tp, h in ((3, 576), (2, 256))}
    return {"bench": "tp_cpu", "cores": cores, "torch": torch.__version__, "rows": rows,
            "gloo_allreduce_us": latency}


def gpu(args) -> dict:
    from kernel_bench import copy_ceiling, matmul_ceiling  # bench/kernel_bench.py
    from throughput import qwen3_06b_config, roofline, workload, write_random_model  # bench/throughput.py
    from vllm_anatomy import SamplingParams
    from vllm_anatomy.distributed.utils import NO_NVLINK_MULTICAST, disable_nvlink_multicast
    disable_nvlink_multicast()          # every rank inherits it (the shared machines require it)
    count = torch.cuda.device_count()
    sizes = [tp for tp in (args.tp or [1, 2, 4, 8]) if tp <= count]
    prompts, outs = workload(args.num_seqs, args.min_len, args.max_len, qwen3_06b_config().vocab_size)
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]
    short = SamplingParams(temperature=0.6, max_tokens=64, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as path:
        write_random_model(path)
        for tp in sizes:
            modes = [True, False] if tp == 1 else [False]
            for async_scheduling in modes:
                r = run_engine(path, tp, token_prompts, params, max_model_len=4096,
                               async_scheduling=async_scheduling)
                r.pop("tokens")
                if tp > 1:
                    r["comm"] = comm_share(path, tp, token_prompts[:32], short, on_gpu=True, max_model_len=4096)
                rows.append(r)
    base = next(r["tok_per_s"] for r in rows if r["tp"] == 1 and not r["async_scheduling"])
    # The floor of each TP size: bench/throughput.py's roofline with N GPUs' copy and matmul
    # rates (each rank reads 1/N of the weights and of the KV: its heads).
    copy, mm = copy_ceiling(quick=False)["bytes_per_s"], matmul_ceiling()["flop_per_s"]
    for r in rows:
        r["vs_tp1_sync"] = r["tok_per_s"] / base
        floor = roofline(prompts, outs, copy * r["tp"], mm * r["tp"])
        r["floor_tok_per_s"] = floor["floor_tok_per_s"]
        r["fraction_of_floor"] = r["tok_per_s"] / floor["floor_tok_per_s"]
    return {"bench": "tp_gpu", "gpu": torch.cuda.get_device_name(), "gpus": count, "torch": torch.__version__,
            "copy_ceiling_bytes_per_s": copy, "matmul_ceiling_flop_per_s": mm,
            "env": {k: os.environ.get(k) for k in NO_NVLINK_MULTICAST},
            "workload": {"num_seqs": args.num_seqs, "min_len": args.min_len, "max_len": args.max_len,
                         "output_tokens": sum(outs), "prompt_tokens": sum(map(len, prompts))},
            "rows": rows}


def print_table(result: dict) -> None:
    print(f"{'model':36}{'TP':>4}{'threads':>9}{'sched':>7}{'out tok/s':>11}{'vs TP=1':>9}"
          f"{'comm share':>12}{'AR/step':>9}{'comm ms/step':>14}{'of floor':>10}")
    for r in result["rows"]:
        comm = r.get("comm") or {}
        share, per_step, floor = comm.get("share_of_forward"), comm.get("collective_ms_per_step"), \
            r.get("fraction_of_floor")
        print(f"{r.get('model', 'Qwen3-0.6B shape'):36}{r['tp']:>4}{r['threads_per_process']:>9}"
              f"{'async' if r['async_scheduling'] else 'sync':>7}{r['tok_per_s']:>11.1f}"
              f"{r.get('vs_tp1_same_threads', r.get('vs_tp1_sync', 1.0)):>8.2f}x"
              f"{'' if share is None else f'{100 * share:.0f} %':>12}{comm.get('num_all_reduce_per_step', ''):>9}"
              f"{'' if per_step is None else f'{per_step:.3f}':>14}"
              f"{'' if floor is None else f'{100 * floor:.1f} %':>10}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true", help="the GPU workload (NCCL), TP up to the GPU count")
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="GPU: the TP sizes (default 1 2 4 8)")
    ap.add_argument("--max-tokens", type=int, default=32, help="CPU: output tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="CPU: runs per configuration (best is kept)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.gpu and not torch.cuda.is_available():
        sys.exit("bench/tp.py --gpu needs a CUDA device")
    result = gpu(args) if args.gpu else cpu(args)
    result |= {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.machine(),
               "load_avg": os.getloadavg()}
    for r in result["rows"]:
        r.pop("tokens", None)
    print_table(result)
    out = args.out or (f"bench/results/tp_h200x{result['gpus']}.json" if args.gpu else "bench/results/tp_cpu.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
