"""The step inspector on a speculative-decoding run: the Worker tab shows each verification
(drafts accepted / rejected, the target's own token, the rejected drafts' slots) from the
recorded step_record.spec_decode, and the token index places a step's several output tokens
at the drafts' positions. A run with ngram on a copy prompt (some drafts accepted, some not).
With async scheduling and a draft model the verifications come late ("spec_decode" snapshots):
the inspector and lesson 10 read them through the same Run.verified_drafts.
"""
from __future__ import annotations

import os

import pytest

from dashboard.components.spec_decode import verification_lines

pytestmark = pytest.mark.model
COPY = "Repeat this sentence exactly: the small red boat sails across the quiet blue lake at dawn."
WORKER_TAB = "Worker (model runner)"


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory):
    from vllm_anatomy import LLM, SamplingParams
    from vllm_anatomy.tracing.reader import open_run
    trace_dir = str(tmp_path_factory.mktemp("spec_traces"))
    llm = LLM(trace_level="full", trace_dir=trace_dir, max_model_len=1024, attention_backend="torch",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                  "prompt_lookup_max": 4})
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": COPY}], tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    path = llm.llm_engine.recorder.run_path
    llm.llm_engine.shutdown()
    with open_run(path) as run:
        records = {s: run.snapshot(s)["scheduler"]["step_record"]["spec_decode"] for s in run.steps()}
    return {"dir": trace_dir, "path": path, "records": {s: r for s, r in records.items() if r},
            "tokens": list(out[0].outputs[0].token_ids), "prompt_len": len(ids)}


def open_inspector(spec_run, monkeypatch, tmp_path, step: int):
    from streamlit.testing.v1 import AppTest

    from tests.dashboard.conftest import APP
    monkeypatch.setenv("VLLM_ANATOMY_TRACE_DIR", spec_run["dir"])
    monkeypatch.setenv("VLLM_ANATOMY_SAMPLES_DIR", str(tmp_path / "no-samples"))
    at = AppTest.from_file(APP, default_timeout=90)
    at.query_params.update({"run": os.path.basename(spec_run["path"]), "page": "inspector", "step": str(step),
                            "tab": WORKER_TAB})
    return at.run()


def test_worker_tab_shows_each_verification(spec_run, monkeypatch, tmp_path):
    records = spec_run["records"]
    assert records, "the copy prompt got drafts"
    # A step with a rejection if there is one, else any step with drafts.
    step = next((s for s, rs in records.items() if any(r["num_accepted"] < len(r["draft_token_ids"]) for r in rs)),
                next(iter(records)))
    at = open_inspector(spec_run, monkeypatch, tmp_path, step)
    assert not at.exception, at.exception
    text = "\n".join(m.value for m in at.markdown)
    assert "Speculative decoding" in text
    for r in records[step]:
        assert f"accepted {r['num_accepted']} of {len(r['draft_token_ids'])}" in text
        for slot in r["rejected_slots"]:
            assert f"slot {slot} (block {slot // 16}, offset {slot % 16})" in text
        assert sampled_line(r) in text


def sampled_line(r: dict) -> str:
    """What "Sampled tokens" says of one verification: every token the step emitted."""
    n_acc, k = r["num_accepted"], len(r["draft_token_ids"])
    own = "bonus token (every draft accepted)" if n_acc == k else f"recovered token (instead of draft {n_acc + 1})"
    return (f"{len(r['output_token_ids'])} token{'s' if n_acc else ''}: {n_acc} accepted draft"
            f"{'s' if n_acc != 1 else ''} of {k}, then the {own}")


def test_sampled_tokens_show_every_token_of_a_verify_step(spec_run, monkeypatch, tmp_path):
    """A step that kept drafts: "Sampled tokens" lists each output token (the accepted drafts green,
    the target's own blue), not only the first."""
    records = spec_run["records"]
    step = next(s for s, rs in records.items() if any(r["num_accepted"] > 0 for r in rs))
    at = open_inspector(spec_run, monkeypatch, tmp_path, step)
    assert not at.exception, at.exception
    line = next(m.value for m in at.markdown if "Sampled tokens" not in m.value and "accepted draft" in m.value)
    for r in records[step]:
        assert sampled_line(r) in line
        first = r["first_draft_position"]
        for j, tok in enumerate(r["output_token_ids"]):
            assert f"position {first + j}: " in line and f">{tok} " in line


def test_token_index_puts_verified_tokens_at_their_positions(spec_run):
    from dashboard import data
    index = data.token_index(spec_run["path"], data.file_version(spec_run["path"]))
    req = next(iter(next(iter(spec_run["records"].values()))))["request_id"]
    known = index["tokens"][req]
    start = spec_run["prompt_len"]
    assert [known.get(start + i) for i in range(len(spec_run["tokens"]))] == spec_run["tokens"]
    for step, records in spec_run["records"].items():
        for r in records:
            # every token the verify step emitted (accepted drafts + the target's own), not only the first
            assert index["sampled"][step][r["request_id"]] == [r["first_draft_position"], *r["output_token_ids"]]


