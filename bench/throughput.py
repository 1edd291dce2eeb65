"""Offline throughput on the GPU: vllm_anatomy vs Hugging Face `generate`, same GPU, same run.

    python bench/throughput.py [--num-seqs 256] [--min-len 100] [--max-len 1024] [--out FILE]

The standard workload (nano-vllm's and mini-sglang's): 256 sequences, input and
output lengths uniform in [100, 1024], random token ids, seed 0, ignore_eos,
temperature 0.6, on a Qwen3-0.6B-shaped model with random bf16 weights. HF runs
the same prompts batched (left padding, sdpa), `min_new_tokens = max_new_tokens`
per length group so it produces exactly the same number of tokens. Our engine
runs as it does by default on a GPU (async scheduling, CUDA graphs), and once
more with synchronous scheduling, for the difference. With --multiprocess, once
more with EngineCore in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, as
vLLM's LLM runs by default): the frontend detokenizes while the engine steps.

It also computes the workload's roofline floor: each decode step reads the
weights once and every active sequence's KV; prefill costs 2 * params FLOPs
per token — against a copy bandwidth and a bf16 matmul rate measured here.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import copy_ceiling, matmul_ceiling  # noqa: E402  (bench/kernel_bench.py)


def qwen3_06b_config(num_hidden_layers: int = 28):
    import transformers
    return transformers.Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=num_hidden_layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=True, dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def smollm2_135m_config(num_hidden_layers: int = 30):
    """The default model's shape (SmolLM2-135M, a LlamaForCausalLM): 9 q heads over 3 KV heads of 64, no q/k norm."""
    import transformers
    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_hidden_layers,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=True, dtype="bfloat16", rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


def write_random_model(path: str, num_hidden_layers: int = 28, cfg=None) -> None:
    """config.json, random bf16 safetensors (transformers' names) and a word-level tokenizer;
    cfg: a transformers config (default: Qwen3-0.6B's shape with num_hidden_layers)."""
    import transformers
    from safetensors.torch import save_file
    cfg = cfg or qwen3_06b_config(num_hidden_layers)
    cfg.save_pretrained(path)
    with torch.device("meta"):
        params = dict(transformers.AutoModelForCausalLM.from_config(cfg).named_parameters())
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for name, p in params.items():
        noise = torch.randn(p.shape, generator=gen, device="cuda")
        w = 1 + 0.1 * noise if p.dim() == 1 else (noise if "embed" in name else noise / p.shape[1] ** 0.5)
        weights[name] = w.to(torch.bfloat16).cpu().contiguous()
    save_file(weights, os.path.join(path, "model.safetensors"))
    write_word_tokenizer(path, cfg.vocab_size)


def write_word_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over `t0` … `t{vocab_size - 1}` (random-weight models need no real one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "unk_token": "t0"}, f)


def workload(n: int, lo: int, hi: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outs


def run_engine(path, prompts, outs, async_scheduling: bool = True, multiprocess: bool = False) -> dict:
    from vllm_anatomy import LLM, SamplingParams
    # The engine process is spawned while LLM() starts, with this environment.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    llm = LLM(path, max_model_len=4096, async_scheduling=async_scheduling)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(r.outputs[0].token_ids) for r in res)
    m = llm.get_metrics()
    steps = int(m["vllm_anatomy:engine_steps"])
    cfg = llm.llm_engine.vllm_config
    llm.llm_engine.shutdown()
    return {"seconds": dt, "output_tokens": n, "tok_per_s": n / dt, "engine_steps": steps,
            "async_scheduling": cfg.scheduler_config.async_scheduling, "multiprocess": multiprocess,
            "attention_backend": cfg.model_config.attention_backend,
            "num_gpu_blocks": cfg.cache_config.num_gpu_blocks, "preemptions": m["vllm:num_preemptions"]}


def run_hf(path, prompts, outs, batch_size: int) -> dict:
    """HF generate, batched: requests grouped by output length so each batch stops together."""
    from transformers import AutoModelForCausalLM
    # (type: ignore: transformers types the decorated classmethod from_pretrained as needing `self`)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()  # type: ignore[call-arg]
    order = sorted(range(len(prompts)), key=lambda i: outs[i])
    total, t = 0, None
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]], device="cuda"), max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in idx], device="cuda")
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx],
                                device="cuda")
            # NOTE: a batch generates max(outs) for every row; only each row's own
            # output length is counted as useful tokens (the rest is HF's padding waste).
            new = max(outs[i] for i in idx)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                           temperature=0.6, top_k=0, pad_token_id=0)
            total += sum(outs[i] for i in idx)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": total, "tok_per_s": total / dt, "batch_size": batch_size}


