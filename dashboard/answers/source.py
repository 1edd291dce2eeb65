"""What the self-test answers read: one run store, through tracing/reader.py.

`RunSource(path)` reads the run's meta, steps and request spans, and fails there, with
RunSourceError (its message is what the pages show), when the run store's spans cannot be
read; everything else is read when asked. Every read goes through `open_run`
(read-only) and is kept for the life of the object (the page keeps one per run
version in st.cache_resource). The dashboard may hand it the tables it has
already built (data.step_scan, data.queue_statuses); without them it builds the
same from the snapshots itself (tests, small runs).
"""
from __future__ import annotations

import functools
import math
import os
import sqlite3
from typing import Any

from vllm_anatomy.tracing.reader import TraceStoreError, open_run

# Where an event came from, by kind (BlockPool methods; v0.27.1 names).
EVENT_METHOD = {"hit": "BlockPool.touch", "evict": "BlockPool._maybe_evict_cached_block",
                "allocate": "BlockPool.get_new_blocks", "cache": "BlockPool.cache_full_blocks",
                "free": "BlockPool.free_blocks", "reset": "BlockPool.reset_prefix_cache"}


def tensor_parallel_size(meta: dict) -> int:
    """The run's TP size from its config (world_size in runs recorded before tensor_parallel_size)."""
    pc = (meta.get("config") or {}).get("parallel_config") or {}
    return int(pc.get("tensor_parallel_size") or pc.get("world_size") or 1)


def worker_ranks(meta: dict) -> dict[int, int]:
    """pid -> tensor-parallel rank of each worker process, from the run meta ({} before it had them)."""
    return {int(r["pid"]): int(r["rank"]) for r in meta.get("ranks") or [] if "pid" in r and "rank" in r}


class RunSourceError(TraceStoreError):
    """A run store whose spans cannot be read (a damaged page, a dropped table): the message names the
    file and SQLite's reason, as spans.request_table's RunError does."""


