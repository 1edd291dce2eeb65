"""The snapshot builders (trace level full) give exactly what a rebuild from scratch gives.

tracing's KVCacheSnapshotter keeps caches from one snapshot to the next
(block-id lists, per-block rows) and must equal the plain
KVCacheManager.snapshot(); the worker's builders gather arrays in bulk. Here
the straightforward builders are the references, and every snapshot of a real
run (preemption, prefix hits, chunked prefill, finished and aborted requests, a
prefix-cache reset), and of random KV-manager operations, is compared with
them: same keys, same values, same order. A snapshot must also
stay as it was recorded: the recorder keeps the returned objects, so one that
shared a list the engine still edits would change after the fact.
"""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from vllm_anatomy.core import kv_cache_manager as kcm
from vllm_anatomy.core.kv_cache_manager import KVCacheManager
from tests.unit.core_utils import new_kv_cache_manager
from vllm_anatomy.core.kv_cache_utils import get_request_block_hasher, sha256
from vllm_anatomy.core.request import Request
from vllm_anatomy.core.sched.scheduler import Scheduler
from vllm_anatomy.sampling_params import SamplingParams
from vllm_anatomy.tracing.kv_snapshotter import KVCacheSnapshotter
from vllm_anatomy.tracing.recorder import InMemoryRecorder
from vllm_anatomy.worker.block_table import BlockTable
from vllm_anatomy.worker.gpu_input_batch import InputBatch
from vllm_anatomy.worker.gpu_model_runner import GPUModelRunner


# -- the reference builders: every value recomputed from the live state --------
def reference_kv_snapshot(m: KVCacheManager) -> dict:
    """The plain snapshot, called on the class: never an incremental one."""
    return KVCacheManager.snapshot(m)


def reference_request_snapshot(req: Request, block_ids: list[int]) -> dict:
    return {"request_id": req.request_id, "status": req.status.name, "num_tokens": req.num_tokens,
            "num_computed_tokens": req.num_computed_tokens, "num_prompt_tokens": req.num_prompt_tokens,
            "num_output_tokens": req.num_output_tokens, "num_output_placeholders": req.num_output_placeholders,
            "num_stale_output_tokens": req.num_stale_output_tokens,
            "num_preemptions": req.num_preemptions, "num_cached_tokens": req.num_cached_tokens,
            "block_ids": block_ids, "spec_token_ids": list(req.spec_token_ids)}


def reference_scheduler_snapshot(s: Scheduler, kv_cache: dict | None = None) -> dict:
    kv = reference_kv_snapshot(s.kv_cache_manager)
    tables = kv["req_to_block_ids"]
    return {"step_id": s.current_step, "max_num_batched_tokens": s.max_num_scheduled_tokens,
            "max_num_seqs": s.max_num_running_reqs,
            "waiting": [reference_request_snapshot(r, tables.get(r.request_id, [])) for r in s.waiting],
            "running": [reference_request_snapshot(r, tables.get(r.request_id, [])) for r in s.running],
            "skipped_waiting": [reference_request_snapshot(r, tables.get(r.request_id, []))
                                for r in s.skipped_waiting],
            "step_record": s.last_step_record.to_dict() if s.last_step_record else None,
            "kv_cache": kv}


def reference_block_table_snapshot(bt: BlockTable, num_reqs: int | None = None) -> dict:
    if num_reqs is None:
        nonzero = [r for r in range(bt.max_num_reqs) if bt.num_blocks_per_row[r]]
        num_reqs = nonzero[-1] + 1 if nonzero else 0
    return {"block_size": bt.block_size, "max_num_blocks_per_req": bt.max_num_blocks_per_req,
            "rows": [bt.block_table_np[r, :bt.num_blocks_per_row[r]].tolist() for r in range(num_reqs)]}


def reference_input_batch_snapshot(b: InputBatch) -> dict:
    rows = []
    for i, req_id in enumerate(b._req_ids):
        if req_id is None:
            continue
        n = int(b.block_table.num_blocks_per_row[i])
        rows.append({"index": i, "req_id": req_id, "num_tokens": int(b.num_tokens_no_spec[i]),
                     "num_prompt_tokens": int(b.num_prompt_tokens[i]),
                     "num_computed_tokens": int(b.num_computed_tokens_cpu[i]),
                     "block_ids": b.block_table.block_table_np[i, :n].tolist()})
    return {"num_reqs": b.num_reqs, "rows": rows, "condense_moves": [list(m) for m in b.last_condense_moves]}


def reference_runner_snapshot(r: GPUModelRunner) -> dict:
    return {"input_batch": reference_input_batch_snapshot(r.input_batch), "prepare_inputs": r.last_prepare_inputs,
            "cached_requests": [{"req_id": q, "num_tokens": s.num_tokens, "num_computed_tokens": s.num_computed_tokens,
                                 "in_batch": q in r.input_batch.req_id_to_index} for q, s in r.requests.items()],
            "kv_cache_shape": list(r.kv_caches[0].shape) if r.kv_caches else None,
            "num_kv_cache_layers": len(r.kv_caches)}


