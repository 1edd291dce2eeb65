"""bench/vs_vllm.py, bench/scaling.py, bench/plot_scaling.py, bench/side_by_side.py and
bench/throughput_ab.py on the CPU.

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
from typing import Any

import pytest

from tests.helpers import imported_from

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
FAKE_VLLM = os.path.join(ROOT, "tests", "bench", "fake_vllm")
BENCH_MODULES = ("vs_vllm", "scaling", "plot_scaling", "side_by_side", "throughput", "kernel_bench", "gpu_breakdown",
                 "throughput_ab", "host_stalls", "step_overhead")


@pytest.fixture(scope="module")
def bench():
    """The bench scripts as modules, with bench/ on sys.path only while this file's tests run
    (the path and the modules are taken away again afterwards)."""
    with imported_from(BENCH, BENCH_MODULES):
        import gpu_breakdown
        import plot_scaling
        import scaling
        import side_by_side
        import throughput_ab
        import vs_vllm
        yield types.SimpleNamespace(vs_vllm=vs_vllm, scaling=scaling, plot_scaling=plot_scaling,
                                    side_by_side=side_by_side, gpu_breakdown=gpu_breakdown,
                                    throughput_ab=throughput_ab)


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
    assert [(p["x"], p["num_seqs"], p["prompt_len"], p["output_len"]) for p in plan.points("ttft")] == [
        (1024, 1, 1024, 1), (4096, 1, 4096, 1), (8192, 1, 8192, 1)]
    assert bench.scaling.TINY.max_model_len == 64 + 4          # the smoke mode's TTFT prompts fit


@pytest.mark.fast
def test_scaling_command_line(bench):
    """--series takes a comma-separated list (and still one name, repeatable); --prefill-kernel
    takes 0 / 1 / cudnn, bare meaning 1."""
    scaling = bench.scaling

    def parse(*argv):
        args = scaling.arg_parser().parse_args(list(argv))
        return scaling.series_to_run(args), args.prefill_kernel
    assert parse() == (("num_seqs", "context", "ttft"), None)              # the engine's default
    assert parse("--series", "context", "--prefill-kernel", "0") == (("context",), "0")
    assert parse("--series", "ttft,context", "--prefill-kernel") == (("context", "ttft"), "1")
    assert parse("--series", "ttft", "--series", "num_seqs", "--prefill-kernel", "cudnn") == (
        ("num_seqs", "ttft"), "cudnn")
    assert parse("--prefill-kernel", "--series", "ttft") == (("ttft",), "1")
    for bad in (["--series", "context,tfft"], ["--series", ","], ["--prefill-kernel", "cudn"]):
        with pytest.raises(SystemExit):
            parse(*bad)


@pytest.mark.fast
def test_ttft_ratio_and_table(bench, capsys):
    scaling = bench.scaling
    points = [{"x": 16, "ttft_ms": 2.0, "warmup_ms": 9.0}, {"x": 48, "ttft_ms": 6.0, "warmup_ms": 9.0}]
    result = {"series": {"ttft": points}, "vllm_anatomy": {"ttft": points},
              "vllm": {"ttft": [p | {"ttft_ms": 4.0} for p in points]}}
    assert [(r["x"], r["ours_over_vllm"]) for r in scaling.ttft_ratio(result)] == [(16, 0.5), (48, 1.5)]
    assert scaling.ttft_ratio({"vllm_anatomy": {"ttft": points}, "vllm": {"error": "failed"}}) is None
    scaling.print_table(result, scaling.TINY)
    out = capsys.readouterr().out
    assert "ours TTFT ms" in out and "vLLM TTFT ms" in out and "0.50x" in out and "1.50x" in out


def synthetic_scaling_result(bench) -> dict:
    scaling = bench.scaling
    plan = scaling.TINY
    result = {"gpu": None, "model": "synthetic", "smoke": True, "series": {s: plan.points(s) for s in scaling.SERIES},
              "floor": scaling.floors(plan, 1e10, 1e11)}
    for key, fraction in (("vllm_anatomy", 0.5), ("vllm", 0.4)):
        engine: dict[str, Any] = {"settings": {"version": "x"}}
        for s in scaling.THROUGHPUT_SERIES:
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
        check_ttft_points(r[engine]["ttft"])
    assert [t["x"] for t in r["ttft_ratio"]] == [16, 48] and all(t["ours_over_vllm"] > 0 for t in r["ttft_ratio"])
    # no --prefill-kernel: the engine's defaults, as it read them
    assert (r["prefill_kernel"], r["vllm_anatomy"]["settings"]["prefill_kernel"]) == (None, "1")
    assert r["vllm_anatomy"]["settings"]["prefill_min_len"] == 2048
    assert "ours/vLLM" in proc.stdout and "ours TTFT ms" in proc.stdout
    pytest.importorskip("matplotlib")
    run_bench([os.path.join(BENCH, "plot_scaling.py"), str(out)], tmp_path)
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def check_ttft_points(points: list[dict]) -> None:
    """The ttft series of the smoke plan: 16 and 48 prompt tokens, one token each call, the
    median of five samples, the first call kept apart."""
    import statistics
    assert [(p["x"], p["prompt_len"], p["num_seqs"]) for p in points] == [(16, 16, 1), (48, 48, 1)]
    for p in points:
        assert len(p["samples_ms"]) == 5 and all(ms > 0 for ms in p["samples_ms"]) and p["warmup_ms"] > 0
        assert p["ttft_ms"] == statistics.median(p["samples_ms"]) and p["output_tokens"] == [1] * 5


@pytest.mark.slow
def test_scaling_tiny_context_only_with_prefill_kernel(tmp_path):
    """--series context,ttft --prefill-kernel cudnn --skip-vllm: ours alone, the context and TTFT
    points only, the switch recorded as given and as the engine read it (on a CPU ours runs its
    cpu backend: the plumbing is what is tested)."""
    out = tmp_path / "scaling.json"
    proc = run_bench([os.path.join(BENCH, "scaling.py"), "--tiny", "--skip-vllm", "--series", "context,ttft",
                      "--prefill-kernel", "cudnn", "--prefill-sdpa-min-len", "32", "--out", str(out)], tmp_path)
    r = json.loads(out.read_text())
    assert (r["prefill_kernel"], r["prefill_sdpa_min_len"]) == ("cudnn", 32)
    settings = r["vllm_anatomy"]["settings"]
    assert (settings["prefill_kernel"], settings["prefill_sdpa_min_len"]) == ("cudnn", 32)
    assert list(r["series"]) == ["context", "ttft"] and "vllm" not in r and "ttft_ratio" not in r
    assert "num_seqs" not in r["vllm_anatomy"]
    assert [p["x"] for p in r["vllm_anatomy"]["context"]] == [32, 64]
    check_ttft_points(r["vllm_anatomy"]["ttft"])
    assert "prompt tokens" in proc.stdout and "sequences" not in proc.stdout and "ours TTFT ms" in proc.stdout


def test_gpu_breakdown_counts_overlap_once_and_sorts_kernels_by_kind(bench):
    gb = bench.gpu_breakdown
    assert gb.kind_of("_unified_attention_kernel") == "attention"
    assert gb.kind_of("_prefill_attention_kernel") == "attention"
    assert gb.kind_of("void flash::flash_fwd_splitkv_kernel<...>") == "attention"
    assert gb.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128") == "attention"
    assert gb.kind_of("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert gb.kind_of("_skinny_gemm_kernel") == "gemm"
    assert gb.kind_of("_splitk_reduce_kernel") == "gemm"                 # not "sampling" (reduce_kernel)
    assert gb.kind_of("reduce_segments") == "attention"                   # the 3D decode's combine
    assert gb.kind_of("_rms_norm_kernel") == "norm"
    assert gb.kind_of("_reshape_and_cache_kernel") == "kv_cache_write"
    assert gb.kind_of("_fused_qk_norm_rope_kernel") == "rope"
    assert gb.kind_of("_fused_qk_norm_rope_kvcache_kernel") == "rope"     # its K/V write is inside
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
    gaps = r["idle_gaps"]                                      # one gap: 15-20 us, a quarter of the way in
    assert [b["count"] for b in gaps["bins"]] == [1, 0, 0, 0]
    assert gaps["bins"][0]["seconds"] == pytest.approx(5e-6)
    assert gaps["largest"] == [{"ms": pytest.approx(5e-3), "at": 0.375}]


@pytest.mark.fast
def test_gpu_breakdown_top_kernels_and_the_context_workload(bench):
    gb = bench.gpu_breakdown
    top = gb.top_kernels([(0.0, 3.0, "_unified_attention_kernel"), (3.0, 10.0, "nvjet_gemm"),
                          (10.0, 12.0, "_unified_attention_kernel"), (12.0, 13.0, "x" * 100)], n=2)
    assert [(r["name"], r["launches"], r["kind"]) for r in top] == [
        ("nvjet_gemm", 1, "gemm"), ("_unified_attention_kernel", 2, "attention")]
    assert top[0]["seconds"] == pytest.approx(7e-6) and top[1]["seconds"] == pytest.approx(5e-6)
    prompts, max_tokens, temperature, max_model_len = gb.workload("context:4096")
    assert len(prompts) == 64 and {len(p) for p in prompts} == {4096} and set(max_tokens) == {128}
    assert max_model_len == 4096 + 128 and temperature == 0.6
    assert gb.workload("context:4096")[0] == prompts             # seeded: both engines get the same prompts
    nano_prompts, nano_max_tokens, _, nano_len = gb.workload("nano-vllm")
    assert len(nano_prompts) == 256 and nano_len == 4096
    pre_prompts, pre_max_tokens, _, pre_len = gb.workload("prefill:4096")
    assert pre_prompts == prompts and set(pre_max_tokens) == {1} and pre_len == max_model_len
    for bad in ("context:", "context:4k", "ctx:4096", "prefill:"):
        with pytest.raises(SystemExit, match="context:N"):
            gb.workload(bad)


@pytest.mark.fast
def test_gpu_breakdown_ttft_splits_each_request_into_host_and_gpu(bench, capsys):
    gb = bench.gpu_breakdown
    prompts, max_tokens, temperature, max_model_len = gb.workload("ttft:4096")
    assert len(prompts) == 1 + gb.TTFT_REPEATS and {len(p) for p in prompts} == {4096}
    assert len({tuple(p) for p in prompts}) == len(prompts)       # each request fresh: no prefix-cache hit
    assert set(max_tokens) == {1} and temperature == 0.0 and max_model_len >= 4096
    for bad in ("ttft:", "ttft:0", "ttft:4k"):
        with pytest.raises(SystemExit, match="ttft:N"):
            gb.workload(bad)
    ms = 1e6                                                        # ns per ms
    # request 1: called at 0, a GEMM 2-5 ms and attention 4-6 ms (overlapping: busy 4 ms), returns at 7;
    # request 2: called at 10, attention 12-13, a GEMM 14-15, returns at 18; a kernel between the two
    # windows (9-9.5 ms) belongs to neither.
    intervals = [(2 * ms, 5 * ms, "nvjet_gemm"), (4 * ms, 6 * ms, "_unified_attention_kernel"),
                 (9 * ms, 9.5 * ms, "nvjet_gemm"), (12 * ms, 13 * ms, "prefill_attention_kernel"),
                 (14 * ms, 15 * ms, "nvjet_gemm")]
    out = gb.ttft_phases(intervals, [(0, int(7 * ms)), (int(10 * ms), int(18 * ms))])
    first, second = out["ttft_requests"]
    assert first["host_head_ms"] == pytest.approx(2) and first["gpu_span_ms"] == pytest.approx(4)
    assert first["gpu_busy_ms"] == pytest.approx(4) and first["host_tail_ms"] == pytest.approx(1)
    assert first["kernel_ms_by_kind"] == pytest.approx({"gemm": 3, "attention": 2}) and first["launches"] == 2
    assert second["host_head_ms"] == pytest.approx(2) and second["gpu_span_ms"] == pytest.approx(3)
    assert second["gpu_busy_ms"] == pytest.approx(2) and second["host_tail_ms"] == pytest.approx(3)
    median = out["ttft_median"]
    assert median["wall_ms"] == pytest.approx(7.5) and median["gpu_busy_ms"] == pytest.approx(3)
    assert median["kernel_ms_by_kind"] == pytest.approx({"attention": 1.5, "gemm": 2})
    gb.print_ttft_table({"vllm_anatomy": out, "vllm": out})
    table = capsys.readouterr().out
    assert "host_head_ms" in table and "attention" in table
    with pytest.raises(SystemExit, match="no GPU activity"):
        gb.ttft_phases(intervals, [(int(20 * ms), int(21 * ms))])


@pytest.mark.fast
def test_gpu_breakdown_gc_log_says_what_overlapped_each_gap(bench, capsys):
    gb = bench.gpu_breakdown
    # busy 0-100 and 50-300 (two streams), idle 300-1800 (1.5 ms), busy 1800-1900, idle 1900-2500 (0.6 ms)
    intervals = [(1800.0, 1900.0, "b"), (0.0, 100.0, "a"), (50.0, 300.0, "c"), (2500.0, 2600.0, "d")]
    assert gb.idle_stretches(intervals, 1000.0) == [(300.0, 1800.0)]
    assert gb.idle_stretches(intervals, 500.0) == [(300.0, 1800.0), (1900.0, 2500.0)]
    ms = 1_000_000                                         # ns
    gaps = [(10 * ms, 15 * ms), (50 * ms, 52 * ms)]
    gc_events = [{"start_ns": 11 * ms, "duration_s": 0.003, "generation": 2, "collected": 7, "step": 4},
                 {"start_ns": 30 * ms, "duration_s": 0.001, "generation": 0, "collected": 0, "step": 9}]
    compiles = [{"start_ns": 49 * ms, "end_ns": 51 * ms, "kernel": "mod._gumbel_sample"}]
    steps = [{"start_ns": 8 * ms, "end_ns": 16 * ms, "phases_s": {"update_from_output": 0.006, "schedule": 0.001},
              "num_outputs": 0},
             {"start_ns": 16 * ms, "end_ns": 49 * ms, "phases_s": {"schedule": 0.001}, "num_outputs": 0},
             {"start_ns": 49 * ms, "end_ns": 53 * ms, "phases_s": {"sample": 0.003}, "num_outputs": 1}]
    out = gb.gap_causes(gaps, (0, 100 * ms), gc_events, compiles, steps)
    assert (out["num_gaps"], out["num_with_gc"], out["num_with_gen2"], out["num_with_triton_compile"]) == (2, 1, 1, 1)
    first, second = out["gaps"]
    assert first["ms"] == 5 and first["at"] == 0.1 and second["at"] == 0.5
    assert first["gc"] == [{"generation": 2, "ms": 3.0, "collected": 7, "overlap_ms": 3.0}]
    assert first["host_steps"] == [{"step": 0, "ms": 8.0, "top_phases_ms": {"update_from_output": 6.0, "schedule": 1.0}}]
    assert second["triton_compiles"] == [{"kernel": "mod._gumbel_sample", "ms": 2.0}] and not second["gc"]
    assert [h["step"] for h in second["host_steps"]] == [2]
    assert out["gap_s"] == pytest.approx(0.007) and out["gc_overlap_s"] == pytest.approx(0.003)
    gb.print_gap_causes("vllm_anatomy", out | {
        "clock_check_ms": 0.4, "median_host_step_ms": 2.0, "num_triton_compiles": 1, "triton_hooks": True,
        "gc_summary": {"gen0": {"count": 1, "total_s": 0.001}, "gen2": {"count": 1, "total_s": 0.003}}})
    printed = capsys.readouterr().out.splitlines()
    assert printed[2].split()[:4] == ["5.00", "0.100", "2:3.00", "-"] and "update_from_output 6.00" in printed[2]
    assert "mod._gumbel_sample" in printed[3]
    assert printed[-1].startswith("  2 gaps = 7.0 ms; 1 overlap a collection (1 of gen 2")


@pytest.mark.fast
def test_gpu_breakdown_allocator_counts_keeps_the_event_counters(bench, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {
        "num_alloc_retries": 2, "num_device_alloc": 40, "allocated_bytes.all.current": 10, "num_sync_all_streams": 1})
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {"num_host_alloc": 5, "host_alloc_time": {"total": 3}})
    assert bench.gpu_breakdown.allocator_counts() == {"num_alloc_retries": 2, "num_device_alloc": 40,
                                                      "num_sync_all_streams": 1, "host.num_host_alloc": 5}


def test_gpu_breakdown_gc_log_lines_up_a_collection_with_a_gap_of_a_real_trace(bench):
    """The clock: a CPU trace (the only one without a GPU) with two ops 5+ ms apart and a full
    collection between them: the gap the profiler's own times show must overlap the collection
    the GC log timed with time.time_ns()."""
    import gc
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile
    import host_stalls
    gc_log = host_stalls.GCLog()
    compile_log = types.SimpleNamespace(events=[], available=False)
    step_log = types.SimpleNamespace(steps=[])
    x = torch.ones(8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.time_ns()
        x.add(1)
        with gc_log:
            gc.collect(2)
        time.sleep(0.005)
        x.mul(2)
        end = time.time_ns()
    intervals = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()]
    out = bench.gpu_breakdown.gap_causes_of_run(prof, intervals, (start, end), gc_log, compile_log, step_log)
    assert 0 <= out["clock_check_ms"] < 50
    assert out["num_gaps"] >= 1 and out["num_with_gen2"] == 1
    gap = next(g for g in out["gaps"] if g["gc"])
    assert gap["ms"] >= 5 and gap["gc"][0]["overlap_ms"] == pytest.approx(gap["gc"][0]["ms"], rel=0.05)


@pytest.mark.fast
def test_throughput_ab_export_puts_a_remapped_subpackage_back(bench, tmp_path, monkeypatch):
    """A commit whose pyproject.toml installs kernels/ as vllm_anatomy.kernels (this repo's
    layout of 2026-12-05/06) exports with the kernels inside the package."""
    repo = tmp_path / "repo"
    (repo / "vllm_anatomy").mkdir(parents=True)
    (repo / "kernels").mkdir()
    (repo / "vllm_anatomy" / "__init__.py").write_text("")
    (repo / "kernels" / "__init__.py").write_text("")
    (repo / "kernels" / "unified_attention.py").write_text("X = 1\n")
    (repo / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"vllm_anatomy.kernels" = "kernels"\n')
    for cmd in (["init", "-q"], ["add", "-A"],
                ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "layout"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True)
    monkeypatch.setattr(bench.throughput_ab, "ROOT", str(repo))
    assert bench.throughput_ab.package_folders("HEAD") == {"vllm_anatomy": "vllm_anatomy",
                                                           "vllm_anatomy.kernels": "kernels"}
    dest = tmp_path / "export"
    bench.throughput_ab.export("HEAD", str(dest))
    assert (dest / "vllm_anatomy" / "kernels" / "unified_attention.py").read_text() == "X = 1\n"
    assert (dest / "vllm_anatomy" / "__init__.py").exists() and not (dest / "kernels").exists()


@pytest.mark.fast
def test_throughput_ab_order_ratios_and_isolation_check(bench, tmp_path):
    ab = bench.throughput_ab
    assert ab.order(4) == ["ab", "ba", "ab", "ba"]
    samples = [{"round": 1, "variant": "a", "throughput": {"tok_per_s": 100.0}},
               {"round": 1, "variant": "b", "throughput": {"tok_per_s": 110.0}},
               {"round": 2, "variant": "b", "throughput": {"tok_per_s": 90.0}},
               {"round": 2, "variant": "a", "throughput": {"tok_per_s": 100.0}},
               {"round": 3, "variant": "a", "error": "failed"},                 # a round without a pair
               {"round": 3, "variant": "b", "throughput": {"tok_per_s": 120.0}}]
    s = ab.summarize(samples)
    assert s["ratios_b_over_a"] == pytest.approx([1.1, 0.9])
    assert (s["ratio_median"], s["ratio_min"], s["ratio_max"]) == pytest.approx((1.0, 0.9, 1.1))
    assert s["median_tok_per_s"] == {"a": 100.0, "b": 110.0}
    assert ab.summarize([])["ratio_median"] is None
    init = tmp_path / "vllm_anatomy" / "__init__.py"
    init.parent.mkdir()
    init.write_text("")
    assert ab.in_tree(str(init), str(tmp_path)) and not ab.in_tree(os.path.join(ROOT, "vllm_anatomy", "__init__.py"),
                                                                   str(tmp_path))
    assert not ab.in_tree(None, str(tmp_path))
    assert ab.parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    for bad in (["A"], ["=1"], ["PYTHONPATH=/x"]):
        with pytest.raises(SystemExit):
            ab.parse_env(bad)
    with pytest.raises(SystemExit):                       # no package there
        ab.make_variant("a", str(tmp_path / "nowhere"), [], None)


@pytest.mark.fast
def test_throughput_ab_shape_smollm2(bench, tmp_path, monkeypatch):
    """--shape smollm2-135m: the default model's Llama shape (what the Llama-only fusions need); a reused
    --model-dir of the other shape is refused; the CPU smoke mode keeps its own tiny Qwen3."""
    import json
    import sys
    ab = bench.throughput_ab
    import throughput                                    # (bench/ is on sys.path while `bench` is up)
    cfg = throughput.smollm2_135m_config()
    assert (cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // 9,
            cfg.num_hidden_layers) == ("llama", 9, 3, 64, 30)
    assert ab.arg_parser().parse_args(["--shape", "smollm2-135m"]).shape == "smollm2-135m"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    ab.check_shape(str(tmp_path), "qwen3-0.6b", tiny=False)
    with pytest.raises(SystemExit, match="not --shape smollm2-135m"):
        ab.check_shape(str(tmp_path), "smollm2-135m", tiny=False)
    monkeypatch.setattr(sys, "argv", ["throughput_ab.py", "--tiny", "--shape", "smollm2-135m"])
    with pytest.raises(SystemExit, match="--tiny writes its own tiny Qwen3"):
        ab.main()


@pytest.mark.slow
def test_throughput_ab_tiny_runs_each_variant_from_its_own_tree(tmp_path):
    """HEAD's package exported into tmp_path (A, prefill switch 0) against this checkout (B,
    switch 1), two rounds: every run imported the engine from its own tree (this checkout
    is on the test's PYTHONPATH too, so a variant's tree not put first would fail here)
    and read its own environment."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: --export has nothing to archive")
    script, head = os.path.join(BENCH, "throughput_ab.py"), tmp_path / "head"
    run_bench([script, "--export", "HEAD", str(head)], tmp_path)
    assert (head / "vllm_anatomy" / "__init__.py").exists() and not (head / "bench").exists()
    out = tmp_path / "ab.json"
    proc = run_bench([script, "--tiny", "--a", str(head), "--a-env", "VLLM_ANATOMY_PREFILL_KERNEL=0",
                      "--b-env", "VLLM_ANATOMY_PREFILL_KERNEL=1", "--b-label", "this tree", "--rounds", "2",
                      "--model-dir", str(tmp_path / "model"), "--out", str(out)], tmp_path)
    r = json.loads(out.read_text())
    head_rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert r["variants"]["a"]["tree"] == str(head) and r["variants"]["a"]["tree_rev"]["rev"] == head_rev
    assert r["variants"]["b"]["tree"] == ROOT and r["variants"]["b"]["label"] == "this tree"
    assert r["order"] == ["ab", "ba"] and not r["model_reused"] and r["smoke"]
    assert [(s["round"], s["variant"]) for s in r["samples"]] == [(1, "a"), (1, "b"), (2, "b"), (2, "a")]
    trees = {"a": str(head), "b": ROOT}
    switch = {"a": "0", "b": "1"}
    for s in r["samples"]:
        assert s["vllm_anatomy_file"] == os.path.join(trees[s["variant"]], "vllm_anatomy", "__init__.py")
        assert s["isolated"] and s["env"]["VLLM_ANATOMY_PREFILL_KERNEL"] == switch[s["variant"]]
        assert s["settings"]["prefill_kernel"] == switch[s["variant"]]             # as the engine read it
        assert s["settings"]["multiprocessing"] == "0"                            # as vs_vllm's ours runs
        assert s["throughput"]["output_tokens"] == r["workload"]["output_tokens"] and s["throughput"]["tok_per_s"] > 0
    assert len(r["summary"]["ratios_b_over_a"]) == 2 and r["summary"]["ratio_median"] > 0
    assert all(r["summary"]["median_tok_per_s"][k] > 0 for k in "ab")
    assert "B/A per round" in proc.stdout and "    2  B A" in proc.stdout
