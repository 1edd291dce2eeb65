"""Every page of the dashboard, headless (AppTest), on a run recorded by the real
engine: no exception, numbers equal to the snapshots, the scrubber moves the
panels, lessons deep-link to the right steps, bad files give a message."""
import os
import re
import sqlite3

import pytest

pytestmark = pytest.mark.model
PAGES = {"live": "Live run", "timeline": "Timeline", "inspector": "Step inspector",
         "journey": "Request journey", "metrics": "Metrics over time", "lessons": "Lessons"}


def _text(at) -> str:
    return "\n".join([m.value for m in at.markdown] + [c.value for c in at.caption])


@pytest.mark.parametrize("page", list(PAGES) + ["mapping"])
def test_every_page_renders(make_app, page):
    at = make_app(page, 1)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    if page in PAGES:
        assert at.title[0].value == PAGES[page]


def test_inspector_shows_the_snapshot(make_app, run_facts):
    step = run_facts["preempt_step"]
    snap = run_facts["snaps"][step]
    at = make_app("inspector", step)
    text = _text(at)
    so, kv, rec = snap["scheduler_output"], snap["scheduler"]["kv_cache"], snap["scheduler"]["step_record"]
    assert f"total_num_scheduled_tokens **{so['total_num_scheduled_tokens']}**" in text
    assert f"usage **{kv['usage']:.0%}** · free {kv['num_free_blocks']}" in text
    used = rec["token_budget_start"] - rec["token_budget_end"]
    assert f"**Token budget** {used} / {rec['token_budget_start']} tokens" in text
    assert f"Admission stopped: **`{rec['admission_stop_reason']}`**" in text
    for req in rec["preempted_req_ids"]:
        assert f"req {req}: RUNNING → PREEMPTED" in text
    assert "eager · CUDA graphs off (eager mode)" in text


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


def test_play_advances_and_stops_at_the_end(make_app, run_facts):
    # The timer does not tick in AppTest; the fragment's first run (with the render) takes a step.
    steps = run_facts["steps"]
    at = make_app("inspector", steps[0])
    at.button(key="play").click().run()
    assert at.session_state["playing"] and at.session_state["cursor"] == steps[1]
    at = make_app("inspector", steps[-1])
    at.button(key="play").click().run()
    assert not at.session_state["playing"] and at.session_state["cursor"] == steps[-1]


def test_lessons_link_to_the_steps_that_show_them(make_app, run_facts):
    at = make_app("lessons")
    labels = {b.key: b.label for b in at.button}
    assert labels["lesson_preempt"] == f"Open step {run_facts['preempt_step']} →"
    assert labels["lesson_prefix"] == f"Open step {run_facts['hit_step']} →"
    assert labels["lesson_chunked"] == f"Open step {run_facts['chunk_step']} →"
    at.button(key="lesson_preempt").click().run()
    assert at.session_state["cursor"] == run_facts["preempt_step"]
    assert at.title[0].value == "Step inspector"


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