@pytest.mark.fast
def test_sampled_verified_line_marks_accepted_drafts_and_the_targets_own_token():
    from dashboard.components.sampled import verified_line
    meta = {"model": ""}
    line = verified_line(meta, "r", 40, [5, 9], 3)
    assert "positions 40–41" in line and "2 tokens: 1 accepted draft of 3, then the recovered token (instead of draft 2)" in line
    assert "title='position 40: draft 1, accepted'" in line and ">5<" in line and ">9<" in line
    assert "1 token: 0 accepted drafts of 3, then the recovered token (instead of draft 1)" in verified_line(meta, "r", 40, [9], 3)
    assert "positions 40–43" in verified_line(meta, "r", 40, [5, 6, 7, 8], 3)
    assert "then the bonus token (every draft accepted)" in verified_line(meta, "r", 40, [5, 6, 7, 8], 3)
    # the request stopped at position 42 (e.g. its EOS was the third token): the fourth was dropped
    stopped = verified_line(meta, "r", 40, [5, 6, 2, 8], 3, final_len=43)
    assert "the request stopped at position 42: update_from_output kept 3 of them and dropped the rest" in stopped
    assert "title='position 43: the target&#x27;s bonus token (every draft accepted): dropped" in stopped
    assert "dropped" not in verified_line(meta, "r", 40, [5, 6, 2, 8], 3, final_len=44)
    # async scheduling: the step was scheduled before the stop at position 39 was known
    assert "already stopped at position 39 (async scheduling" in verified_line(meta, "r", 40, [5, 6, 2, 8], 3, 40)


@pytest.mark.fast
def test_verification_lines_without_a_tokenizer():
    v = {"request_id": "r", "draft_token_ids": [5, 6, 7], "num_accepted": 1, "output_token_ids": [5, 9],
         "first_draft_position": 40, "rejected_slots": [121, 122]}
    lines = verification_lines({"model": ""}, v, 16)
    joined = "\n".join(lines)
    assert "positions 40–42" in joined and "accepted 1 of 3" in joined and "recovered token, instead of draft 2" in joined
    assert "slot 121 (block 7, offset 9) ← position 41" in joined and "rolls back to 41" in joined


@pytest.fixture(scope="module")
def async_draft_run(tmp_path_factory):
    """Async scheduling with the default model drafting for itself: the step snapshots hold -1
    placeholder drafts and no verifications; the late "spec_decode" snapshots hold them."""
    from vllm_anatomy import LLM, SamplingParams
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    from vllm_anatomy.tracing.reader import open_run
    trace_dir = str(tmp_path_factory.mktemp("async_spec_traces"))
    model = str(ensure_default_model())
    llm = LLM(model, trace_level="full", trace_dir=trace_dir, max_model_len=512, async_scheduling=True,
              speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    llm.generate(["The quick brown fox", "Count from one to ten:"], SamplingParams(temperature=0, max_tokens=12),
                 use_tqdm=False)
    path = llm.llm_engine.recorder.run_path
    llm.llm_engine.shutdown()
    with open_run(path) as run:
        late = {s: run.snapshot(s, "spec_decode") for s in run.steps()}
    return {"dir": trace_dir, "path": path, "late": {s: r for s, r in late.items() if r}}


def test_worker_tab_shows_an_async_steps_verification_from_its_late_record(async_draft_run, monkeypatch, tmp_path):
    late = async_draft_run["late"]
    step = next(s for s, r in late.items() if r["spec_decode"] and s + 1 in late)
    at = open_inspector(async_draft_run, monkeypatch, tmp_path, step)
    assert not at.exception, at.exception
    text = "\n".join(m.value for m in at.markdown)
    captions = "\n".join(c.value for c in at.caption)
    assert "Speculative decoding" in text and "verified after its snapshot was taken" in captions
    for r in late[step]["spec_decode"]:
        assert f"accepted {r['num_accepted']} of {len(r['draft_token_ids'])}" in text
        assert f"drafts at positions {r['first_draft_position']}–" in text
        assert sampled_line(r) in text          # "Sampled tokens": every token, from the runner's snapshot
    # the drafts proposed after this step: real ids, read from the next step's record
    assert "read from the next step's record" in text
    for ids in late[step + 1]["scheduled_spec_decode_tokens"].values():
        assert all(f"{t} " in text for t in ids)


def test_verified_drafts_of_an_async_run_are_its_late_records(async_draft_run):
    import msgspec

    from vllm_anatomy.tracing.reader import open_run
    late = async_draft_run["late"]
    with open_run(async_draft_run["path"]) as run:
        for s in run.steps():
            assert run.step_snapshot(s).scheduler.step_record.spec_decode == []     # verified after launch
            got = msgspec.to_builtins(run.verified_drafts(s))
            assert got == (late[s]["spec_decode"] if s in late else [])


def test_verified_drafts_of_a_sync_run_are_its_step_records(spec_run):
    import msgspec

    from vllm_anatomy.tracing.reader import open_run
    with open_run(spec_run["path"]) as run:
        got = {s: msgspec.to_builtins(run.verified_drafts(s)) for s in run.steps()}
    assert {s: r for s, r in got.items() if r} == spec_run["records"]


def test_lesson_10_reads_an_async_runs_verifications(async_draft_run):
    """Lesson 10's run reader on an async draft-model run: every verified step, from the late
    records (the step records of an async run are empty); the target drafting for itself, greedy:
    every draft accepted at every position."""
    import msgspec

    from tests.lessons.test_lesson_texts import _lesson
    lesson = _lesson("10_speculative_decoding.py")
    facts = lesson.read(async_draft_run["path"])
    facts["run"].close()
    expected = {s: r["spec_decode"] for s, r in async_draft_run["late"].items() if r["spec_decode"]}
    assert expected, "the async run verified drafts"
    assert {s: msgspec.to_builtins(r) for s, r in facts["spec_steps"].items()} == expected
    assert lesson.acceptance_per_position(facts["verifications"]) == [1.0] * lesson.K
