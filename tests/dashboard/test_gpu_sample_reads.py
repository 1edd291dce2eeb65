"""The shipped H100 sample (samples/h100-smollm2-full.sqlite: CUDA graphs, async scheduling) as
a learner on a CPU machine reads it: what the pages say about it must hold for a GPU run.

Found by walking the dashboard in Chromium (1440x900) on the sample:
- Processes, chain ①–⑪ of the run's last steps (nothing scheduled, no forward): ⑧ and ⑨ said
  "a CPU run", ⑦ and ⑩ "a plain call ... no span of its own", on an H100 run.
- Step inspector, Worker tab: the kernel table said "compare with ... an H200's HBM3e: about 4,800 GB/s"
  under an H100's run header.
- Its Sampled tokens read "token 657 ''": an empty text where the text was unknown (the sample's
  tokenizer path is the recording machine's, /tmp/vac/models/...). Now the id alone, and the text
  from this machine's model cache when the same model is there (the default model is).
"""
import os

import pytest

from dashboard import processes
from dashboard.answers.source import RunSource
from tests.dashboard.conftest import APP, GPU_SAMPLE, ROOT

TP_SAMPLE = os.path.join(ROOT, "samples", "cpu-smollm2-tp3-full.sqlite")
pytestmark = pytest.mark.skipif(not os.path.exists(GPU_SAMPLE), reason="samples/h100-smollm2-full.sqlite not shipped")


@pytest.fixture(scope="module")
def gpu():
    return RunSource(GPU_SAMPLE)


@pytest.fixture
def sample_app(monkeypatch, tmp_path):
    """AppTest of the dashboard on the shipped H100 sample (page, step, more of the URL)."""
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", os.path.dirname(GPU_SAMPLE))

    def make(page: str, step: int, **query):
        at = AppTest.from_file(APP, default_timeout=120)
        at.query_params.update({"run": os.path.basename(GPU_SAMPLE), "page": page, "step": str(step), **query})
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at
    return make


def _text(at) -> str:
    return "\n".join([m.value for m in at.markdown] + [c.value for c in at.caption] + [i.value for i in at.info])


def _rows(src: RunSource, step: int) -> dict[str, dict]:
    return {r["#"]: r for r in processes.chain_rows(processes.step_view(src, step), step)}


def test_processes_chain_of_a_step_without_a_forward_on_a_gpu_run(gpu):
    idle = [s for s in gpu.steps if not (gpu.snap(s) or {}).get("scheduler_output", {}).get("total_num_scheduled_tokens")]
    assert idle, "the sample's last steps schedule nothing (async scheduling: the last tokens are in flight)"
    rows = _rows(gpu, idle[-1])
    for marker in ("⑦", "⑧", "⑨", "⑩"):
        why = rows[marker]["process · thread"]
        assert "CPU run" not in why and "plain call" not in why, (marker, why)
        assert "no forward" in why and "nothing was scheduled" in why, (marker, why)


