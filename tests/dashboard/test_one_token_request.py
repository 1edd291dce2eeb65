"""A request that generated one token has no inter-token latency and no decode: its five accounts
(Self-test Q5, the Request journey's panel) and the journey's ITL metric say so in words, where they
read "ITL mean —, max — ms" and "decode 0.2 ms" (the bookkeeping between FIRST_TOKEN and FINISHED,
added in the same output loop). A run recorded here by the real engine: request 0 with max_tokens=1,
request 1 with 4 (its account keeps its numbers)."""
from __future__ import annotations

import os
import re

import pytest

from tests.dashboard.conftest import APP

ONE_GAP = "ITL none (one output token: no gap between two tokens)"
NO_DECODE = "decode none (one output token, sampled by its prefill: no decode step)"
# A dash standing for one of the time account's figures ("ITL mean —", "max — ms").
BARE_DASH = re.compile(r"\b(?:queue|prefill|decode|TTFT|ITL mean|max)\*{0,2} —")


@pytest.fixture(scope="module")
def one_token_run(default_model_dir, tmp_path_factory) -> str:
    from vllm_anatomy.entrypoints.llm import LLM
    from vllm_anatomy.sampling_params import SamplingParams
    trace_dir = str(tmp_path_factory.mktemp("one_token"))
    llm = LLM(default_model_dir, trace_level="full", trace_dir=trace_dir, num_gpu_blocks_override=16,
              max_model_len=96, max_num_batched_tokens=64)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    for i, n in ((0, 1), (1, 4)):
        ids = tok.apply_chat_template([{"role": "user", "content": f"What is a CPU? ({i})"}], tokenize=True,
                                      add_generation_prompt=True, return_dict=False)
        engine.add_request(str(i), {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    path = engine.recorder.run_path
    engine.shutdown()
    assert path is not None
    return path


def test_q5_says_why_one_token_has_no_itl(one_token_run):
    from dashboard.answers import q5_accounts
    from dashboard.answers.source import RunSource
    src = RunSource(one_token_run)
    one = q5_accounts.answer(src, "0")
    assert one.facts["request"] == "0" and one.facts["time"]["ITL mean ms"] is None
    time_row = one.tables["the five accounts"][0]["value"]
    assert ONE_GAP in time_row and NO_DECODE in time_row and "—" not in time_row, time_row
    assert re.search(r"TTFT [\d,.]+ ms", time_row), time_row
    four = q5_accounts.answer(src, "1").tables["the five accounts"][0]["value"]
    t = q5_accounts.answer(src, "1").facts["time"]
    assert f"ITL mean {t['ITL mean ms']:,.1f} ms, max {t['ITL max ms (step ends)']:,.1f} ms" in four, four
    assert f"decode {t['decode ms']:,.1f} ms" in four and "none" not in four
    # Its state path: finished by the step that scheduled it, though no queue ever showed it
    # (the request column was empty); the four-token request's path is read from the queues.
    (only_step,) = one.facts["steps"]
    assert one.facts["path"] == [{"status": "FINISHED (length)", "from step": only_step, "to step": only_step}]
    path1 = q5_accounts.answer(src, "1").facts["path"]
    assert path1[0]["status"] == "RUNNING" and path1[-1]["status"] == "FINISHED (length)", path1


def test_journey_says_why_one_token_has_no_itl(one_token_run, monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", os.path.dirname(one_token_run))
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", str(tmp_path / "no-samples"))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update({"run": os.path.basename(one_token_run), "page": "journey", "request": "0"})
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    md = "\n".join(m.value for m in at.markdown)
    assert ONE_GAP in md and NO_DECODE in md, md[:600]
    assert re.search(r"FINISHED \(length\) @ \d+", md), md[:600]
    assert not BARE_DASH.search(md), BARE_DASH.findall(md)
    itl = next(m for m in at.metric if m.label == "ITL (mean)")
    assert (itl.value, itl.delta) == ("none", "one token: no gap"), (itl.value, itl.delta)


def test_q4_and_the_lessons_see_a_request_that_finished_in_its_first_step(one_token_run):
    """No queue ever shows request 0 (it finished in the step that scheduled it): Q4's finishes and
    the lessons' Facts.finishes place it at that step, where they left it out."""
    from dashboard.answers import q4_finish
    from dashboard.answers.source import RunSource
    src = RunSource(one_token_run)
    assert "0" not in src.statuses
    only_step = max(s for s in src.steps if any(str(e["request_id"]) == "0"
                                                for e in src.record(s).get("scheduled", [])))
    done = q4_finish.finishes(src)
    assert (only_step, "0") in done and any(r == "1" for _, r in done), done
    import pandas as pd
    from dashboard.lessons import BY_KEY, Facts
    records = {s: src.record(s) for s in src.steps}
    reasons = {"0": "length", "1": "length"}
    lesson_facts = Facts(pd.DataFrame({"step": src.steps}), records, src.statuses, reasons)
    assert lesson_facts.finishes() == done
    assert BY_KEY["finish"].find(lesson_facts) == (only_step, "0")      # the first request that finished
    ans = q4_finish.answer(src, only_step, "0")
    facts = ans.facts
    assert (facts["request"], facts["step"], facts["free_step"]) == ("0", only_step, only_step), facts
    # Freed in the run's first step: the pool is replayed from the fresh one (every block but the
    # null block free), where an empty pool made the replay "disagree with the run".
    assert not [n for n in ans.notes if "disagrees" in n], ans.notes


def test_left_queues_places_queued_and_never_queued_requests():
    from dashboard.answers.q4_finish import last_scheduled, left_queues
    statuses = {"a": {1: "RUNNING", 2: "RUNNING"}, "b": {3: "RUNNING"}}    # b: still there at the last step
    records = [(1, {"scheduled": [{"request_id": "a"}, {"request_id": "c"}]}),
               (2, {"scheduled": [{"request_id": "a"}]}), (3, {"scheduled": [{"request_id": "b"}]})]
    assert last_scheduled(records, {"c"}) == {"c": 1} and last_scheduled(records, set()) == {}
    assert left_queues([1, 2, 3], statuses, {"c": 1}) == [(1, "c"), (3, "a")]


def test_the_first_step_replays_from_the_fresh_pool(one_token_run):
    """RunSource.pool_replay: before the engine's first step the pool is the fresh one (every block
    but the null block 0 free, in id order), which Q1 and Q4 both replay from; Q1 then knows the
    free queue get_new_blocks popped from in step 1 (it knew none), and it agrees with the run."""
    from dashboard.answers import q1_allocation
    from dashboard.answers.source import RunSource
    src = RunSource(one_token_run)
    assert src.steps[0] == 1
    n = int(src.kv(1)["num_gpu_blocks"])
    replay = src.pool_replay(1)
    assert replay is not None and replay.queue == list(range(1, n))
    q = q1_allocation._free_queue_at_allocation(src, 1, "0")
    assert q["queue_before"] == list(range(1, n)) and q["popped"] == [1, 2, 3] and q["replay"].ok, q
    assert src.pool_replay(2) is not None and src.pool_replay(2).queue == src.kv(1)["free_queue"]
