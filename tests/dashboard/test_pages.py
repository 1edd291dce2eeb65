"""Every page of the dashboard, headless (AppTest), on a run recorded by the real
engine: no exception, numbers equal to the snapshots, the scrubber moves the
panels, lessons deep-link to the right steps, bad files give a message."""
import os
import re
import sqlite3
import urllib.parse

import pytest

pytestmark = pytest.mark.model
PAGES = {"timeline": "Timeline", "inspector": "Step inspector", "journey": "Request journey",
         "metrics": "Metrics over time", "lessons": "Lessons"}


@pytest.fixture
def open_app(make_app, recorded_run):
    """Like make_app, with more of the URL: open_app(page, step, tab="KV cache", request="2")."""
    from streamlit.testing.v1 import AppTest

    from tests.dashboard.conftest import APP
    make_app  # noqa: B018 (sets the run directories)
    _, path = recorded_run

    def make(page: str, step: int | None = None, **query) -> AppTest:
        at = AppTest.from_file(APP, default_timeout=60)
        at.query_params.update({"run": os.path.basename(path), "page": page,
                                **({"step": str(step)} if step is not None else {}),
                                **{k: str(v) for k, v in query.items()}})
        return at.run()
    return make


@pytest.fixture(scope="module")
def worker_facts(recorded_run):
    """Per step, the worker's snapshot; and the dtype's size (for KV memory)."""
    from vllm_anatomy.tracing.reader import open_run
    _, path = recorded_run
    with open_run(path) as run:
        mrs = {i: run.snapshot(i, "model_runner") for i in run.steps()}
        dtype = str(run.meta["config"]["model_config"]["dtype"]).replace("torch.", "")
    return {"mrs": mrs, "dtype_bytes": {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]}


def _text(at) -> str:
    return "\n".join([m.value for m in at.markdown] + [c.value for c in at.caption])


@pytest.mark.parametrize("page", list(PAGES) + ["mapping", "live"])
def test_every_page_renders(make_app, page):
    at = make_app(page, 1)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    if page in PAGES:
        assert at.title[0].value == PAGES[page]


def test_inspector_shows_the_snapshot(make_app, open_app, run_facts, worker_facts):
    step = run_facts["preempt_step"]
    snap = run_facts["snaps"][step]
    at = make_app("inspector", step)
    text = _text(at)
    so, kv, rec = snap["scheduler_output"], snap["scheduler"]["kv_cache"], snap["scheduler"]["step_record"]
    assert f"total_num_scheduled_tokens **{so['total_num_scheduled_tokens']}**" in text
    used = rec["token_budget_start"] - rec["token_budget_end"]
    assert f"**Token budget** {used} / {rec['token_budget_start']} tokens" in text
    assert f"Admission stopped: **`{rec['admission_stop_reason']}`**" in text
    for req in rec["preempted_req_ids"]:
        assert f"req {req}: RUNNING → PREEMPTED" in text
    assert "eager · CUDA graphs off (eager mode)" in text
    # Only the open tab is computed: the KV panel is not there until the KV tab is asked for (URL `tab`).
    assert "**KV block pool**" not in text
    kv_text = _text(open_app("inspector", step, tab="KV cache"))
    used = kv["num_gpu_blocks"] - kv["num_free_blocks"] - 1          # usage is a share of the usable blocks
    assert (f"usage **{kv['usage']:.0%}** ({used} of {kv['num_gpu_blocks'] - 1} usable blocks) · "
            f"free {kv['num_free_blocks']}") in kv_text
    # memory beside blocks: 2 x layers x kv heads x head dim x block size x dtype bytes, from the worker snapshot
    mr = worker_facts["mrs"][step]
    shape, layers = mr["kv_cache_shape"], mr["num_kv_cache_layers"]
    per_block = shape[0] * shape[2] * shape[3] * shape[4] * layers * worker_facts["dtype_bytes"]
    assert f"one block = {per_block / 2**20:,.2f} MB" in kv_text
    worker = _text(open_app("inspector", step, tab="Worker (model runner)"))
    assert "**slot_mapping**" in worker and "**KV block pool**" not in worker


def test_scrubber_moves_the_panels(make_app, run_facts):
    steps = run_facts["steps"]
    at = make_app("inspector", steps[0])
    before = _text(at)
    assert f"step **{steps[0]}**" in before
    at.button(key="next").click().run()
    after = _text(at)
    assert at.session_state["cursor"] == steps[1] and f"step **{steps[1]}**" in after
    so = run_facts["snaps"][steps[1]]["scheduler_output"]
    assert f"total_num_scheduled_tokens **{so['total_num_scheduled_tokens']}**" in after and after != before
    at.select_slider(key="scrub").set_value(steps[-1]).run()
    assert at.session_state["cursor"] == steps[-1] and f"step **{steps[-1]}**" in _text(at)
    at.button(key="prev").click().run()
    assert at.session_state["cursor"] == steps[-2]
    assert at.query_params["step"] == [str(steps[-2])] or at.query_params["step"] == str(steps[-2])