def assert_same(got, want, what: str) -> None:
    """Equal, and in the same order (dict equality ignores key order)."""
    assert got == want, what
    assert json.dumps(got) == json.dumps(want), f"{what}: same values, another order"


# -- random operations on one KV manager -----------------------------------------
BS = 4


def _request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=64), block_hasher=get_request_block_hasher(BS, sha256))


def _admit_chunk(m: KVCacheManager, req: Request, rng: random.Random) -> bool:
    """Schedule the next chunk of req (prefix lookup first if it holds nothing)."""
    hits, num_hits, _ = (m.get_computed_blocks(req) if req.num_computed_tokens == 0 else (None, 0, 0))
    remaining = req.num_tokens - req.num_computed_tokens - num_hits
    n = max(1, min(remaining, rng.randint(1, 12)))
    if m.allocate_slots(req, n, num_hits, hits) is None:
        return False
    req.num_computed_tokens += num_hits + n
    return True


def _run_random_ops(m: KVCacheManager, seed: int, num_ops: int) -> int:
    rng = random.Random(seed)
    snapshotter = KVCacheSnapshotter(m)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    held: dict[str, Request] = {}     # requests holding blocks
    idle: list[Request] = []          # preempted / finished: may come back
    checked = 0
    for step in range(num_ops):
        op = rng.random()
        if op < 0.3 or not held:
            req = (idle.pop(rng.randrange(len(idle))) if idle and rng.random() < 0.3 else
                   _request(f"r{step}", rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]))
            if _admit_chunk(m, req, rng):
                held[req.request_id] = req
            else:
                m.free(req)
                idle.append(req)
        elif op < 0.7:
            req = rng.choice(list(held.values()))
            if req.num_computed_tokens == req.num_tokens:          # a decode: one more token
                req.append_output_token_ids(rng.randrange(50))
            if req.num_tokens >= 50 or not _admit_chunk(m, req, rng):   # finished, or preempted
                m.free(req)
                req.num_computed_tokens = 0
                idle.append(held.pop(req.request_id))
        elif op < 0.85:
            req = held.pop(rng.choice(list(held)))
            m.free(req)
            req.num_computed_tokens = 0
            idle.append(req)
        elif op < 0.9 and rng.random() < 0.3:
            for req in held.values():
                m.free(req)
                req.num_computed_tokens = 0
            idle.extend(held.values())
            held.clear()
            assert m.reset_prefix_cache()
        elif op < 0.95:
            m.take_block_pool_events()                                        # someone else drains the events
        if rng.random() < 0.5:
            assert_same(snapshotter.snapshot(), m.snapshot(), f"seed {seed}, op {step}")
            checked += 1
    return checked


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("seed", range(6))
def test_kv_snapshot_matches_a_rebuild_under_random_operations(monkeypatch, sparse, seed):
    if sparse:
        # A pool past the dense limit, small enough to fill: shrink the limits.
        monkeypatch.setattr(kcm, "SNAPSHOT_DENSE_MAX_BLOCKS", 12)
        monkeypatch.setattr(kcm, "SNAPSHOT_FREE_QUEUE_HEAD", 3)
    m = new_kv_cache_manager(24, BS, 60, record_block_pool_events=seed % 2 == 0, enable_caching=True)
    assert m.snapshot()["sparse"] is sparse and KVCacheSnapshotter(m).snapshot()["sparse"] is sparse
    assert _run_random_ops(m, seed, 400) > 100


def test_kv_snapshot_of_a_large_sparse_pool_matches_a_rebuild():
    m = new_kv_cache_manager(kcm.SNAPSHOT_DENSE_MAX_BLOCKS + 200, BS, 60, record_block_pool_events=True,
                             enable_caching=True)
    assert _run_random_ops(m, 7, 400) > 100 and m.snapshot()["sparse"]


def test_kv_snapshot_is_not_changed_by_later_steps():
    m = new_kv_cache_manager(24, BS, 60, record_block_pool_events=True, enable_caching=True)
    a = _request("a", list(range(10)))
    snapshotter = KVCacheSnapshotter(m)
    assert _admit_chunk(m, a, random.Random(0))
    snaps = [m.snapshot(), snapshotter.snapshot()]
    before = [json.dumps(snap) for snap in snaps]
    a.num_computed_tokens = a.num_tokens
    a.append_output_token_ids([1, 2, 3, 4])
    m.allocate_slots(a, 4)
    m.free(a)
    m.snapshot()
    snapshotter.snapshot()
    assert [json.dumps(snap) for snap in snaps] == before


# -- a real run, every step -------------------------------------------------------
class JSONAtRecordTime(InMemoryRecorder):
    """Keeps each snapshot's JSON as it was when recorded, to compare at the end."""

    def __init__(self) -> None:
        super().__init__("full")
        self.recorded_json: list[str] = []

    def snapshot(self, kind, data, step_id=None) -> None:
        super().snapshot(kind, data, step_id)
        self.recorded_json.append(json.dumps(data, default=str))


