"""The two engines side by side: one interface over each one's offline LLM, each run in a
subprocess of its own, and what both need around them (bench/vs_vllm.py, bench/scaling.py).

`Engine` starts vllm_anatomy's LLM or vLLM's (vLLM as ../shared/peers/vllm/ starts it:
random weights by load_format="dummy", no tokenizer, FlashAttention, CUDA graphs,
gpu_memory_utilization 0.9) and times `generate` on token ids. A bench runs each engine
in its own subprocess (`worker_env`, `run_subprocess`), one after the other, so neither
sees the other's GPU memory, and the subprocess prints one `RESULT {json}` line.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# NOTE: the smoke mode cannot measure the ceilings (bench/kernel_bench.py times CUDA
# kernels): its rooflines use these nominal rates, and its JSON says so.
NOMINAL_CPU_CEILINGS = {"bytes_per_s": 1e10, "flop_per_s": 1e11, "nominal": True}


class Engine:
    """The few calls the benches need, over either engine's offline LLM."""

    def __init__(self, kind: str, model_dir: str, trace_level: str = "off", max_model_len: int = 4096):
        self.kind = kind
        t0 = time.perf_counter()
        if kind == "vllm":
            import vllm
            self.version = vllm.__version__
            self.llm = vllm.LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=False,
                                max_model_len=max_model_len, attention_backend="FLASH_ATTN",
                                gpu_memory_utilization=0.9)
            self.extra = {"detokenize": False}
            self.SamplingParams = vllm.SamplingParams
        else:
            import vllm_anatomy
            self.version = getattr(vllm_anatomy, "__version__", "main")
            self.llm = vllm_anatomy.LLM(model_dir, max_model_len=max_model_len, trace_level=trace_level)
            self.extra = {}
            self.SamplingParams = vllm_anatomy.SamplingParams
        self.startup_s = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> tuple[float, int]:
        params = [self.SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, **self.extra)
                  for m in max_tokens]
        synchronize()
        t = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    def settings(self) -> dict:
        cfg = self.llm.llm_engine.vllm_config
        common = {"version": self.version, "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
                  "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
                  "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                  "max_num_seqs": cfg.scheduler_config.max_num_seqs,
                  "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
                  "max_model_len": cfg.model_config.max_model_len}
        if self.kind == "vllm":
            return common | {"attention_backend": "FLASH_ATTN",
                             "cudagraph_mode": str(getattr(cfg.compilation_config, "cudagraph_mode", None)),
                             "compilation_mode": str(getattr(cfg.compilation_config, "mode", None)),
                             "gpu_memory_utilization": 0.9}
        from vllm_anatomy import envs        # the prefill switch as the engine read it (envs.py)
        # NOTE: getattr: an older tree (bench/throughput_ab.py runs exported ones) may
        # predate a switch; it is recorded as None there.
        return common | {"attention_backend": cfg.model_config.attention_backend,
                         "trace_level": cfg.observability_config.trace_level,
                         "prefill_kernel": getattr(envs, "VLLM_ANATOMY_PREFILL_KERNEL", None),
                         "prefill_sdpa_min_len": getattr(envs, "VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN", None),
                         "prefill_min_len": getattr(envs, "VLLM_ANATOMY_PREFILL_MIN_LEN", None)}

    def shutdown(self) -> None:
        if self.kind == "ours":             # (vLLM's engine goes with its process)
            self.llm.llm_engine.shutdown()


def synchronize() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def worker_env(kind: str, vllm_site: str | None, multiprocess: bool | None, tree: str = ROOT) -> dict:
    """The environment of one engine's subprocess. multiprocess: VLLM_ENABLE_V1_MULTIPROCESSING
    set to 1 or 0, or (None) left to the engine's own default; tree: the directory ours
    imports `vllm_anatomy` from (this checkout, or another one: bench/throughput_ab.py)."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if multiprocess is not None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    if kind == "vllm":
        if not vllm_site:
            raise ValueError("worker_env: vLLM's subprocess needs vllm_site (--vllm-site)")
        # As ../shared/peers/vllm/run_on_gpu.sh: the bundle first on the path, no FlashInfer sampler
        # (the slim bundle has no FlashInfer), offline, no telemetry.
        env["PYTHONPATH"] = vllm_site + os.pathsep + env.get("PYTHONPATH", "")
        env.update(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    else:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_subprocess(label: str, cmd: list[str], env: dict, timeout_s: float) -> dict:
    """Run one worker; its `RESULT {json}` line, or {"error": ...} if it failed or ran out of time."""
    print(f"[{time.strftime('%H:%M:%S')}] {label} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    # NOTE: a session of its own, so a timeout ends the worker's children too
    # (vLLM's engine core process holds the GPU memory).
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    sys.stderr.write(err[-3000:])
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    wall = time.perf_counter() - t
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {wall:.0f} s, rc {proc.returncode}", file=sys.stderr, flush=True)
    if not lines:
        return {"error": f"{label} failed (rc {proc.returncode} after {wall:.0f} s)", "stderr_tail": err[-2000:]}
    result = json.loads(lines[-1][len("RESULT "):]) | {"subprocess_seconds": wall}
    if proc.returncode != 0:                   # (its result was complete when printed)
        result["exit"] = f"rc {proc.returncode} after printing its result (e.g. killed at the timeout in shut-down)"
    return result


def write_vllm_config(path: str) -> dict:
    """bench/throughput.py's Qwen3-0.6B config, plus the architecture vLLM picks its model
    class by (our loader goes by model_type): vLLM loads it with load_format="dummy"."""
    from throughput import qwen3_06b_config
    cfg = qwen3_06b_config()
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def write_tiny_model(path: str) -> None:
    """The smoke mode's model: a random 2-layer Qwen3 (vocabulary over the workload's ids
    0 … 10000), its architecture named so vLLM could load it too, a word-level tokenizer."""
    import torch
    import transformers
    from throughput import write_word_tokenizer
    cfg = transformers.Qwen3Config(vocab_size=10240, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=40960, tie_word_embeddings=True)
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    write_word_tokenizer(path, cfg.vocab_size)


def write_models(ours_dir: str, vllm_dir: str, tiny: bool) -> tuple[str, dict | None]:
    """Ours: random weights (or the smoke mode's tiny model); vLLM: the config it loads with
    load_format="dummy" (the tiny model itself in the smoke mode). Returns (vLLM's dir, its config)."""
    if tiny:
        write_tiny_model(ours_dir)
        return ours_dir, None                # its config names the architecture: vLLM could load it
    import torch
    from throughput import write_random_model
    write_random_model(ours_dir)
    torch.cuda.empty_cache()
    return vllm_dir, write_vllm_config(vllm_dir)


def ceilings(tiny: bool) -> tuple[dict, dict]:
    """(copy, matmul) ceilings: measured on the GPU (bench/kernel_bench.py), nominal in the smoke mode."""
    if tiny:
        return NOMINAL_CPU_CEILINGS, NOMINAL_CPU_CEILINGS
    import torch
    from kernel_bench import copy_ceiling, matmul_ceiling          # bench/kernel_bench.py
    copy, mm = copy_ceiling(quick=False), matmul_ceiling()
    torch.cuda.empty_cache()                                   # its buffers, before the engines start
    return copy, mm
