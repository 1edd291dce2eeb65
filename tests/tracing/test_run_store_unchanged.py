"""The run store a traced run writes is what it was before deferred spans (tracing/deferred_span.py).

The same runs (a tiny random Llama on the CPU; levels spans and full; async
scheduling on and off; the engine in this process and in its own; requests of
several lengths, one with n=2, one aborted mid-way) are written to a run store
and reduced to a canonical form: every span with its name, kind, status,
service, process kind, attributes, events (name and attributes, in order) and
links (attributes in their order), its parent and the targets of its links
named by canonical labels instead of ids, and the span_details rows; the snapshots by (step, kind,
process kind). Ids, pids, times and the one duration attribute are left out.
A label is the span's name, step id and request id under its parent's (or
cause's) label, numbered by start time among equals.

tests/tracing/data/run_store_canonical_7221d6f.json.gz holds that form as the
code before deferred spans (7221d6f) wrote it: the runs now must give the same.
To write it again (only for a change that means to change the trace), with the
code that should write it on PYTHONPATH:
    VLLM_ANATOMY_WRITE_RUN_STORE_GOLDEN=1 python -m pytest tests/tracing/test_run_store_unchanged.py
"""
from __future__ import annotations

import collections
import gzip
import json
import os
import sqlite3

import pytest

from vllm_anatomy import LLM, SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "run_store_canonical_7221d6f.json.gz")
# Attributes whose values are durations: kept as present, not compared.
TIMED_ATTRIBUTES = {"vllm_anatomy.sync_wait_ms"}
FOLLOWS_FROM = {"opentracing.ref_type": "follows_from"}
CONFIGS = {
    "spans-async": dict(level="spans", async_scheduling=True, multiprocess=False),
    "spans-sync": dict(level="spans", async_scheduling=False, multiprocess=False),
    "full-async": dict(level="full", async_scheduling=True, multiprocess=False),
    "spans-sync-engine-process": dict(level="spans", async_scheduling=False, multiprocess=True),
}


def _prompt(n: int, seed: int) -> dict:
    return {"prompt_token_ids": [(seed * 31 + 7 * j) % 480 + 20 for j in range(n)]}


def run_workload(model_dir: str, trace_dir: str, level: str, async_scheduling: bool, multiprocess: bool) -> str:
    """Drive one engine through the same steps every time; return its run store's path.

    NOTE: in this process the frontend's step() is the engine's, so requests can be added and
    aborted between given steps. An engine process steps on its own: there one request runs
    at a time (what shares a step with what would depend on timing)."""
    llm = LLM(model_dir, max_model_len=256, num_gpu_blocks_override=96, max_num_seqs=8,
              trace_level=level, trace_dir=trace_dir, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    path = engine.recorder.run_path
    greedy = dict(temperature=0, ignore_eos=True)

    def finish() -> None:
        while engine.has_unfinished_requests():
            engine.step()
    try:
        if multiprocess:
            engine.add_request("a", _prompt(12, 1), SamplingParams(max_tokens=6, **greedy))
            finish()
            engine.add_request("b", _prompt(30, 2), SamplingParams(max_tokens=3, **greedy))
            finish()
        else:
            engine.add_request("a", _prompt(12, 1), SamplingParams(max_tokens=6, **greedy))
            engine.add_request("b", _prompt(30, 2), SamplingParams(max_tokens=3, **greedy))
            engine.add_request("pair", _prompt(9, 3), SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4,
                                                                     ignore_eos=True))
            engine.add_request("gone", _prompt(15, 4), SamplingParams(max_tokens=50, **greedy))
            for _ in range(3):
                engine.step()
            engine.abort_request(["gone"])
            engine.add_request("late", _prompt(20, 5), SamplingParams(max_tokens=5, **greedy))
            finish()
    finally:
        engine.shutdown()
        llm.shutdown()
    assert path is not None
    return path


