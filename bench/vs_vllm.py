"""vllm_anatomy vs vLLM itself, side by side on one GPU, in one run.

    python bench/vs_vllm.py --vllm-site /tmp/vllm-site [--out bench/results/vs_vllm_h200.json]
                            [--skip-latency] [--skip-spans]

`--vllm-site` is a directory holding an importable vLLM (the slim 0.26.0 bundle of
../shared/peers/vllm/, unpacked; see that README for how it reaches a GPU machine
without network). Each engine runs in its own subprocess, one after the other, so
neither sees the other's GPU memory:

    ours (default settings: async scheduling, CUDA graphs, trace level off)
    vLLM (torch.compile, FlashAttention 3, its default CUDA graphs, async scheduling)
    ours again at --trace-level spans (unless --skip-spans)

Throughput is nano-vllm's bench.py workload exactly: `random.seed(0)`, 256 sequences,
for each one a length uniform in [100, 1024] then that many ids uniform in
[0, 10000], then the 256 output lengths, uniform in [100, 1024] (133,966 output
tokens); temperature 0.6, ignore_eos, a Qwen3-0.6B-shaped model with random bf16
weights, max_model_len 4096. (bench/throughput.py draws ids over the whole vocabulary,
so its workload is a different one: 138,985 output tokens.)

Latency, measured the same way for both engines, through the offline `LLM.generate`:
- decode step time at batch B: B prompts of 32 tokens generate 64 and then 320
  tokens each (greedy, ignore_eos); (t320 - t64) / 256 is the steady-state time of one
  decode step — start-up of the request, prefill and the output path cancel out.
- time to first token: one 1,024-token prompt, max_tokens=1, median of 5 calls.
- start-up: LLM(...) constructed and ready (ours has no torch.compile to pay for).

The roofline floor comes from bench/throughput.py's model with the copy and matmul
rates measured here. Prints a table and writes JSON whose top level carries
`ratio_vs_vllm` (ours / vLLM output tok/s) and `fraction_of_roofline` (ours).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DECODE_BATCHES = (1, 16, 64, 256)


def nano_vllm_workload() -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py draw, call for call (random.seed(0), then randint)."""
    rng = random.Random(0)          # the same stream as the module-level random after seed(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    max_tokens = [rng.randint(100, 1024) for _ in range(256)]
    return prompts, max_tokens


# ---------------------------------------------------------------------------- the worker (one engine)

class Engine:
    """The few calls the bench needs, over either engine's offline LLM."""

    def __init__(self, kind: str, model_dir: str, trace_level: str):
        self.kind = kind
        t0 = time.perf_counter()
        if kind == "vllm":
            import vllm
            from vllm import LLM, SamplingParams
            self.version = vllm.__version__
            self.llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=False,
                           max_model_len=4096, attention_backend="FLASH_ATTN", gpu_memory_utilization=0.9)
            self.extra = {"detokenize": False}
        else:
            import vllm_anatomy
            from vllm_anatomy import LLM, SamplingParams
            self.version = getattr(vllm_anatomy, "__version__", "main")
            self.llm = LLM(model_dir, max_model_len=4096, trace_level=trace_level)
            self.extra = {}
        self.SamplingParams = SamplingParams
        self.startup_s = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> tuple[float, int]:
        import torch
        params = [self.SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, **self.extra)
                  for m in max_tokens]
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    def settings(self) -> dict:
        if self.kind == "vllm":
            cfg = self.llm.llm_engine.vllm_config
            return {"version": self.version, "attention_backend": "FLASH_ATTN",
                    "cudagraph_mode": str(getattr(cfg.compilation_config, "cudagraph_mode", None)),
                    "compilation_mode": str(getattr(cfg.compilation_config, "mode", None)),
                    "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
                    "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                    "max_num_seqs": cfg.scheduler_config.max_num_seqs,
                    "num_gpu_blocks": cfg.cache_config.num_gpu_blocks, "gpu_memory_utilization": 0.9}
        cfg = self.llm.llm_engine.vllm_config
        return {"version": self.version, "attention_backend": cfg.model_config.attention_backend,
                "async_scheduling": cfg.scheduler_config.async_scheduling,
                "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                "max_num_seqs": cfg.scheduler_config.max_num_seqs,
                "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
                "trace_level": cfg.observability_config.trace_level}


def run_worker(kind: str, model_dir: str, trace_level: str, latency: bool) -> dict:
    engine = Engine(kind, model_dir, trace_level)
    prompts, max_tokens = nano_vllm_workload()
    engine.generate([list(range(1, 9))], [16], 0.0)                     # warm-up, as nano-vllm's bench
    seconds, generated = engine.generate(prompts, max_tokens, 0.6)
    result = {"engine": kind, "startup_seconds": engine.startup_s, "settings": engine.settings(),
              "throughput": {"seconds": seconds, "output_tokens": generated, "tok_per_s": generated / seconds}}
    if latency:
        rng = random.Random(1)
        decode = {}
        for batch in DECODE_BATCHES:
            short = [[rng.randint(0, 10000) for _ in range(32)] for _ in range(batch)]
            t_short, _ = engine.generate(short, [64] * batch, 0.0)
            t_long, _ = engine.generate(short, [320] * batch, 0.0)
            decode[str(batch)] = 1e3 * (t_long - t_short) / 256
        long_prompt = [rng.randint(0, 10000) for _ in range(1024)]
        ttft = [engine.generate([long_prompt], [1], 0.0)[0] for _ in range(6)][1:]
        result["decode_step_ms"] = decode
        result["ttft_ms_1024"] = 1e3 * statistics.median(ttft)
    return result


