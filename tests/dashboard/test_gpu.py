"""CUDA graphs and the device lane in the dashboard: the per-step decision (graph
replay padded to a captured size, or eager and why), the sample runs shipped in
samples/ (listed, deep-linkable, offered to a newcomer without a GPU) and the
device lane's phases, layers and kernels.

No GPU here: the GPU run is the fixture run made GPU-shaped (tests/dashboard/
gpu_run.py: real dispatcher decisions, invented device timings). One test opens
the real GPU sample when it is in the repository."""
import os

import pytest

from vllm_anatomy.config import default_capture_sizes

from tests.dashboard.conftest import APP, CPU_SAMPLE_NAME, GPU_SAMPLE_NAME, GPU_SAMPLE, ROOT


def _text(at) -> str:
    return "\n".join([m.value for m in at.markdown] + [c.value for c in at.caption])


def _app(monkeypatch, trace_dir: str, samples_dir: str | None, page: str, run: str | None, step=None, tab=None):
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", trace_dir)
    if samples_dir is None:
        monkeypatch.delenv("VLLM_ANATOMY_SAMPLES_DIR", raising=False)
    else:
        monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", samples_dir)
    at = AppTest.from_file(APP, default_timeout=60)
    if run:
        at.query_params["run"] = run
    at.query_params["page"] = page
    if step is not None:
        at.query_params["step"] = str(step)
    if tab is not None:       # the inspector computes only its open tab (the URL's `tab`)
        at.query_params["tab"] = tab
    return at.run()


WORKER = "Worker (model runner)"