def roofline(prompts, outs, copy_bw: float, matmul_rate: float) -> dict:
    cfg = qwen3_06b_config()
    h, layers, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    qkv = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    per_layer = qkv + cfg.num_attention_heads * cfg.head_dim * h + 3 * h * cfg.intermediate_size
    params = layers * per_layer + v * h                       # tied embeddings: one matrix
    weight_bytes = 2 * params
    kv_bytes_per_token = layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    # All sequences decode together; step s reads the weights once and the KV of every
    # sequence still running (its prompt plus the s tokens generated so far).
    decode_bytes = 0
    for s in range(max(outs)):
        active = [len(p) + s for p, o in zip(prompts, outs) if o > s]
        decode_bytes += weight_bytes + kv_bytes_per_token * sum(active)
    prefill_flops = 2 * params * sum(len(p) for p in prompts)
    floor_s = decode_bytes / copy_bw + prefill_flops / matmul_rate
    return {"params": params, "weight_bytes": weight_bytes, "decode_bytes": decode_bytes,
            "prefill_flops": prefill_flops, "floor_seconds": floor_s,
            "floor_tok_per_s": sum(outs) / floor_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--hf-batch-size", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-sync", action="store_true", help="skip the synchronous-scheduling engine run")
    ap.add_argument("--multiprocess", action="store_true",
                    help="one more run of ours with EngineCore in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1)")
    ap.add_argument("--out", default="bench/results/throughput_h200.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/throughput.py needs a CUDA device")
    copy = copy_ceiling(quick=False)
    mm = matmul_ceiling()
    prompts, outs = workload(args.num_seqs, args.min_len, args.max_len, qwen3_06b_config().vocab_size)
    with tempfile.TemporaryDirectory() as path:
        write_random_model(path)
        ours = run_engine(path, prompts, outs)            # the default engine: async scheduling
        sync = None if args.skip_sync else run_engine(path, prompts, outs, async_scheduling=False)
        mp = run_engine(path, prompts, outs, multiprocess=True) if args.multiprocess else None
        hf = None if args.skip_hf else run_hf(path, prompts, outs, args.hf_batch_size)
    roof = roofline(prompts, outs, copy["bytes_per_s"], mm["flop_per_s"])
    result = {"bench": "throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "machine": platform.node(),
              "workload": vars(args) | {"output_tokens": sum(outs), "prompt_tokens": sum(map(len, prompts))},
              "copy_ceiling_bytes_per_s": copy["bytes_per_s"], "matmul_ceiling_flop_per_s": mm["flop_per_s"],
              "vllm_anatomy": ours, "vllm_anatomy_sync_scheduling": sync, "vllm_anatomy_mp": mp,
              "hf": hf, "roofline": roof,
              "ratio_vs_hf": ours["tok_per_s"] / hf["tok_per_s"] if hf else None,
              "fraction_of_roofline": ours["tok_per_s"] / roof["floor_tok_per_s"]}
    print(f"{'':24}{'output tok/s':>14}{'seconds':>10}")
    print(f"{'vllm_anatomy':24}{ours['tok_per_s']:>14.0f}{ours['seconds']:>10.1f}")
    if sync:
        print(f"{'  sync scheduling':24}{sync['tok_per_s']:>14.0f}{sync['seconds']:>10.1f}")
    if mp:
        print(f"{'  engine process':24}{mp['tok_per_s']:>14.0f}{mp['seconds']:>10.1f}")
    if hf:
        print(f"{'HF generate':24}{hf['tok_per_s']:>14.0f}{hf['seconds']:>10.1f}")
        print(f"ratio vs HF: {result['ratio_vs_hf']:.2f}x (target >= 15x)")
    print(f"roofline floor: {roof['floor_tok_per_s']:.0f} tok/s ({roof['floor_seconds']:.2f} s); "
          f"ours = {100 * result['fraction_of_roofline']:.1f} % of it (target >= 40 %)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
