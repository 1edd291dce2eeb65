"""The Self-test page (issue 16, item 1), headless (AppTest): each of the article's five
questions is answered with the open run's own values, and the values shown are the ones
this test computes from the run store itself (snapshots and spans, read here with the
reader, not with the dashboard's code). Two runs: the shipped GPU sample (recorded
before block-pool events named their request: the page derives what it needs) and the
CPU fixture run recorded by tests/dashboard/conftest.py (events attributed). Every
"show me" button opens the step, inspector tab and request it names."""
from __future__ import annotations

import math
import os
import re

import pytest

from dashboard.words import agree, n_of
from tests.dashboard.conftest import APP, GPU_SAMPLE

RUNS = ["gpu", "cpu"]


def ids(xs) -> str:
    return "[" + ", ".join(str(x) for x in xs) + "]"


@pytest.fixture(scope="module")
def runs(recorded_run):
    """run key -> (trace dir, samples dir, run name, path)."""
    _, path = recorded_run
    out = {"cpu": (os.path.dirname(path), None, os.path.basename(path), path)}
    if os.path.exists(GPU_SAMPLE):
        out["gpu"] = (os.path.dirname(path), os.path.dirname(GPU_SAMPLE), os.path.basename(GPU_SAMPLE),
                       GPU_SAMPLE)
    return out


@pytest.fixture(scope="module")
def store(runs):
    """run key -> everything this test reads from the run store."""
    from vllm_anatomy.tracing.reader import open_run
    out = {}
    for key, (_, _, _, path) in runs.items():
        with open_run(path) as run:
            steps = run.steps()
            out[key] = {"steps": steps, "snap": {i: run.snapshot(i) for i in steps},
                        "mr": {i: run.snapshot(i, "model_runner") or {} for i in steps},
                        "spans": run.spans(), "requests": {s.request_id: s for s in run.requests()},
                        "meta": run.meta}
    return out


@pytest.fixture(scope="module")
def pages(runs, tmp_path_factory):
    """run key -> the Self-test page opened on it (one AppTest per run, shared by the tests)."""
    from streamlit.testing.v1 import AppTest
    out = {}
    for key, (trace_dir, samples, name, _) in runs.items():
        os.environ["VLLM_ANATOMY_TRACE_DIR"] = trace_dir
        os.environ["VLLM_ANATOMY_SAMPLES_DIR"] = samples or str(tmp_path_factory.mktemp("no_samples"))
        at = AppTest.from_file(APP, default_timeout=120)
        at.query_params.update({"run": name, "page": "selftest"})
        out[key] = at.run()
        assert not at.exception, [e.value for e in at.exception]
    return out


def answer_text(at, n: int) -> str:
    """The n-th (1-based) question's answer paragraph."""
    answers = [m.value for m in at.markdown if m.value.startswith("**Answer, from this run (")]
    assert len(answers) == 5, [m.value[:80] for m in at.markdown]
    return answers[n - 1]


def _req_at(text: str) -> tuple[str, int]:
    m = re.match(r"\*\*Answer, from this run \(request (\S+) at step (\d+)\)", text)
    assert m, text[:120]
    return m[1], int(m[2])


def _prev(steps, s):
    return steps[steps.index(s) - 1]


def _setup(runs, key):
    if key not in runs:
        pytest.skip("samples/h100-smollm2-full.sqlite not shipped")
    trace_dir, samples, _, _ = runs[key]
    os.environ["VLLM_ANATOMY_TRACE_DIR"] = trace_dir
    if samples:
        os.environ["VLLM_ANATOMY_SAMPLES_DIR"] = samples


@pytest.mark.parametrize("key", RUNS)
def test_every_question_quoted_and_answered(runs, pages, key):
    _setup(runs, key)
    at = pages[key]
    text = "\n".join(m.value for m in at.markdown)
    for zh in ("从 Scheduler.schedule() 到 KV 块被分配", "GPUModelRunner._update_states 做什么",
               "block table 是怎么进到 attention kernel 的", "一个请求完成时 Scheduler 与 KVCacheManager 各做什么",
               "同一个请求的“五笔账”各是什么"):
        assert zh in text, zh
    assert len([m for m in at.markdown if m.value.startswith("**Answer, from this run (")]) == 5
    assert not at.warning, [w.value for w in at.warning]      # both runs can answer all five