def test_play_advances(make_app, run_facts):
    # The timer does not tick in AppTest; the fragment's first run (with the render) takes a step.
    steps = run_facts["steps"]
    at = make_app("inspector", steps[0])
    at.button(key="play").click().run()
    assert at.session_state["playing"] and at.session_state["cursor"] == steps[1]


def test_play_at_the_last_step_starts_again_from_the_first(make_app, run_facts):
    """Found at 1440x900: a run opens on its last step, and play there did nothing (the first tick ran
    off the end and stopped). As a media player does, play at the end starts again from the beginning,
    showing the first step for a whole tick before moving on."""
    steps = run_facts["steps"]
    at = make_app("inspector", steps[-1])
    assert "start again from the first step" in at.button(key="play").help
    at.button(key="play").click().run()
    assert at.session_state["playing"] and at.session_state["cursor"] == steps[0], at.session_state["cursor"]
    assert f"step **{steps[0]}** · 1 of {len(steps)}" in _text(at)
    at.button(key="play").click().run()                              # and pause
    assert not at.session_state["playing"] and at.session_state["cursor"] == steps[0]


def _statuses(snaps: dict) -> dict[str, dict[int, str]]:
    out: dict[str, dict[int, str]] = {}
    for i, snap in snaps.items():
        for r in snap["scheduler"]["waiting"] + snap["scheduler"]["running"]:
            out.setdefault(r["request_id"], {})[i] = r["status"]
    return out


def test_lessons_link_to_the_steps_that_show_them(make_app, run_facts):
    at = make_app("lessons")
    labels = {b.key: b.label for b in at.button}
    assert labels["lesson_preempt"] == f"Open step {run_facts['preempt_step']} →"
    assert labels["lesson_prefix"] == f"Open step {run_facts['hit_step']} →"
    assert labels["lesson_chunked"] == f"Open step {run_facts['chunk_step']} →"
    at.button(key="lesson_preempt").click().run()
    assert at.session_state["cursor"] == run_facts["preempt_step"]
    assert at.title[0].value == "Step inspector"
    # the card says "the F (free) events in the KV tab": the KV tab is the one shown
    assert "**KV block pool**" in _text(at) and "**Token budget**" not in _text(at)


def test_every_lesson_card_lands_where_its_text_says(make_app, open_app, run_facts):
    """Each card's link (page, step, tab, request) opens that view, and the view shows the card's idea."""
    from dashboard.components.tabs import TABS
    from dashboard.lessons import LESSONS
    snaps, steps = run_facts["snaps"], run_facts["steps"]
    statuses = _statuses(snaps)
    at = make_app("lessons")
    links, card = {}, None
    titles = {f"**{lesson.title}**": lesson.key for lesson in LESSONS}
    for md in at.markdown:            # a card's text, then its link
        card = next((k for t, k in titles.items() if md.value.startswith(t)), card)
        m = re.search(r"\]\((\w+)\?([^)]+)\)", md.value)
        if m and card:
            links[card] = {k: v[0] for k, v in urllib.parse.parse_qs(m[2]).items()}
    cards = {b.key[len("lesson_"):]: int(b.label.split()[2]) for b in at.button if b.key.startswith("lesson_")}
    assert cards, "no lesson card found a step in the fixture run"
    for lesson in LESSONS:
        if lesson.key not in cards:
            continue
        step = cards[lesson.key]
        q = links[lesson.key]
        assert int(q["step"]) == step and q["page"] == lesson.page and q.get("tab") == (TABS[lesson.tab] if lesson.tab else None), lesson.key
        view = open_app(lesson.page, step, **{k: v for k, v in q.items() if k in ("tab", "request")})
        assert not view.exception, (lesson.key, [e.value for e in view.exception])
        assert view.session_state["cursor"] == step, lesson.key
        text = _text(view)
        if lesson.page == "inspector":
            assert f"step **{step}**" in text, lesson.key
            shown = {"scheduler": "**Token budget**", "kv": "**KV block pool**", "worker": "**slot_mapping**"}
            for tab, marker in shown.items():
                assert (marker in text) == (tab == lesson.tab), (lesson.key, tab)
        req = q.get("request")
        rec = snaps[step]["scheduler"]["step_record"]
        if lesson.key == "preempt":
            assert req in rec["preempted_req_ids"] and f"req {req}: RUNNING → PREEMPTED" in text
        if lesson.key == "finish":
            # the step that finished it (gone from the queues, still there the step before), not the one after
            prev = steps[steps.index(step) - 1]
            assert prev in statuses[req] and step not in statuses[req], (step, req)
            assert re.search(rf"req {re.escape(req)}: RUNNING → FINISHED_\w+", text)
            assert any(e["kind"] == "free" for e in snaps[step]["block_pool_events"])
        if lesson.key == "resume":
            assert any(x["request_id"] == req and x["kind"] == "resumed" for x in rec["scheduled"])
        if lesson.key == "prefix":
            assert any(h["request_id"] == req and h["num_hit_tokens"] for h in rec["prefix_hits"])
        if lesson.key == "chunked":
            assert any(x["request_id"] == req and x["kind"] == "prefill_chunk" for x in rec["scheduled"])