def _ok(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


# -- the per-step decision ------------------------------------------------------------------------
def test_execution_mode_text():
    from dashboard.components.sampled import execution_mode
    gpu = {"device": "cuda", "config": {"compilation_config": {
        "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24, 32, 40, 48, 56]}}}
    head, why = execution_mode(gpu, {"mode": "FULL", "num_tokens": 5, "num_padded_tokens": 8,
                                     "reason": "pure decode, padded 5 -> 8"})
    assert head == "CUDA graph replay · 5 decodes padded to 8 (captured sizes 1, 2, 4, 8, 16, …, 56; 10 sizes)"
    assert "3 padding rows get slot -1" in why and "query_len 0" in why
    head, why = execution_mode(gpu, {"mode": "FULL", "num_tokens": 8, "num_padded_tokens": 8, "reason": "pure decode"})
    assert head.startswith("CUDA graph replay · 8 decodes, exactly a captured size") and "no padding" in why
    head, why = execution_mode(gpu, {"mode": "NONE", "num_tokens": 40, "num_padded_tokens": 40,
                                     "reason": "prefill in batch (max query_len 37): eager"})
    assert head == "eager · prefill in batch (max query_len 37)" and "FULL_DECODE_ONLY" in why
    head, why = execution_mode(gpu, {"mode": "PIECEWISE", "num_tokens": 37, "num_padded_tokens": 40,
                                     "reason": "mixed batch (max query_len 30): piecewise graphs, attention eager, "
                                               "padded 37 -> 40", "reason_code": "mixed_batch"})
    assert head == "piecewise CUDA graphs · 37 tokens, padded to 40 (captured sizes 1, 2, 4, 8, 16, …, 56; 10 sizes)"
    assert "eager attention launch per layer" in why and "captured for 40 tokens" in why
    head, why = execution_mode(gpu, {"mode": "NONE", "num_tokens": 60, "num_padded_tokens": 60,
                                     "reason": "60 decodes > largest graph (56): eager"})
    assert head == "eager · 60 decodes > largest graph (56)" and "largest captured graph" in why
    # Runs recorded before the decision was traced: what the device and config say.
    assert execution_mode({"device": "cpu"})[0].startswith("eager (CPU)")
    assert execution_mode(gpu)[0] == "CUDA graph replay"


@pytest.mark.model
def test_cpu_run_shows_eager_and_why(recorded_run, run_facts, monkeypatch, tmp_path):
    trace_dir, path = recorded_run
    at = _app(monkeypatch, trace_dir, str(tmp_path), "inspector", os.path.basename(path), run_facts["steps"][0], WORKER)
    _ok(at)
    text = _text(at)
    assert "Forward pass: **eager · CUDA graphs off (eager mode)**" in text
    assert "cudagraph_mode NONE" in text and "On a CPU there are no kernel launches to save" in text
    assert "`vllm_anatomy/worker/cudagraph.py` · `CudagraphDispatcher.dispatch" in text
    assert "no GPU (cpu): the host timings of the device work" in text


# -- sample runs ----------------------------------------------------------------------------------
@pytest.mark.model
def test_samples_are_listed_and_deep_linkable(recorded_run, samples, monkeypatch, tmp_path):
    trace_dir, path = recorded_run
    at = _app(monkeypatch, trace_dir, samples["dir"], "inspector", CPU_SAMPLE_NAME, 2)
    _ok(at)
    assert at.session_state["run_path"] == samples["cpu"]          # ?run=<name> found in the samples dir
    picker = at.sidebar.selectbox(key="picked_run")
    assert picker.value == samples["cpu"]
    recorded = [o for o in picker.options if not o.startswith("sample · ")]
    assert recorded and picker.options[:len(recorded)] == recorded          # recorded runs first, then samples
    assert picker.options[len(recorded):] == ["sample · CPU · 1 process · smollm2",
                                              "sample · CUDA · 1 process · synthetic-gpu"]
    # The default samples directory is <repo>/samples. Runs are opened by name only
    # (issue 14): a relative path, or any path outside the run dirs, is refused.
    from dashboard import data, state
    monkeypatch.delenv("VLLM_ANATOMY_SAMPLES_DIR")
    assert os.path.normpath(state.samples_dir()) == os.path.join(ROOT, "samples")
    monkeypatch.chdir(tmp_path)
    assert isinstance(state.resolve_run(os.path.join("samples", "x.sqlite")), data.RunError)
    assert isinstance(state.resolve_run("dashboard/app.py"), data.RunError)
    assert state.resolve_run(os.path.join(ROOT, "dashboard", "app.py")).message == \
        state.resolve_run("/etc/passwd").message                    # one refusal, whatever exists


@pytest.mark.model
def test_no_gpu_button_opens_the_gpu_sample_on_a_graph_replay(recorded_run, samples, monkeypatch):
    trace_dir, _ = recorded_run
    at = _app(monkeypatch, trace_dir, samples["dir"], "live", None)
    _ok(at)
    assert at.button(key="strip_gpu_sample").label == "No GPU here? Open the CUDA sample run"
    assert at.sidebar.button(key="open_gpu_sample").label == "No GPU here? Open the CUDA sample run"
    at.button(key="strip_gpu_sample").click().run()
    _ok(at)
    step = samples["graph_step"]
    d = samples["decisions"][step]
    assert d["mode"] == "FULL" and d["num_padded_tokens"] > d["num_tokens"]
    assert at.title[0].value == "Step inspector"
    assert at.session_state["run_path"] == samples["gpu"] and at.session_state["cursor"] == step
    text = _text(at)
    assert (f"Forward pass: **CUDA graph replay · {d['num_tokens']} decodes padded to {d['num_padded_tokens']} "
            f"(captured sizes 1, 2, 4, 8, 16, …, 512; {len(default_capture_sizes(512))} sizes)**") in text
    assert not any(b.key == "open_gpu_sample" for b in at.sidebar.button)   # the sample is open now
    # The why (padding rows write slot -1) is the Worker tab's: only the open tab is computed.
    at = _app(monkeypatch, trace_dir, samples["dir"], "inspector", GPU_SAMPLE_NAME, step, WORKER)
    _ok(at)
    text = _text(at)
    assert f"{d['num_padded_tokens'] - d['num_tokens']} padding row" in text and "slot -1" in text
    assert "`vllm_anatomy/worker/cudagraph.py` · `CudagraphDispatcher.dispatch" in text


# -- the device lane ------------------------------------------------------------------------------
@pytest.mark.model
def test_device_lane_of_an_eager_step(recorded_run, samples, monkeypatch):
    trace_dir, _ = recorded_run
    step = samples["eager_step"]
    at = _app(monkeypatch, trace_dir, samples["dir"], "inspector", GPU_SAMPLE_NAME, step, WORKER)
    _ok(at)
    text = _text(at)
    assert "Forward pass: **eager · prefill in batch (max query_len" in text
    assert f"**Device lane** · step {step} ·" in text and "(eager) · 30 layer spans · 61 kernel launches" in text
    frames = {tuple(df.value.columns): df.value for df in at.dataframe}
    summary = next(v for k, v in frames.items() if k[:2] == ("kernel", "launches"))
    per = dict(zip(summary["kernel"], summary["launches"]))
    assert per == {"compute_slot_mapping": 1, "reshape_and_cache": 30, "unified_attention": 30}
    launches = next(v for k, v in frames.items() if k[:3] == ("layer", "kernel", "grid"))
    attn = launches[launches["kernel"] == "unified_attention"]
    assert list(attn["layer"]) == list(range(30))                  # each kernel inside its layer
    row = attn.iloc[0]
    assert row["GB/s"] == pytest.approx(row["bytes"] / (row["µs"] * 1e-6) / 1e9, rel=1e-2)


@pytest.mark.model
def test_device_lane_of_a_graph_replay(recorded_run, samples, monkeypatch):
    trace_dir, _ = recorded_run
    step = samples["graph_step"]
    d = samples["decisions"][step]
    at = _app(monkeypatch, trace_dir, samples["dir"], "inspector", GPU_SAMPLE_NAME, step, WORKER)
    _ok(at)
    text = _text(at)
    assert f"(CUDA graph replay, padded {d['num_tokens']}→{d['num_padded_tokens']}) · 0 layer spans" in text
    assert "CUDA events cannot be recorded between a graph's kernels" in text
    # The lesson on CUDA graphs links to that step; a CPU run says it needs a GPU.
    at = _app(monkeypatch, trace_dir, samples["dir"], "lessons", GPU_SAMPLE_NAME)
    _ok(at)
    assert at.button(key="lesson_cudagraph").label == f"Open step {step} →"
    at = _app(monkeypatch, trace_dir, samples["dir"], "lessons", CPU_SAMPLE_NAME)
    assert not any(b.key == "lesson_cudagraph" for b in at.button)
    assert "needs a GPU: open the GPU sample run (sidebar)" in _text(at)


@pytest.mark.model
def test_timeline_device_rows(recorded_run, samples, monkeypatch):
    trace_dir, _ = recorded_run
    # NOTE: the cursor is an eager step with layer spans (so the window holds one) next to a
    # padded replay; no step is flagged, so the window cannot move off them: step_flags reads
    # the CPU fixture's wall times, and a loaded machine can make any step an "outlier"
    # (a fresh-clone CI under load flagged steps and opened the window on replays alone).
    from dashboard import spans as dashboard_spans
    monkeypatch.setattr(dashboard_spans, "step_flags", lambda df: {})
    at = _app(monkeypatch, trace_dir, samples["dir"], "timeline", GPU_SAMPLE_NAME, samples["timeline_step"])
    _ok(at)
    spec = at.get("plotly_chart")[1].proto.spec
    for needle in ('"device"', 'phases"', '"layers"', '"kernels"', "GPU.kernel.unified_attention", "GPU.layer",
                   "CUDA graph replay, padded", "MB moved", "achieved", "grid [", "GPUModelRunner._bookkeeping_sync"):
        assert needle in spec, needle
    text = _text(at)
    assert "CUDA graph replays and" in text and "row of decoder layers" in text
    assert any(f"{len(default_capture_sizes(512))} CUDA graph captures (sizes 1, 2, 4, 8, 16, …, 512)" in e.label
               for e in at.expander)
    # The span table behind it: kernels mapped to the layer they ran in, one row per device row kind.
    from dashboard import spans
    df = spans.span_table.__wrapped__(samples["gpu"], (), "cuda")
    dev = df[df["lane"] == "device"]
    assert set(dev["device_row"]) == {"phases", "layers", "kernels"}
    attn = dev[(dev["name"] == "GPU.kernel.unified_attention") & (dev["step_id"] == samples["eager_step"])]
    assert sorted(attn["kernel_layer"]) == list(range(30))


# -- the real GPU sample -------------------------------------------------------------------------
def test_gpu_sample(monkeypatch, tmp_path):
    from tests.dashboard.gpu_run import pick_steps
    picked = pick_steps(GPU_SAMPLE)
    full = [(k, d) for k, d in picked["decisions"].items()
            if d["mode"] == "FULL" and d["num_padded_tokens"] >= d["num_tokens"]]
    assert full, "no step of the GPU sample replayed a CUDA graph"
    step = picked["graph_step"]
    at = _app(monkeypatch, str(tmp_path), None, "inspector", os.path.basename(GPU_SAMPLE), step, WORKER)
    _ok(at)
    assert os.path.samefile(at.session_state["run_path"], GPU_SAMPLE)
    picker = at.sidebar.selectbox(key="picked_run")
    assert "sample · H100 · 1 process · smollm2" in picker.options
    text = _text(at)
    assert "Forward pass: **CUDA graph replay · " in text
    assert "**Device lane** · step" in text


def test_startup_counts_piecewise_and_full_captures():
    """FULL_AND_PIECEWISE captures graph pieces for every size and full graphs for the decode sizes:
    the start-up line says how many of each, so 15 captures of 11 sizes add up."""
    import pandas as pd
    from dashboard.views.timeline import _captures_text
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    caps = pd.DataFrame({"cudagraph_mode": ["PIECEWISE"] * 11 + ["FULL"] * 4, "cudagraph_size": sizes + [1, 2, 4, 8]})
    assert _captures_text(caps, sizes) == "15 CUDA graph captures (11 piecewise, 4 full; sizes 1, 2, 4, 8, 16, …, 64)"
    full_only = caps[caps["cudagraph_mode"] == "FULL"]
    assert _captures_text(full_only, [1, 2, 4, 8]) == "4 CUDA graph captures (sizes 1, 2, 4, 8)"


def test_the_gpu_sample_button_opens_the_default_models_one_process_run():
    """Samples come newest first; the button's run is the default model's in one process, not
    the newer article-size Llama run or the three-process one (they stay in the picker)."""
    from dashboard.components.run_picker import gpu_sample
    runs = [{"path": "samples/h100-llama2-7b-dummy-article.sqlite", "model": "/c/dummy/meta-llama--Llama-2-7b-hf",
             "device": "cuda"},
            {"path": "samples/h100-smollm2-full-3proc.sqlite", "model": "/c/models/SmolLM2-135M-Instruct",
             "device": "cuda"},
            {"path": "samples/h100-smollm2-full.sqlite", "model": "/c/models/SmolLM2-135M-Instruct", "device": "cuda"},
            {"path": "samples/cpu-smollm2-tp3-full.sqlite", "model": "/c/models/SmolLM2-135M-Instruct", "device": "cpu"}]
    assert gpu_sample(runs)["path"] == "samples/h100-smollm2-full.sqlite"
    assert gpu_sample(runs[:2])["path"] == "samples/h100-smollm2-full-3proc.sqlite"
    assert gpu_sample(runs[:1])["path"].endswith("article.sqlite")
    assert gpu_sample(runs[3:]) is None