class RunSource:
    def __init__(self, path: str, scan: dict | None = None, statuses: dict | None = None) -> None:
        self.path = path
        with open_run(path) as run:
            self.meta = run.meta
            self.steps: list[int] = run.steps()
            # NOTE: every answer reads spans: an unreadable spans table fails here, once, with a message,
            # not later as an SQLite error from whichever answer reads them first.
            try:
                reqs = run.requests()
            except (TraceStoreError, sqlite3.Error, OSError) as e:
                raise RunSourceError(f"{path}: cannot read request spans ({e})") from e
        self.requests: dict[str, Any] = {str(s.request_id or s.attributes.get("vllm_anatomy.request_id")): s
                                         for s in reqs}
        self._scan = scan if isinstance(scan, dict) else None
        self._statuses = statuses if isinstance(statuses, dict) else None
        cfg = self.meta.get("config") or {}
        self.block_size = int((cfg.get("cache_config") or {}).get("block_size") or 16)
        self.enable_caching = bool((cfg.get("cache_config") or {}).get("enable_prefix_caching", True))
        sc = cfg.get("scheduler_config") or {}
        self.async_scheduling = bool(sc.get("async_scheduling"))
        self.max_model_len = int(sc.get("max_model_len") or (cfg.get("model_config") or {}).get("max_model_len") or 0)
        pc = cfg.get("parallel_config") or {}
        self.backend = pc.get("distributed_executor_backend") or "uni"
        self.tp = tensor_parallel_size(self.meta)

    # -- snapshots --------------------------------------------------------------------------
    @functools.lru_cache(maxsize=256)
    def snap(self, step: int) -> dict | None:
        with open_run(self.path) as run:
            return run.snapshot(step)

    def scheduler_output(self, step: int) -> dict:
        """The step's SchedulerOutput as its snapshot recorded it ({} where none was)."""
        return (self.snap(step) or {}).get("scheduler_output") or {}

    @functools.lru_cache(maxsize=256)
    def mr(self, step: int) -> dict:
        with open_run(self.path) as run:
            return run.snapshot(step, "model_runner") or {}

    def prev_step(self, step: int) -> int | None:
        i = self.steps.index(step)
        return self.steps[i - 1] if i > 0 else None

    def next_step(self, step: int) -> int | None:
        i = self.steps.index(step)
        return self.steps[i + 1] if i + 1 < len(self.steps) else None

    def record(self, step: int) -> dict:
        if self._scan is not None and step in self._scan_index:
            return self._scan["records"][self._scan_index[step]]
        return (self.snap(step) or {}).get("scheduler", {}).get("step_record", {})

    def events(self, step: int) -> list[dict]:
        if self._scan is not None and step in self._scan_index:
            return self._scan["events"][self._scan_index[step]]
        return (self.snap(step) or {}).get("block_pool_events") or []

    @functools.cached_property
    def _scan_index(self) -> dict[int, int]:
        return {s: i for i, s in enumerate(self._scan["steps"])} if self._scan else {}

    @functools.cached_property
    def statuses(self) -> dict[str, dict[int, str]]:
        """request id -> {step: status while in a queue} (as data.queue_statuses)."""
        if self._statuses is not None:
            return self._statuses
        out: dict[str, dict[int, str]] = {}
        for step in self.steps:
            sched = (self.snap(step) or {}).get("scheduler", {})
            for r in sched.get("waiting", []) + sched.get("running", []):
                out.setdefault(str(r["request_id"]), {})[step] = r["status"]
        return out

    @functools.cached_property
    def attributed(self) -> bool:
        """Does this run stamp block-pool events with their request and call?"""
        for step in self.steps:
            for e in self.events(step):
                return "call" in e
        return False

    # -- spans ------------------------------------------------------------------------------
    @functools.cached_property
    def step_spans(self) -> dict[int, Any]:
        with open_run(self.path) as run:
            return {s.step_id: s for s in run.spans("EngineCore.step") if s.step_id is not None}

    @functools.lru_cache(maxsize=64)
    def spans_of_step(self, step: int) -> list:
        """Every span of the step's trace (its EngineCore.step tree, all processes)."""
        root = self.step_spans.get(step)
        if root is None:
            return []
        with open_run(self.path) as run:
            return run.spans(where="trace_id = ?", args=(root.trace_id,))

    @functools.lru_cache(maxsize=8)
    def spans(self, name: str) -> list:
        with open_run(self.path) as run:
            return run.spans(name)

    @functools.cached_property
    def ranks(self) -> dict[int, int]:
        return worker_ranks(self.meta)

    @functools.cached_property
    def pids(self) -> dict[str, set[int]]:
        """process kind -> pids that wrote spans."""
        with open_run(self.path) as run:
            return run.processes()

    # -- what the pool looked like ------------------------------------------------------------
    def kv(self, step: int) -> dict:
        return (self.snap(step) or {}).get("scheduler", {}).get("kv_cache", {})

    def pool_replay(self, step: int) -> "PoolReplay | None":
        """The block pool as it was when `step` began, ready to replay that step's events: the
        previous step's snapshot; before the engine's first step (1), the fresh pool
        (PoolReplay.fresh); None where the step before is not recorded."""
        prev = self.prev_step(step)
        if prev is not None:
            return PoolReplay(self.kv(prev), self.enable_caching)
        if step == 1:
            return PoolReplay.fresh(int(self.kv(step).get("num_gpu_blocks") or 0), self.enable_caching)
        return None

    def blocks_of(self, step: int, req: str) -> list[int]:
        return list(self.kv(step).get("req_to_block_ids", {}).get(str(req), []))

    def weight_bytes(self) -> tuple[int | None, str]:
        """Bytes of the model's weights as the run held them (per rank), and where the number comes from."""
        return weight_bytes_of(self.meta, self.tp)


def weight_bytes_of(meta: dict, tp: int = 1) -> tuple[int | None, str]:
    """Bytes of a run's weights per rank, and where the number comes from: the run meta, else the model's
    safetensors, else (a load_format="dummy" run: no weights file) its config.json's parameter count."""
    recorded = meta.get("model_weight_bytes")
    if isinstance(recorded, (int, float)) and recorded > 0:
        return int(recorded), "recorded in the run meta"
    from dashboard.components.kv_memory import DTYPE_BYTES
    dtype = str(((meta.get("config") or {}).get("model_config") or {}).get("dtype") or "")
    nbytes = DTYPE_BYTES.get(dtype.replace("torch.", ""))
    model = str(meta.get("model") or "")
    params, where = _safetensors_params(model), "in the model's safetensors"
    if params is None:
        params, where = _config_params(model), "from the model's config.json (random weights: load_format dummy)"
    if params is None or not nbytes:
        return None, "not recorded in this run, and the model's files are not on this machine"
    return params * nbytes // max(tp, 1), (f"{params:,} parameters {where} × {nbytes} B "
                                           f"({dtype.replace('torch.', '')})" + (f" ÷ TP {tp}" if tp > 1 else ""))