@pytest.fixture
def compare_builders(monkeypatch):
    """Wrap the builders: each call is checked against its reference. Returns the call counts."""
    calls: Counter = Counter()

    def check(cls, name, reference):
        real = getattr(cls, name)

        def checked(self, *args, **kwargs):
            got = real(self, *args, **kwargs)
            assert_same(got, reference(self, *args, **kwargs), f"{cls.__name__}.{name}, call {calls[name]}")
            calls[name] += 1
            return got
        monkeypatch.setattr(cls, name, checked)

    check(Scheduler, "snapshot", reference_scheduler_snapshot)

    # NOTE: whether or not the engine builds its KV snapshot incrementally, one
    # incremental snapshotter per run follows every step here.
    snapshotters: dict[int, KVCacheSnapshotter] = {}
    checked_scheduler_snapshot = Scheduler.snapshot

    def with_incremental_kv(self, *args, **kwargs):
        got = checked_scheduler_snapshot(self, *args, **kwargs)
        manager = self.kv_cache_manager
        snapshotter = snapshotters.setdefault(id(manager), KVCacheSnapshotter(manager))
        assert_same(snapshotter.snapshot(), reference_kv_snapshot(manager), f"KVCacheSnapshotter, call {calls['kv']}")
        calls["kv"] += 1
        return got
    monkeypatch.setattr(Scheduler, "snapshot", with_incremental_kv)
    check(GPUModelRunner, "snapshot", reference_runner_snapshot)

    real_runner_snapshot = GPUModelRunner.snapshot

    def with_block_table(self):
        bt = self.input_batch.block_table
        assert_same(bt.snapshot(), reference_block_table_snapshot(bt), "BlockTable.snapshot()")
        n = self.input_batch.num_reqs
        assert_same(bt.snapshot(n), reference_block_table_snapshot(bt, n), "BlockTable.snapshot(num_reqs)")
        return real_runner_snapshot(self)
    monkeypatch.setattr(GPUModelRunner, "snapshot", with_block_table)
    return calls


def _run(model_dir: str, num_gpu_blocks: int, async_scheduling: bool, num_requests: int = 10) -> JSONAtRecordTime:
    from vllm_anatomy import LLM
    rec = JSONAtRecordTime()
    # Block size 8, a 48-token budget (prompts up to ~90 tokens: chunked prefill).
    llm = LLM(model_dir, device="cpu", recorder=rec, block_size=8, max_model_len=160, max_num_seqs=6,
              max_num_batched_tokens=48, num_gpu_blocks_override=num_gpu_blocks, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(40)]

    def add(i: int) -> None:
        prompt = prefix + [rng.randrange(3, 500) for _ in range(rng.randint(3, 50))]
        engine.add_request(f"q{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=rng.randint(4, 30), ignore_eos=True))

    def drain(abort_at: int | None = None) -> None:
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps == abort_at:
                engine.abort_request(["q3", "q4"])

    add(0)
    drain()                                             # caches the prefix
    for i in range(1, num_requests):
        add(i)
    drain(abort_at=12)
    assert engine.engine_core.scheduler.reset_prefix_cache()
    add(num_requests)
    drain()
    engine.shutdown()
    return rec


def _check_run(rec: JSONAtRecordTime, calls: Counter, sparse: bool, preempted: bool) -> None:
    steps = [data for kind, _, data in rec.snapshots if kind == "step"]
    assert calls["snapshot"] >= 2 * len(steps) > 40          # Scheduler and GPUModelRunner, every step
    assert calls["kv"] >= len(steps)
    kv_caches = [s["scheduler"]["kv_cache"] for s in steps]
    assert all(kv["sparse"] is sparse for kv in kv_caches)
    records = [s["scheduler"]["step_record"] for s in steps]
    assert any(r["prefix_hits"] for r in records)
    assert any(r["preempted_req_ids"] for r in records) is preempted
    assert any(c["kind"] == "prefill_chunk" for r in records for c in r["scheduled"])
    # Nothing recorded changed afterwards (no list shared with live state).
    assert [json.dumps(d, default=str) for _, _, d in rec.snapshots] == rec.recorded_json


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_run_dense_pool(tiny_llama_dir, compare_builders, async_scheduling):
    # 31 usable blocks of 8 tokens, six requests of up to ~120 tokens: preemption.
    rec = _run(tiny_llama_dir, 32, async_scheduling)
    _check_run(rec, compare_builders, sparse=False, preempted=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_run_sparse_pool_that_fills(tiny_llama_dir, compare_builders, monkeypatch, async_scheduling):
    # The same small pool made "sparse" by lowering the limits: sparse listing under preemption.
    monkeypatch.setattr(kcm, "SNAPSHOT_DENSE_MAX_BLOCKS", 16)
    monkeypatch.setattr(kcm, "SNAPSHOT_FREE_QUEUE_HEAD", 4)
    rec = _run(tiny_llama_dir, 32, async_scheduling)
    _check_run(rec, compare_builders, sparse=True, preempted=True)


def test_run_large_sparse_pool(tiny_llama_dir, compare_builders):
    rec = _run(tiny_llama_dir, kcm.SNAPSHOT_DENSE_MAX_BLOCKS + 904, async_scheduling=False)
    _check_run(rec, compare_builders, sparse=True, preempted=False)