@pytest.mark.parametrize("key", RUNS)
def test_q1_allocation_chain(runs, pages, store, key):
    _setup(runs, key)
    s = store[key]
    text = answer_text(pages[key], 1)
    req, step = _req_at(text)
    snap = s["snap"][step]
    rec = snap["scheduler"]["step_record"]
    ent = next(e for e in rec["scheduled"] if str(e["request_id"]) == req)
    hit = next((h["hit_block_ids"] for h in rec["prefix_hits"] if str(h["request_id"]) == req), [])
    new = [b for b in ent["new_block_ids"] if b not in hit]
    events = snap["block_pool_events"]
    if events and "call" in events[0]:
        mine = [e for e in events if e["request_id"] == req and e["call"] == "allocate_slots"]
    else:
        mine = [e for e in events if e["kind"] == "allocate" and e["block_ids"] == new] + \
               [e for e in events if e["kind"] == "evict" and set(e["block_ids"]) <= set(new)]
    alloc = next(e for e in mine if e["kind"] == "allocate")
    assert alloc["block_ids"] == new
    assert f"popped **{ids(new)}** from the free queue's head" in text
    # Those blocks were free before the step (held by nobody in the previous step's pool) or freed in it.
    prev = s["snap"][_prev(s["steps"], step)]["scheduler"]["kv_cache"]
    freed_here = {b for e in events if e["kind"] == "free" for b in e["block_ids"]}
    assert all(b in prev["free_queue"] or b in freed_here for b in new)
    evicted = [b for e in mine if e["kind"] == "evict" for b in e["block_ids"]]
    if evicted:
        assert f"evicting the cached hash of {ids(evicted)}" in text
    so = snap["scheduler_output"]
    new_req = next((r for r in so["scheduled_new_reqs"] if str(r["req_id"]) == req), None)
    if new_req is not None:
        assert new_req["block_ids"][0] == hit + new and "`NewRequestData.block_ids`" in text
    else:
        c = so["scheduled_cached_reqs"]
        got = c["new_block_ids"][[str(r) for r in c["req_ids"]].index(req)][0]
        assert got == (hit + new if ent["kind"] == "resumed" else new) and "`CachedRequestData.new_block_ids`" in text
    bs = s["meta"]["config"]["cache_config"]["block_size"]
    need = math.ceil((ent["num_computed_tokens_before"] + ent["num_tokens"]) / bs)
    assert f"= {need} blocks" in "\n".join(m.value for m in pages[key].markdown)


@pytest.mark.parametrize("key", RUNS)
def test_q2_update_states(runs, pages, store, key):
    _setup(runs, key)
    s = store[key]
    text = answer_text(pages[key], 2)
    step = int(re.search(r"In \*\*step (\d+)\*\*", text)[1])
    prev = _prev(s["steps"], step)
    before = {r["index"]: r for r in s["mr"][prev]["input_batch"]["rows"]}
    after = {r["index"]: r for r in s["mr"][step]["input_batch"]["rows"]}
    b_req = {r["req_id"]: i for i, r in before.items()}
    a_req = {r["req_id"]: i for i, r in after.items()}
    removed = [r for r, _ in sorted(b_req.items(), key=lambda x: x[1]) if r not in a_req]
    added = [r for r, _ in sorted(a_req.items(), key=lambda x: x[1]) if r not in b_req]
    moves = s["mr"][step]["input_batch"]["condense_moves"]
    so = s["snap"][step]["scheduler_output"]
    c = so["scheduled_cached_reqs"]
    appended = {str(r) for r, nb in zip(c["req_ids"], c["new_block_ids"]) if nb and r not in c["resumed_req_ids"]}
    moved = {after[d]["req_id"] for _, d in moves}
    kept = [r for r, i in a_req.items() if b_req.get(r) == i and r not in appended | moved | set(added)]
    assert f"turned the {n_of(len(before), 'row')} of step {prev} into {n_of(len(after), 'row')}" in text
    assert f"**{len(removed)} removed** {ids(removed)}" in text
    assert f"**{len(added)} added** {ids(added)}" in text
    assert f"block ids appended to {n_of(len(appended), 'request')}," in text
    assert f"**{n_of(len(moves), 'condense move')}**" in text
    k = len(kept)
    assert (f"{k} of {n_of(len(after), 'row')} {agree(k, 'was', 'were')} **kept as {agree(k, 'it was', 'they were')}** "
            f"(same row, same token ids and block table: only {agree(k, 'its', 'their')} num_computed_tokens") in text
    # the moves the page names carry the request that was in the source row
    for a, b in moves:
        assert before.get(a, after[b])["req_id"] == after[b]["req_id"] or after[b]["req_id"] in added