def test_processes_chain_of_a_graph_replay_and_of_a_cpu_run(gpu):
    replay = _rows(gpu, 5)          # 7 decodes, a full CUDA graph replay
    assert replay["⑨"]["this run's spans"] == "GPU.model_forward"
    assert "CPU run" not in replay["⑧"]["process · thread"]
    if os.path.exists(TP_SAMPLE):   # a CPU run with a forward still says why there is no kernel launch
        cpu = RunSource(TP_SAMPLE)
        step = cpu.steps[len(cpu.steps) // 2]
        rows = _rows(cpu, step)
        assert "CPU run" in rows["⑧"]["process · thread"] and "CPU run" in rows["⑨"]["process · thread"]


def test_kernel_table_compares_with_the_runs_own_gpu(gpu, sample_app):
    from dashboard.components.device_lane import bandwidth_heading, peak_bandwidth
    assert gpu.meta["device_name"] == "NVIDIA H100 80GB HBM3"
    assert peak_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3350 and peak_bandwidth("NVIDIA H200")[0] == 4800
    assert peak_bandwidth("NVIDIA H100 PCIe")[0] == 2000 and peak_bandwidth("Some GPU") is None
    assert "spec sheet" in bandwidth_heading("Some GPU") and "4,800" not in bandwidth_heading("Some GPU")
    text = _text(sample_app("inspector", 28, tab="Worker (model runner)"))
    assert "Kernel launches" in text
    assert "H200" not in text and "4,800" not in text
    assert "an H100 SXM's HBM3: about 3,350 GB/s" in text and "~3,350 GB/s" in text


def _sampled_lines(at) -> list[str]:
    return [m.value for m in at.markdown if "position" in m.value and "token <code>" in m.value]


def test_sampled_tokens_never_show_an_unknown_text_as_empty(gpu, sample_app, monkeypatch, tmp_path):
    from dashboard import data
    assert not os.path.exists(os.path.join(gpu.meta["model"], "tokenizer.json"))   # recorded elsewhere
    monkeypatch.setenv("VLLM_ANATOMY_CACHE", str(tmp_path / "empty-cache"))
    assert data.decode(gpu.meta, [657]) is None
    lines = _sampled_lines(sample_app("inspector", 28, tab="Worker (model runner)"))
    assert len(lines) == 1 and "token <code>657</code>" in lines[0], lines
    assert "<code>''</code>" not in lines[0], lines


def test_sampled_tokens_read_the_local_model_cache(gpu, sample_app):
    from dashboard import data
    from vllm_anatomy.transformers_utils.default_model import model_dir
    if not (model_dir() / "tokenizer.json").exists() or os.path.basename(gpu.meta["model"]) != model_dir().name:
        pytest.skip("the default model is not in this machine's cache")
    text = data.decode(gpu.meta, [657])
    assert text, text
    lines = _sampled_lines(sample_app("inspector", 28, tab="Worker (model runner)"))
    assert f"<code>{text!r}</code>" in lines[0], lines


def test_q4_finish_under_async_scheduling_names_the_schedule_that_told_the_worker(gpu):
    """Self-test Q4 on the sample said finished_req_ids was 'not seen in a recorded step' for request 0
    (finished at step 10) while step 10's own SchedulerOutput lists it: with async scheduling the finish
    is processed after step 9's schedule(), so the next schedule() is step 10's, not step 11's."""
    from dashboard.answers import q4_finish
    so10 = (gpu.snap(10) or {}).get("scheduler_output") or {}
    assert "0" in [str(x) for x in so10["finished_req_ids"]]
    a = q4_finish.answer(gpu, 10, "0")
    assert a.ok and a.facts["told_step"] == 10 and a.facts["told_next_step"]
    row = next(r for r in a.chain if r["#"] == "4")
    assert row["what happened here"].startswith("step 10:"), row
    assert "step 10's `SchedulerOutput.finished_req_ids` told the worker" in a.summary
    note = " ".join(a.notes)
    assert "last token came from step 8" in note and "after step 9's schedule()" in note, note


def test_run_source_fails_with_the_pages_message_when_spans_cannot_be_read(tmp_path):
    """RunSource raised SQLite's own error from whichever answer first read spans; the pages had to ask
    spans.request_table first (readable_source). Now it fails when built, with a message, and the
    cached source is the RunError the pages show (test_shell's unreadable-spans tests: every page)."""
    import shutil
    import sqlite3

    from dashboard import data
    from dashboard.answers import cached
    from dashboard.answers.source import RunSourceError
    path = str(tmp_path / "run-nospans.sqlite")
    shutil.copyfile(GPU_SAMPLE, path)
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE spans")
    conn.commit()
    conn.close()
    with pytest.raises(RunSourceError, match="cannot read request spans .*no such table: spans"):
        RunSource(path)
    version = data.file_version(path)
    src = cached.source(path, version)
    assert isinstance(src, data.RunError) and "no such table: spans" in src.message
    a = cached.answer(path, version, "q1")
    assert not a.ok and "cannot read request spans" in a.why_not


def test_queue_chips_explain_computed_tokens_ahead_of_the_tokens(gpu, sample_app):
    """Async scheduling: step 3's chips read 'req 0 · 36/35 tok' (computed past the request's own
    tokens) with nothing saying why; the tokens in flight are now shown (36/35+2) and explained."""
    r0 = next(r for r in gpu.snap(3)["scheduler"]["running"] if str(r["request_id"]) == "0")
    assert (r0["num_computed_tokens"], r0["num_tokens"], r0["num_output_placeholders"]) == (36, 35, 2)
    text = _text(sample_app("inspector", 3))
    assert "req 0 · 36/35+2 tok" in text and "36/35 tok" not in text
    assert "output placeholders" in text


def _metric_charts(at) -> dict[str, dict]:
    import json
    return {json.loads(p.proto.spec)["layout"]["title"]["text"]: json.loads(p.proto.spec)["layout"]
            for p in at.get("plotly_chart")}


def test_metrics_cursor_caption_axes_and_pool(gpu, monkeypatch, tmp_path):
    """Found at 1440x900: Metrics over time said "the dashed line is the cursor" with no step in the URL
    and no line drawn; the bar chart's x-axis (autoranged to its bars) did not line up with the charts
    beside it; and the KV chart's pool (num_gpu_blocks, the null block in) was not the pool its usage
    is a share of (the usable blocks)."""
    from streamlit.testing.v1 import AppTest

    from dashboard.components.kv_memory import mb
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", os.path.dirname(GPU_SAMPLE))
    for step in (None, 30):
        at = AppTest.from_file(APP, default_timeout=120)
        at.query_params.update({"run": os.path.basename(GPU_SAMPLE), "page": "metrics",
                                **({"step": str(step)} if step else {})})
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        captions = " ".join(c.value for c in at.caption)
        charts = _metric_charts(at)
        assert len(charts) == 5
        ranges = {tuple(lay.get("xaxis", {}).get("range") or ()) for lay in charts.values()}
        assert len(ranges) == 1 and len(next(iter(ranges))) == 2, ranges      # one x range for all five
        assert len({(lay["margin"]["l"], lay["yaxis"].get("automargin")) for lay in charts.values()}) == 1
        lines = [[s for s in lay.get("shapes", []) if s.get("type") == "line"] for lay in charts.values()]
        if step is None:
            assert "dashed line" not in captions and not any(lines), captions
        else:
            assert f"dashed line is the cursor (step {step})" in captions, captions
            assert all(len(x) == 1 and x[0]["x0"] == step for x in lines), lines
    kv = gpu.snap(gpu.steps[0])["scheduler"]["kv_cache"]
    usable = kv["num_gpu_blocks"] - 1
    title = next(t for t in charts if t.startswith("KV cache usage"))
    assert f"{usable} usable blocks, {mb(usable * gpu.meta['kv_cache_bytes_per_block'])}" in title, title


def test_journey_a_running_step_without_tokens_is_not_a_step_served(gpu, sample_app):
    """Found at 1440x900: request 0 at step 9 of the H100 sample was RUNNING but not scheduled (async
    scheduling: its 7 output tokens and 1 in flight reach max_tokens 8), yet it sat on the 'steps served'
    lane, kind 'running', 0 tokens."""
    import json
    rec = gpu.snap(9)["scheduler"]["step_record"]
    assert "0" not in {s["request_id"] for s in rec["scheduled"]}
    at = sample_app("journey", 9, request="0")
    fig = json.loads(at.get("plotly_chart")[0].proto.spec)
    lanes = {t["name"]: [c[0] for c in t["customdata"]] for t in fig["data"] if t.get("name", "").startswith("steps ")}
    assert 9 not in lanes["steps served"] and 9 in lanes["steps not scheduled"], lanes
    assert 8 in lanes["steps served"]
    row = at.dataframe[0].value.set_index("step").loc[9]
    assert row["kind"] == "not scheduled" and row["status"] == "RUNNING", row
    line = next(m.value for m in at.markdown if m.value.startswith(":material/arrow_right: **Step 9**"))
    assert "running · running" not in line.lower() and "not scheduled" in line, line


@pytest.mark.parametrize("run,step", [(os.path.basename(GPU_SAMPLE), 10), ("h100-smollm2-full-3proc.sqlite", 17)])
def test_timeline_legend_gives_every_entry_its_own_colour(run, step, monkeypatch, tmp_path):
    """Found at 1440x900 (H100 sample, the eager step 10's window): the legend gave update_from_output and
    GPU.kernel.compute_slot_mapping one pink, _model_forward and GPU.kernel.unified_attention one blue, and
    AsyncGPUModelRunnerOutput and OutputProcessor one grey, each as entries of their own."""
    import json

    from streamlit.testing.v1 import AppTest
    if not os.path.exists(os.path.join(os.path.dirname(GPU_SAMPLE), run)):
        pytest.skip(f"samples/{run} not shipped")
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", os.path.dirname(GPU_SAMPLE))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"run": run, "page": "timeline", "step": str(step)})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    fig = next(json.loads(p.proto.spec) for p in at.get("plotly_chart") if "_bookkeeping_sync" in p.proto.spec)
    # (the bars' entries: the sync point's ▼ may share _bookkeeping_sync's red, it is another shape)
    entries = [(t["name"], t["marker"]["color"]) for t in fig["data"]
               if t.get("showlegend") is not False and t["type"] == "bar"]
    names = [n for n, _ in entries]
    assert "GPU.kernel.compute_slot_mapping" in names and "update_from_output" in names, names
    if run == os.path.basename(GPU_SAMPLE):
        assert "GPU.kernel.unified_attention" in names and "_model_forward" in names, names
    colours: dict[str, list[str]] = {}
    for name, colour in entries:
        colours.setdefault(str(colour).upper(), []).append(name)
    assert all(len(v) == 1 for v in colours.values()), {c: v for c, v in colours.items() if len(v) > 1}


def test_processes_opens_on_a_step_that_shows_the_chain(gpu, monkeypatch, tmp_path):
    """Found at 1440x900: Processes opened on the run's last step, which on a finished async run
    schedules nothing (⑦–⑩ empty). With no step asked, it opens on the first step that admits a
    request and runs a forward; a step in the URL is still the one shown."""
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", os.path.dirname(GPU_SAMPLE))
    shown = {}
    for step in (None, gpu.steps[-1]):
        at = AppTest.from_file(APP, default_timeout=120)
        at.query_params.update({"run": os.path.basename(GPU_SAMPLE), "page": "processes",
                                **({"step": str(step)} if step else {})})
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        shown[step] = at.selectbox(key="proc_step").value
        chain = at.table[-1].value
        rows = dict(zip(chain.index, chain["this run's spans"]))
        if step is None:
            assert all(rows[m] != "—" for m in "②③④⑤⑥⑦⑧⑩⑪"), rows
    snap = gpu.snap(shown[None])["scheduler_output"]
    assert snap["scheduled_new_reqs"] and snap["total_num_scheduled_tokens"] > 0
    assert shown[gpu.steps[-1]] == gpu.steps[-1]


def test_q4_counts_a_reuse_in_the_step_that_listed_the_free(gpu):
    """Found by clicking Q4's "Show me" (step 10, KV cache tab, request 0): block 3 shows F A C — freed by
    request 0, then allocated to request 7 in the same step — while the answer said the freed blocks were
    first reused in step 13 (and block 3 in step 48). With async scheduling the free is drained into the
    next step's events before its schedule() allocates: a reuse after the free event, in that step, counts."""
    from dashboard.answers import q4_finish
    events = gpu.events(10)
    kinds = [(e["kind"], e.get("request_id")) for e in events]
    assert kinds.index(("free", "0")) < kinds.index(("allocate", "7"))
    assert 3 in next(e for e in events if e["kind"] == "allocate")["block_ids"]
    a = q4_finish.answer(gpu, 10, "0")
    assert a.facts["free_step"] == 10 and a.facts["reused"][3] == 10, a.facts["reused"]
    assert "first in **step 10**" in a.summary, a.summary
    assert a.show_me[1].step == 10 and "block 3 reused by request 7" in a.show_me[1].label, a.show_me


def test_kv_pool_usage_says_which_blocks_it_is_a_share_of(gpu, sample_app):
    """Found on Q1's "Show me" page (step 48, KV cache tab): "usage 87% ... pool 8.44 MB, in use 7.03 MB",
    and 7.03 / 8.44 is 83%: usage is a share of the usable blocks (the null block left out), the pool of all."""
    kv = gpu.snap(48)["scheduler"]["kv_cache"]
    used = kv["num_gpu_blocks"] - kv["num_free_blocks"] - 1
    at = sample_app("inspector", 48, tab="KV cache")
    line = next(m.value for m in at.markdown if m.value.startswith("**KV block pool**"))
    assert f"usage **{kv['usage']:.0%}** ({used} of {kv['num_gpu_blocks'] - 1} usable blocks)" in line, line


def test_step_pickers_follow_the_cursor_when_a_button_moves_it(gpu, sample_app):
    """Found by clicking: Processes' "next arrival →" moved the URL to the next arrival step while its
    step picker (a keyed selectbox keeps its own value) and so the chart and tables stayed on the old step;
    a hop clicked then opened the old step. The Timeline's "Open step" picker likewise stayed on step 5
    after "Show an eager step (step 10)" moved the cursor."""
    admits = [s for s in gpu.steps if (gpu.snap(s) or {}).get("scheduler_output", {}).get("scheduled_new_reqs")]
    nxt = next(s for s in admits if s > 1)
    at = sample_app("processes", 1)
    assert at.selectbox(key="proc_step").value == 1
    at.button(key="proc_next_arrival").click().run()
    assert at.session_state["cursor"] == nxt
    assert at.selectbox(key="proc_step").value == nxt, (nxt, at.selectbox(key="proc_step").value)
    at.selectbox(key="proc_step").set_value(30).run()          # the picker itself still moves the cursor
    assert at.session_state["cursor"] == 30 and at.selectbox(key="proc_step").value == 30
    tl = sample_app("timeline", 5)
    assert tl.selectbox(key="tl_pick").value == 5
    tl.button(key="tl_eager").click().run()
    assert tl.session_state["cursor"] == 10 and tl.selectbox(key="tl_pick").value == 10
    tl.selectbox(key="tl_pick").set_value(40).run()            # a pick of its own is kept until the cursor moves
    assert tl.selectbox(key="tl_pick").value == 40


def test_eager_vs_graph_line_names_the_async_sync_point(gpu, sample_app):
    """Found after "Show an eager step (step 10)" on the Timeline: under async scheduling the line said the
    graph replay "runs ahead and waits at `_bookkeeping_sync` (0.00 ms)" right below the note that nothing
    waits there any more (the wait is AsyncGPUModelRunnerOutput.get_output's, 0.011 ms at step 10)."""
    assert gpu.meta["config"]["scheduler_config"]["async_scheduling"]
    at = sample_app("timeline", 10)
    line = next(m.value for m in at.markdown if m.value.startswith("**Eager vs CUDA graph replay:**"))
    assert "`_bookkeeping_sync`" not in line and "`AsyncGPUModelRunnerOutput.get_output`" in line, line
    assert "waits 0.01 ms" in line, line          # step 10's own get_output wait (0.0115 ms)