def canonical_run(path: str) -> dict:
    """The run store at `path` without ids, pids and times (see the module docstring)."""
    con = sqlite3.connect(path)
    try:
        rows = con.execute("SELECT trace_id, span_id, parent_id, name, kind, start_ns, attributes, events, links, "
                           "status, service, process_kind, step_id, request_id FROM spans").fetchall()
        details = {(t, s): rest for t, s, *rest in con.execute(
            "SELECT trace_id, span_id, scope_name, scope_version, status_message FROM span_details")}
        snapshots = con.execute("SELECT step_id, kind, process FROM snapshots").fetchall()
        meta_keys = sorted(k for (k,) in con.execute("SELECT key FROM meta") if not k.startswith("resource."))
    finally:
        con.close()
    spans = {(r[0], r[1]): r for r in rows}

    def cause_of(row: tuple) -> tuple | None:
        links = json.loads(row[8])
        if not row[2] and links and links[0]["attributes"] == FOLLOWS_FROM:
            return links[0]["trace_id"], links[0]["span_id"]
        return None

    def origin(row: tuple) -> tuple | None:
        """The span this one hangs under: its parent, or (a follower) its cause."""
        return (row[0], row[2]) if row[2] else cause_of(row)

    depth: dict[tuple, int] = {}

    def depth_of(key: tuple) -> int:
        if key not in depth:
            up = origin(spans[key])
            depth[key] = depth_of(up) + 1 if up in spans else 0
        return depth[key]

    labels: dict[tuple, str] = {}

    def name_of(key: tuple | None) -> str | None:
        if key is None:
            return None
        return labels.get(key, "external")

    # NOTE: parents (and causes) get their labels first; equals under one parent are numbered by start time.
    for level in sorted(set(map(depth_of, spans))):
        groups: dict[tuple, list[tuple]] = collections.defaultdict(list)
        for key, row in spans.items():
            if depth[key] == level:
                attrs = json.loads(row[6])
                base = (name_of(origin(row)), row[3], attrs.get("vllm_anatomy.step_id"),
                        attrs.get("vllm_anatomy.request_id"))
                groups[base].append(key)
        for base, keys in groups.items():
            keys.sort(key=lambda k: spans[k][5])
            for i, key in enumerate(keys):
                labels[key] = "/".join(map(str, base[1:])) + (f"#{i}" if len(keys) > 1 else "") + \
                    (f" < {base[0]}" if base[0] else "")

    out = []
    for key, row in spans.items():
        # (attributes as [key, value] pairs: their order is part of what was written)
        attrs = [[k, "<duration>" if k in TIMED_ATTRIBUTES else v] for k, v in json.loads(row[6]).items()]
        out.append({
            "label": labels[key], "parent": name_of((row[0], row[2])) if row[2] else None,
            "name": row[3], "kind": row[4], "attributes": attrs,
            "events": [[e["name"], list(e["attributes"].items())] for e in json.loads(row[7])],
            "links": [[name_of((lk["trace_id"], lk["span_id"])), list(lk["attributes"].items())]
                      for lk in json.loads(row[8])],
            "status": row[9], "service": row[10], "process_kind": row[11], "step_id": row[12],
            "request_id": row[13], "details": details.get(key),
        })
    out.sort(key=lambda s: s["label"])
    kinds = {process: process.rsplit("-", 1)[0] for _, _, process in snapshots}
    return {"spans": out, "meta_keys": meta_keys,
            "snapshots": sorted(collections.Counter((s, k, kinds[p]) for s, k, p in snapshots).items())}


def _golden() -> dict:
    with gzip.open(GOLDEN, "rt") as f:
        return json.load(f)


def _normalised(canonical: dict) -> dict:
    """As JSON would give it back (tuples as lists)."""
    return json.loads(json.dumps(canonical))


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_run_store_is_what_it_was(tiny_llama_dir, tmp_path, monkeypatch, config):
    settings = CONFIGS[config]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if settings["multiprocess"] else "0")
    path = run_workload(tiny_llama_dir, str(tmp_path), settings["level"], settings["async_scheduling"],
                        settings["multiprocess"])
    got = _normalised(canonical_run(path))
    if os.environ.get("VLLM_ANATOMY_WRITE_RUN_STORE_GOLDEN"):
        golden = _golden() if os.path.exists(GOLDEN) else {}
        golden[config] = got
        with gzip.open(GOLDEN, "wt") as f:
            json.dump(golden, f, indent=0, sort_keys=True)
        pytest.skip(f"wrote {config} into {GOLDEN}")
    expected = _golden()[config]
    assert len(got["spans"]) == len(expected["spans"])
    for mine, theirs in zip(got["spans"], expected["spans"]):
        assert mine == theirs
    assert got == expected


def test_canonical_form_tells_a_changed_trace(tiny_llama_dir, tmp_path, monkeypatch):
    """The comparison can fail: a renamed span, a lost attribute, a lost link are all seen."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = run_workload(tiny_llama_dir, str(tmp_path), "spans", True, False)
    before = canonical_run(path)
    con = sqlite3.connect(path)
    with con:
        (rowid, attrs, links), = con.execute(
            "SELECT rowid, attributes, links FROM spans WHERE name = 'EngineCore.step' ORDER BY start_ns LIMIT 1")
        con.execute("UPDATE spans SET links = ? WHERE rowid = ?", (json.dumps(json.loads(links)[1:]), rowid))
    assert canonical_run(path) != before
    with con:
        con.execute("UPDATE spans SET links = ? WHERE rowid = ?", (links, rowid))
        con.execute("UPDATE spans SET attributes = ? WHERE rowid = ?",
                    (json.dumps({k: v for k, v in json.loads(attrs).items() if k != "vllm_anatomy.num_reqs"}), rowid))
    assert canonical_run(path) != before
    with con:
        con.execute("UPDATE spans SET attributes = ? WHERE rowid = ?", (attrs, rowid))
        con.execute("UPDATE spans SET name = 'Scheduler.plan' WHERE name = 'Scheduler.schedule'")
    assert canonical_run(path) != before
    con.close()