@pytest.mark.parametrize("key", RUNS)
def test_q3_block_table_to_kernel(runs, pages, store, key):
    _setup(runs, key)
    s = store[key]
    text = answer_text(pages[key], 3)
    step = int(re.search(r"In \*\*step (\d+)\*\*", text)[1])
    req, pos = re.search(r"Request \*\*(\S+)\*\* decodes one token at position (\d+)", text).groups()
    pi = s["mr"][step]["prepare_inputs"]
    bs = s["meta"]["config"]["cache_config"]["block_size"]
    i = [str(r) for r in pi["req_ids"]].index(req)
    row = next(r for r in s["mr"][step]["input_batch"]["rows"] if str(r["req_id"]) == req)
    seq_len = pi["seq_lens"][i]
    n = math.ceil(seq_len / bs)
    walked = row["block_ids"][:n]
    slot = pi["slot_mapping"][pi["query_start_loc"][i]]
    assert pi["positions"][pi["query_start_loc"][i]] == int(pos) == seq_len - 1
    assert slot == walked[int(pos) // bs] * bs + int(pos) % bs
    assert f"`seq_len` = {seq_len}, so the kernel walks ⌈{seq_len} / {bs}⌉ = **{n} blocks** {ids(walked)}" in text
    assert f"**slot {slot}** = block {slot // bs} × {bs} + offset {slot % bs}" in text
    assert f"`seq_lens` {ids(pi['seq_lens'])}, `query_start_loc` {ids(pi['query_start_loc'])}" in text


@pytest.mark.parametrize("key", RUNS)
def test_q4_finish_and_reuse(runs, pages, store, key):
    _setup(runs, key)
    s = store[key]
    text = answer_text(pages[key], 4)
    req, step = re.search(r"Request \*\*(\S+)\*\* finished in \*\*step (\d+)\*\*", text).groups()
    step = int(step)
    steps, snap = s["steps"], s["snap"]
    queued = lambda i: {str(r["request_id"]) for r in snap[i]["scheduler"]["running"] + snap[i]["scheduler"]["waiting"]}  # noqa: E731
    prev = _prev(steps, step)
    assert req in queued(prev) and req not in queued(step)          # update_from_output of `step` finished it
    held = snap[prev]["scheduler"]["kv_cache"]["req_to_block_ids"][req]
    cand = [step] + [x for x in steps if x > step][:1]
    ev, fstep = next((e, i) for i in cand for e in snap[i]["block_pool_events"] if e["kind"] == "free" and (
        (e.get("request_id") == req and e.get("call") == "free") if "call" in e else set(held) <= set(e["block_ids"])))
    assert ev["block_ids"][-1] == held[0]                            # reverse order: the first block last
    blocks = {b["block_id"]: b for b in snap[fstep]["scheduler"]["kv_cache"]["blocks"]}
    after = ev.get("ref_cnts") or [blocks[b]["ref_cnt"] for b in ev["block_ids"]]
    freed = [b for b, r in zip(ev["block_ids"], after) if r == 0]
    shared = [b for b, r in zip(ev["block_ids"], after) if r > 0]
    assert f"**{ids(freed)}** reached ref_cnt 0 and joined the free queue" in text
    if shared:
        assert f"**{ids(shared)}** stayed held" in text
    if ev.get("queue_ends") is not None:          # recorded: hashed blocks went to the tail, the others to the front
        for b, end, r in zip(ev["block_ids"], ev["queue_ends"], after):
            assert (end is None) == (r > 0)
    # (from the free event on: with async scheduling a step's own schedule() may take a block freed in it)
    after_free = lambda i: snap[i]["block_pool_events"][  # noqa: E731
        (snap[i]["block_pool_events"].index(ev) + 1 if i == fstep else 0):]
    later = [(i, e) for i in steps if i >= fstep for e in after_free(i)
             if e["kind"] in ("hit", "allocate") and set(e["block_ids"]) & set(freed)]
    if later:
        assert f"first in **step {later[0][0]}**" in text
    else:
        assert "None of them was reused" in text


@pytest.mark.parametrize("key", RUNS)
def test_q5_five_accounts(runs, pages, store, key):
    _setup(runs, key)
    s = store[key]
    at = pages[key]
    text = answer_text(at, 5)
    req = re.search(r"Request \*\*(\S+)\*\* \(", text)[1]
    span = s["requests"][req]
    ev = {}
    for e in span.events:
        ev.setdefault(e["name"], []).append(e["time_ns"])
    ttft = (ev["FIRST_TOKEN"][0] - ev["QUEUED"][0]) / 1e6
    queue = (ev["SCHEDULED"][0] - ev["QUEUED"][0]) / 1e6
    md = "\n".join(m.value for m in at.markdown)
    assert f"**TTFT {ttft:,.1f} ms**" in md and f"queue {queue:,.1f} ms" in md
    peak = max(len(s["snap"][i]["scheduler"]["kv_cache"]["req_to_block_ids"].get(req, [])) for i in s["steps"])
    assert f"({peak} blocks, peak at step" in md
    # CPU: host ms of the four control-plane spans on the steps that scheduled this request
    mine = {i for i in s["steps"] if any(str(x["request_id"]) == req
                                         for x in s["snap"][i]["scheduler"]["step_record"]["scheduled"])}
    step_of = {sp.trace_id: sp.step_id for sp in s["spans"] if sp.name == "EngineCore.step"}
    names = ("Scheduler.schedule", "GPUModelRunner._update_states", "GPUModelRunner._prepare_inputs",
             "Scheduler.update_from_output")
    total = sum(sp.duration_ns for sp in s["spans"] if sp.name in names and step_of.get(sp.trace_id) in mine) / 1e6
    assert f"of {total:,.2f}" in md
    # communication: one device, no collective counted on its steps
    counts = [sp.attributes.get("vllm_anatomy.num_all_reduce") for sp in s["spans"]
              if sp.name == "Worker.execute_model" and step_of.get(sp.trace_id) in mine]
    if not any(counts):
        assert "**0 collectives**" in md
    # request: its first status and step, and its finish
    first = min(i for i in s["steps"] if req in {str(r["request_id"]) for r in
                                                 s["snap"][i]["scheduler"]["running"] + s["snap"][i]["scheduler"]["waiting"]})
    status = next(r["status"] for r in s["snap"][first]["scheduler"]["running"] + s["snap"][first]["scheduler"]["waiting"]
                  if str(r["request_id"]) == req)
    assert f"{status} @ {first}" in md and "FINISHED" in md
    assert "Why no single number suffices" in md


@pytest.mark.parametrize("key", RUNS)
def test_show_me_lands(runs, pages, key):
    """Each question's first "show me" opens the page, step, tab and request it names."""
    from streamlit.testing.v1 import AppTest

    from dashboard.components.tabs import TABS
    _setup(runs, key)
    _, _, name, _ = runs[key]
    base = pages[key]
    for q in range(1, 6):
        btn = base.button(key=f"show_q{q}_0")
        link_md = next((m.value for m in base.markdown if "— opens" in m.value), "")
        assert link_md
        at = AppTest.from_file(APP, default_timeout=120)
        at.query_params.update({"run": name, "page": "selftest"})
        at.run()
        b = at.button(key=btn.key)
        label = b.help or ""
        at = b.click().run()
        assert not at.exception, [e.value for e in at.exception]
        step = int(re.search(r"step (\d+)", label)[1])
        assert at.session_state["cursor"] == step, (q, label)
        page = "Request journey" if label.startswith("Request journey") else "Step inspector"
        assert at.title[0].value == page, (q, label)
        tab = re.search(r"(Scheduler|KV cache|Worker \(model runner\)) tab", label)
        if tab:
            assert at.session_state["tab"] == tab[1] and tab[1] in TABS.values(), (q, label)
        r = re.search(r"request (\S+)$", label)
        if r:
            assert at.session_state["request"] == r[1], (q, label)


@pytest.mark.parametrize("key", RUNS)
def test_q5_weights_say_in_words_when_the_run_lacks_them(runs, pages, store, key):
    """Found at 1440x900 on the H100 sample: Q5's memory account read "weights — MB" (its model's files are
    on the recording machine, and the run meta has no model_weight_bytes). A number missing before a unit
    is said in words; a run that has the figure shows it in MB."""
    _setup(runs, key)
    at = pages[key]
    text = "\n".join([m.value for m in at.markdown] + [c.value for c in at.caption]
                     + [str(v) for t in at.table for v in t.value.to_numpy().ravel()]
                     + [str(v) for t in at.dataframe for v in t.value.to_numpy().ravel()])
    assert not re.search(r"— ?(MB|ms|GB|blocks)\b", text), [ln for ln in text.splitlines() if re.search(r"— ?MB", ln)]
    from dashboard.answers.source import weight_bytes_of
    weights, where = weight_bytes_of(store[key]["meta"])
    if weights is None:
        assert "weights not recorded in this run" in text and where in text
    else:
        assert re.search(r"weights [\d,]+ MB", text), text[:400]


def test_q5_weights_come_from_the_run_meta(tmp_path):
    """The engine records model_weight_bytes (one rank's loaded weights) in the run meta: Q5's memory
    account shows them in MB, from the meta alone (the model's files are nowhere here). The shipped GPU
    sample is copied and its meta given the figure (SmolLM2-135M's bf16 weights); the sample is untouched."""
    import json
    import shutil
    import sqlite3

    from dashboard.answers import q5_accounts
    from dashboard.answers.source import RunSource
    if not os.path.exists(GPU_SAMPLE):
        pytest.skip("the GPU sample is not shipped")
    copy = tmp_path / "weights.sqlite"
    shutil.copy(GPU_SAMPLE, copy)
    with sqlite3.connect(copy) as db:
        db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", ("model_weight_bytes", json.dumps(134_515_008 * 2)))
        db.execute("UPDATE meta SET value = ? WHERE key = 'model'", (json.dumps("/nowhere/SmolLM2-135M"),))
    a = q5_accounts.answer(RunSource(str(copy)))
    assert a.ok and "weights 257 MB" in a.summary and "not recorded" not in a.summary, a.summary
    assert "Weights: recorded in the run meta." in a.notes, a.notes


def test_the_answers_read_a_steps_scheduler_output_one_way():
    """RunSource.scheduler_output(step) is the one reader of a step's SchedulerOutput for the Self-test
    answers (dashboard/answers/): q1_allocation and q2_update_states still spelled out
    `(src.snap(s) or {}).get("scheduler_output", {})` and `snap.get("scheduler_output", {})`."""
    import pathlib
    answers = pathlib.Path(__file__).resolve().parents[2] / "dashboard" / "answers"
    spelled = [f"{p.name}:{i}" for p in sorted(answers.glob("*.py")) if p.name != "source.py"
               for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"""\.get\(["']scheduler_output""", line)]
    assert not spelled, spelled
