"""bench/vs_vllm.py, bench/scaling.py, bench/plot_scaling.py and bench/side_by_side.py on the CPU.

Their real runs need an H200 and vLLM; here: the pieces (GPU-activity accounting of
a profiler trace, the per-step floor, vLLM's config, the workloads, the plot) and,
marked slow, each driver end to end in its `--tiny` smoke mode, with
tests/bench/fake_vllm standing in for vLLM.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
FAKE_VLLM = os.path.join(ROOT, "tests", "bench", "fake_vllm")
BENCH_MODULES = ("vs_vllm", "scaling", "plot_scaling", "side_by_side", "throughput", "kernel_bench", "gpu_breakdown")


@pytest.fixture(scope="module")
def bench():
    """The bench scripts as modules, with bench/ on sys.path only while this file's tests run
    (the path and the modules are taken away again afterwards)."""
    saved_path = list(sys.path)
    saved_modules = {name: sys.modules.pop(name) for name in BENCH_MODULES if name in sys.modules}
    sys.path.insert(0, BENCH)
    try:
        import gpu_breakdown
        import plot_scaling
        import scaling
        import side_by_side
        import vs_vllm
        yield types.SimpleNamespace(vs_vllm=vs_vllm, scaling=scaling, plot_scaling=plot_scaling,
                                    side_by_side=side_by_side, gpu_breakdown=gpu_breakdown)
    finally:
        sys.path[:] = saved_path
        for name in BENCH_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved_modules)


@pytest.mark.fast
def test_gpu_activity_counts_overlapping_work_once(bench):
    events = [
        {"ph": "X", "cat": "kernel", "ts": 100.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "ts": 105.0, "dur": 10.0},      # overlaps the first (another stream)
        {"ph": "X", "cat": "gpu_memcpy", "ts": 130.0, "dur": 5.0},
        {"ph": "X", "cat": "gpu_memset", "ts": 134.0, "dur": 2.0},
        {"ph": "X", "cat": "cuda_runtime", "ts": 90.0, "dur": 100.0},  # host side: not GPU time
        {"ph": "i", "cat": "kernel", "ts": 500.0},                    # not a complete event
    ]
    got = bench.vs_vllm.gpu_activity(events)
    assert got == {"busy_us": 15.0 + 6.0, "kernel_sum_us": 20.0, "num_kernels": 2, "span_us": 36.0}
    assert bench.vs_vllm.gpu_activity([]) == {"busy_us": 0.0, "kernel_sum_us": 0, "num_kernels": 0, "span_us": 0.0}


@pytest.mark.fast
def test_step_floor_is_weights_plus_live_kv_at_the_copy_rate(bench):
    plan, copy_bw = bench.vs_vllm.FULL, 4e12
    weight_bytes = 2 * 595_984_384                       # Qwen3-0.6B, tied embeddings
    kv_per_token = 28 * 2 * 8 * 128 * 2                  # layers x (K, V) x KV heads x head_dim x bf16
    short, long = plan.window
    mean_context = plan.decode_prompt_len + (short + long - 1) / 2   # steps short .. long-1
    for batch in (64, 256):
        want = 1e3 * (weight_bytes + kv_per_token * batch * mean_context) / copy_bw
        assert bench.vs_vllm.step_floor_ms(batch, plan, copy_bw, 1e15) == pytest.approx(want)


@pytest.mark.fast
def test_vllm_config_is_throughputs_model_with_its_architecture(bench, tmp_path):
    cfg = bench.side_by_side.write_vllm_config(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    # the fields that shape the model, as the hand-written config vLLM ran with had them
    assert {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                                "rms_norm_eps", "max_position_embeddings")} == {
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960}
    assert (cfg.get("dtype") or cfg.get("torch_dtype")) == "bfloat16"
    assert (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta")) == 1e6


@pytest.mark.fast
def test_workloads(bench):
    prompts, outs = bench.vs_vllm.nano_vllm_workload()
    assert (len(prompts), sum(outs), sum(map(len, prompts))) == (256, 133_966, 142_827)
    tiny_prompts, tiny_outs = bench.vs_vllm.nano_vllm_workload(bench.vs_vllm.TINY)
    assert [p[:10] for p in tiny_prompts] == [p[:10] for p in prompts[:4]]
    assert max(map(len, tiny_prompts)) <= 48 and max(tiny_outs) <= 8
    plan = bench.scaling.FULL
    assert plan.max_model_len == 8192 + 128
    assert [p["num_seqs"] for p in plan.points("num_seqs")] == [1, 4, 16, 64, 256, 1024]
    assert {(p["num_seqs"], p["output_len"]) for p in plan.points("context")} == {(64, 128)}


def synthetic_scaling_result(bench) -> dict:
    scaling = bench.scaling
    plan = scaling.TINY
    result = {"gpu": None, "model": "synthetic", "smoke": True, "series": {s: plan.points(s) for s in scaling.SERIES},
              "floor": scaling.floors(plan, 1e10, 1e11)}
    for key, fraction in (("vllm_anatomy", 0.5), ("vllm", 0.4)):
        engine = {"settings": {"version": "x"}}
        for s in scaling.SERIES:
            engine[s] = [p | {"tok_per_s": fraction * f["floor_tok_per_s"]}
                         for p, f in zip(plan.points(s), result["floor"][s])]
        scaling.add_fraction_of_floor(engine, result["floor"])
        result[key] = engine
    result["vllm"] = {"error": "failed"}          # a failed engine is left out of the plot
    return result


@pytest.mark.fast
def test_fraction_of_floor_and_plot(bench, tmp_path):
    result = synthetic_scaling_result(bench)
    fractions = [p["fraction_of_floor"] for s in ("num_seqs", "context") for p in result["vllm_anatomy"][s]]
    assert fractions == pytest.approx([0.5] * 4)
    pytest.importorskip("matplotlib")
    out = tmp_path / "scaling.png"
    bench.plot_scaling.plot(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_bench(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
    proc = subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_vs_vllm_tiny_end_to_end(tmp_path):
    out = tmp_path / "vs_vllm.json"
    proc = run_bench([os.path.join(BENCH, "vs_vllm.py"), "--tiny", "--vllm-site", FAKE_VLLM, "--skip-spans",
                      "--ours-mp", "--out", str(out)], tmp_path)
    r = json.loads(out.read_text())
    assert r["smoke"] and r["ratio_vs_vllm"] > 0 and r["fraction_of_roofline"] > 0 and r["ratio_vs_vllm_mp"] > 0
    assert r["vllm_anatomy"]["settings"]["multiprocessing"] == "0"
    assert r["vllm_anatomy_mp"]["settings"]["multiprocessing"] == "1"
    assert r["vllm"]["settings"]["multiprocessing"] is None            # vLLM's own default, as peers/vllm
    assert r["vllm"]["settings"]["version"] == "stand-in"
    gpu = r["gpu_time_per_step"]
    assert gpu["vllm_inproc_run"]["settings"]["multiprocessing"] == "0"
    for engine in ("vllm_anatomy", "vllm"):
        assert set(gpu[engine]) == {"4"} and gpu[engine]["4"]["floor_ms"] == gpu["floor_ms"]["4"] > 0
    for row in ("vllm_anatomy", "vllm", "vllm_anatomy_mp"):
        assert set(r[row]["decode_step_ms"]) == {"1", "4"}
    assert "decode step ms" in proc.stdout and "per decode step" in proc.stdout


@pytest.mark.slow
def test_scaling_tiny_end_to_end_and_plot(tmp_path):
    out = tmp_path / "scaling.json"
    proc = run_bench([os.path.join(BENCH, "scaling.py"), "--tiny", "--vllm-site", FAKE_VLLM, "--out", str(out)],
                     tmp_path)
    r = json.loads(out.read_text())
    for engine in ("vllm_anatomy", "vllm"):
        for series, xs in (("num_seqs", [1, 4]), ("context", [32, 64])):
            points = r[engine][series]
            assert [p["x"] for p in points] == xs
            assert all(p["output_tokens"] == p["num_seqs"] * p["output_len"] and p["fraction_of_floor"] > 0
                       for p in points)
    assert "ours/vLLM" in proc.stdout
    pytest.importorskip("matplotlib")
    run_bench([os.path.join(BENCH, "plot_scaling.py"), str(out)], tmp_path)
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_scaling_tiny_context_only_with_prefill_kernel(tmp_path):
    """--series context --prefill-kernel --skip-vllm: ours alone, the context points only,
    and the switch recorded (on a CPU ours runs the torch backend: the plumbing is what is tested)."""
    out = tmp_path / "scaling.json"
    proc = run_bench([os.path.join(BENCH, "scaling.py"), "--tiny", "--skip-vllm", "--series", "context",
                      "--prefill-kernel", "--out", str(out)], tmp_path)
    r = json.loads(out.read_text())
    assert r["prefill_kernel"] is True and list(r["series"]) == ["context"] and "vllm" not in r
    assert "num_seqs" not in r["vllm_anatomy"]
    assert [p["x"] for p in r["vllm_anatomy"]["context"]] == [32, 64]
    assert "prompt tokens" in proc.stdout and "sequences" not in proc.stdout


def test_gpu_breakdown_counts_overlap_once_and_sorts_kernels_by_kind(bench):
    gb = bench.gpu_breakdown
    assert gb.kind_of("_unified_attention_kernel") == "attention"
    assert gb.kind_of("_prefill_attention_kernel") == "attention"
    assert gb.kind_of("void flash::flash_fwd_splitkv_kernel<...>") == "attention"
    assert gb.kind_of("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert gb.kind_of("_rms_norm_kernel") == "norm"
    assert gb.kind_of("_reshape_and_cache_kernel") == "kv_cache_write"
    assert gb.kind_of("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4>") == "sampling"
    assert gb.kind_of("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert gb.kind_of("some_elementwise_kernel") == "other"
    # 0-10 attention, 5-15 a GEMM on another stream (overlaps 5 us), idle 15-20, 20-40 a norm.
    r = gb.breakdown([(20.0, 40.0, "_rms_norm_kernel"), (0.0, 10.0, "_unified_attention_kernel"),
                      (5.0, 15.0, "gemm_kernel")])
    assert r["span_s"] == pytest.approx(40e-6)
    assert r["busy_s"] == pytest.approx(35e-6)                 # the overlap counted once, the gap not at all
    assert r["busy_fraction"] == pytest.approx(35 / 40)
    assert r["kernel_s_by_kind"] == pytest.approx({"norm": 20e-6, "attention": 10e-6, "gemm": 10e-6})
    assert r["launches_by_kind"] == {"norm": 1, "attention": 1, "gemm": 1}
    twentieths = r["busy_fraction_by_twentieth"]               # 2 us each: 0-15 busy, 15-20 idle, 20-40 busy
    assert twentieths[:7] == [1.0] * 7 and twentieths[8:10] == [0.0, 0.0] and twentieths[10:] == [1.0] * 10
    assert twentieths[7] == pytest.approx(0.5)