def test_journey_opens_the_preempted_request_at_its_preemption(open_app, run_facts):
    """What lesson 2's link asks for: journey?request=<victim>&step=<preemption step>."""
    step = run_facts["preempt_step"]
    victim = run_facts["snaps"][step]["scheduler"]["step_record"]["preempted_req_ids"][0]
    at = open_app("journey", step, request=victim)
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="request").value == victim
    assert at.selectbox(key="journey_step").value == step
    assert f"**Step {step}** (the cursor, marked on the chart): req {victim} — preempted in this step" in _text(at)
    # every step of its life, the waiting ones included: PREEMPTED from the preemption until it runs again
    statuses = _statuses(run_facts["snaps"])[victim]
    table = at.dataframe[0].value
    assert set(statuses) <= set(table["step"])
    waited = [s for s, v in statuses.items() if v == "PREEMPTED"]
    assert waited and set(table.loc[table["status"] == "PREEMPTED", "step"]) == set(waited)
    assert "**Prompt**" in _text(at)


def test_chart_clicks_read_plotly_customdata_in_every_shape():
    """The crash of issue 15: the browser sends a clicked point's customdata as {"0": 5} (a typed
    array), not [5]. Every clickable chart goes through this one reader."""
    from dashboard.components.nav import point_data
    assert point_data({"customdata": {"0": 5}}) == [5]
    assert point_data({"customdata": {"1": "7", "0": 12}}) == [12, "7"]
    assert point_data({"customdata": [5, "3"]}) == [5, "3"]
    assert point_data({"customdata": 9}) == [9]
    assert point_data({"x": 1}) == []


def test_metrics_match_the_run(make_app, run_facts):
    at = make_app("metrics")
    metrics = {m.label: m.value for m in at.metric}
    snaps = run_facts["snaps"].values()
    assert metrics["steps"] == str(len(run_facts["steps"]))
    assert metrics["preemptions"] == str(sum(len(s["scheduler"]["step_record"]["preempted_req_ids"]) for s in snaps))
    assert metrics["tokens scheduled"] == str(sum(s["scheduler_output"]["total_num_scheduled_tokens"] for s in snaps))
    assert len(at.get("plotly_chart")) == 5


def test_journey_shows_ttft(make_app):
    at = make_app("journey")
    metrics = {m.label: m.value for m in at.metric}
    assert re.fullmatch(r"\d+ ms", metrics["TTFT"]) and metrics["finish reason"] == "length"


def test_timeline_opens_a_step(make_app, run_facts):
    at = make_app("timeline", run_facts["steps"][0])
    fig = at.get("plotly_chart")[1].proto.spec
    assert "device" in fig and "GPUModelRunner._bookkeeping_sync" in fig
    at.selectbox(key="tl_pick").set_value(run_facts["preempt_step"]).run()
    at.button(key="tl_open").click().run()
    assert at.title[0].value == "Step inspector" and at.session_state["cursor"] == run_facts["preempt_step"]


def test_bad_run_files_give_a_message(make_app, recorded_run, tmp_path):
    trace_dir, _ = recorded_run
    garbage = os.path.join(trace_dir, "garbage.sqlite")
    with open(garbage, "wb") as f:
        f.write(b"this is not sqlite" * 100)
    old = os.path.join(trace_dir, "old.sqlite")
    conn = sqlite3.connect(old)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("INSERT INTO meta VALUES ('schema_version', '99')")
    conn.commit()
    conn.close()
    try:
        for run, needle in (("garbage.sqlite", "not a vllm_anatomy run store"),
                            ("old.sqlite", "schema_version 99"), ("missing.sqlite", "no such run store file")):
            at = make_app("inspector", 1, run=run)
            assert not at.exception, [e.value for e in at.exception]
            assert any(needle in e.value for e in at.error), (run, [e.value for e in at.error])
    finally:
        os.remove(garbage)
        os.remove(old)