def _config_params(model_dir: str) -> int | None:
    """A Llama-family config.json's parameter count (vllm_anatomy.model_executor.dummy_configs.num_parameters)."""
    import json

    from vllm_anatomy.model_executor.dummy_configs import num_parameters
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return num_parameters(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def _safetensors_params(model_dir: str) -> int | None:
    import json
    import struct
    total, found = 0, False
    try:
        names = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(model_dir, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for k, v in header.items():
            if k != "__metadata__":
                total += math.prod(v.get("shape") or [1])
                found = True
    return total if found else None


class PoolReplay:
    """The block pool's free queue, ref_cnt and hashes, replayed event by event from a
    step's snapshot (the state after that step) through the next step's events.

    Answers "which blocks did get_new_blocks pop, from where" and "which end did each
    freed block join" for runs whose events do not say it themselves. `ok` turns False
    (and `problem` says why) as soon as the replay disagrees with what was recorded
    (e.g. a pool too big to be snapshotted whole)."""

    def __init__(self, kv: dict, enable_caching: bool) -> None:
        self.queue: list[int] = list(kv.get("free_queue", []))
        self.ref = {b["block_id"]: b["ref_cnt"] for b in kv.get("blocks", [])}
        self.hash = {b["block_id"]: b.get("hash") for b in kv.get("blocks", [])}
        self.caching = enable_caching
        self.sparse = bool(kv.get("sparse"))
        self.ok, self.problem = True, ""

    @classmethod
    def fresh(cls, num_gpu_blocks: int, enable_caching: bool) -> "PoolReplay":
        """The pool before the run's first step: every block free, in id order, but block 0
        (BlockPool.__init__ queues them all, then takes the first as the null block)."""
        ids = list(range(1, num_gpu_blocks))
        return cls({"free_queue": ids, "blocks": [{"block_id": b, "ref_cnt": 0, "hash": None} for b in ids]},
                   enable_caching)

    def apply(self, e: dict) -> dict:
        """Apply one event; return what it did: {"popped": [...], "queue_before": [...], "ends": [...], ...}."""
        kind, ids = e["kind"], list(e["block_ids"])
        out: dict[str, Any] = {"queue_before": list(self.queue)}
        if kind == "hit":
            for b in ids:
                if b in self.queue:
                    self.queue.remove(b)
                self.ref[b] = self.ref.get(b, 0) + 1
        elif kind == "allocate":
            head = self.queue[:len(ids)]
            if head != ids and self.ok:
                self.ok, self.problem = False, (f"replayed free queue head {head} ≠ allocated {ids}"
                                                + (" (a sparse snapshot lists only the queue's head)" if self.sparse else ""))
            del self.queue[:len(ids)]
            for b in ids:
                self.ref[b] = 1
            out["popped"] = head
        elif kind == "evict":
            for b in ids:
                self.hash[b] = None
        elif kind == "cache":
            for b, h in zip(ids, e.get("block_hashes") or []):
                self.hash[b] = h
        elif kind == "free":
            before = [self.ref.get(b, 1) for b in ids]
            front, tail, after = [], [], []
            ends: list[str | None] = []          # per block: the free queue's end it went to, None = still held
            for b in ids:
                self.ref[b] = self.ref.get(b, 1) - 1
                after.append(self.ref[b])
                if self.ref[b] == 0:
                    if self.hash.get(b) is None and self.caching:
                        front.append(b)
                        ends.append("front")
                    else:
                        tail.append(b)
                        ends.append("tail")
                else:
                    ends.append(None)
            self.queue = front + self.queue + tail
            out.update(ref_before=before, ref_after=after, ends=ends,
                       hashes=[self.hash.get(b) for b in ids])
            if e.get("queue_ends") is not None and e["queue_ends"] != ends and self.ok:
                self.ok, self.problem = False, f"replayed free-queue ends {ends} ≠ recorded {e['queue_ends']}"
        elif kind == "reset":
            self.hash = {b: None for b in self.hash}
        return out