# ---------------------------------------------------------------------------- the driver

def spawn(kind: str, model_dir: str, trace_level: str, latency: bool, vllm_site: str | None) -> dict:
    env = dict(os.environ)
    if kind == "vllm":
        # As ../shared/peers/vllm/run_on_gpu.sh: the bundle first on the path, no FlashInfer sampler
        # (the slim bundle has no FlashInfer), offline, no telemetry.
        env["PYTHONPATH"] = vllm_site + os.pathsep + env.get("PYTHONPATH", "")
        env.update(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    else:
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--model-dir", model_dir,
           "--trace-level", trace_level] + ([] if latency else ["--skip-latency"])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-3000:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} worker failed (rc {proc.returncode}); see stderr above")
    return json.loads(lines[-1][len("RESULT "):])


def write_vllm_config(path: str) -> None:
    cfg = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
           "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
           "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
           "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
           "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-site", help="directory with an importable vLLM (the slim bundle, unpacked)")
    ap.add_argument("--out", default="bench/results/vs_vllm_h200.json")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-spans", action="store_true", help="skip our run at --trace-level spans")
    ap.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--trace-level", default="off", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args.worker, args.model_dir, args.trace_level,
                                                not args.skip_latency)), flush=True)
        return
    if not args.vllm_site:
        sys.exit("--vllm-site is required (see ../shared/peers/vllm/README.md)")
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench/vs_vllm.py needs a CUDA device")
    sys.path.insert(0, HERE)
    from kernels import copy_ceiling, matmul_ceiling          # bench/kernels.py
    from throughput import roofline, write_random_model        # bench/throughput.py

    prompts, outs = nano_vllm_workload()
    latency = not args.skip_latency
    with tempfile.TemporaryDirectory() as ours_dir, tempfile.TemporaryDirectory() as vllm_dir:
        write_random_model(ours_dir)
        torch.cuda.empty_cache()
        write_vllm_config(vllm_dir)
        ours = spawn("ours", ours_dir, "off", latency, None)
        theirs = spawn("vllm", vllm_dir, "off", latency, args.vllm_site)
        spans = None if args.skip_spans else spawn("ours", ours_dir, "spans", False, None)
    copy, mm = copy_ceiling(quick=False), matmul_ceiling()
    roof = roofline(prompts, outs, copy["bytes_per_s"], mm["flop_per_s"])
    ours_tps, vllm_tps = ours["throughput"]["tok_per_s"], theirs["throughput"]["tok_per_s"]
    result = {
        "bench": "vs_vllm", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "machine": platform.node(),
        "ratio_vs_vllm": ours_tps / vllm_tps,
        "fraction_of_roofline": ours_tps / roof["floor_tok_per_s"],
        "vllm_fraction_of_roofline": vllm_tps / roof["floor_tok_per_s"],
        "ratio_vs_vllm_trace_spans": spans["throughput"]["tok_per_s"] / vllm_tps if spans else None,
        "workload": {"name": "nano-vllm bench.py", "num_seqs": 256, "output_tokens": sum(outs),
                     "prompt_tokens": sum(map(len, prompts)), "temperature": 0.6, "ignore_eos": True,
                     "model": "Qwen3-0.6B shape, random bf16 weights", "max_model_len": 4096},
        "copy_ceiling_bytes_per_s": copy["bytes_per_s"], "matmul_ceiling_flop_per_s": mm["flop_per_s"],
        "roofline": roof, "vllm_anatomy": ours, "vllm": theirs, "vllm_anatomy_trace_spans": spans,
    }
    rows = [("vllm_anatomy", ours), ("vLLM " + theirs["settings"]["version"], theirs)]
    if spans:
        rows.append(("vllm_anatomy spans", spans))
    print(f"{'':24}{'output tok/s':>14}{'seconds':>10}{'start-up s':>12}")
    for name, r in rows:
        t = r["throughput"]
        print(f"{name:24}{t['tok_per_s']:>14.0f}{t['seconds']:>10.2f}{r['startup_seconds']:>12.1f}")
    print(f"{'roofline floor':24}{roof['floor_tok_per_s']:>14.0f}{roof['floor_seconds']:>10.2f}")
    print(f"ratio vs vLLM: {result['ratio_vs_vllm']:.3f}x (target >= 1.10); "
          f"ours at {100 * result['fraction_of_roofline']:.1f} % of the floor (target >= 80 %), "
          f"vLLM at {100 * result['vllm_fraction_of_roofline']:.1f} %")
    if latency:
        print(f"{'decode step ms':24}" + "".join(f"{'B=' + str(b):>10}" for b in DECODE_BATCHES) + f"{'TTFT 1k':>10}")
        for name, r in rows[:2]:
            print(f"{name:24}" + "".join(f"{r['decode_step_ms'][str(b)]:>10.2f}" for b in DECODE_BATCHES)
                  + f"{r['ttft_ms_1024']:>10.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
