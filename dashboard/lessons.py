"""The article's concepts, each found in the current run: a finder picks the step
(and, where one request is the point, that request) that shows the concept, and the
card opens exactly what its text says to look at: the page, the inspector tab, the
request.

Finders read the per-step table (data.step_table), the step records
(data.step_records: who was scheduled, preempted, hit the prefix cache) and where
each request was after each step (data.queue_statuses). A request "finishes" at the
first step whose snapshot no longer has it in a queue: that step's update_from_output
finished it and freed its blocks (its F events), as the inspector's state machine
shows; the next step's SchedulerOutput.finished_req_ids only tells the worker.

Each card names the CLI lessons (lessons/NN_*.py, `vllm-anatomy lesson N`) that
provoke the same idea on purpose and check it; the CLI lessons point back here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from dashboard.answers.q4_finish import last_scheduled, left_queues

# The CLI lessons (lessons/NN_*.py): number -> (file, what it does).
CLI_LESSONS = {
    1: ("01_four_domains.py", "the four domains and the two keys (request_id, block_id)"),
    2: ("02_state_machine.py", "the request state machine, every transition provoked for real"),
    3: ("03_schedule_token_budget.py", "schedule() and the single token budget, chunked prefill"),
    4: ("04_prefix_caching.py", "prefix caching: chained hashes, shared blocks, where freed blocks go"),
    5: ("05_prepare_inputs.py", "SchedulerOutput → tensors: slot_mapping, block_table, condense"),
    6: ("06_step_timeline.py", "one step's timeline and its single sync point"),
    7: ("07_call_chain.py", "the call chain from HTTP to the forward, across three processes"),
    8: ("08_latency_table.py", "the latency-magnitude table, measured on your hardware"),
    9: ("09_self_test.py", "the article's self-test, answered from a recorded trace"),
    10: ("10_speculative_decoding.py", "speculative decoding: fewer rounds, longer rounds (ngram, draft model)"),
}


@dataclass
class Facts:
    """What the finders read: the per-step table, the step records and the queues."""
    df: pd.DataFrame
    records: dict[int, dict] = field(default_factory=dict)
    statuses: dict[str, dict[int, str]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)    # request -> finish reason (stop, length, abort)
    tp: int = 1                                              # the run's tensor_parallel_size

    def finishes(self) -> list[tuple[int, str]]:
        """(step, request) for every request that finished in the recorded steps, in step order
        (q4_finish.left_queues: one the queues never showed finished where it was last scheduled)."""
        steps = sorted(self.records) or [int(s) for s in self.df["step"]]
        unseen = {req for req in self.reasons if req not in self.statuses}
        return left_queues(steps, self.statuses, last_scheduled(sorted(self.records.items()), unseen))


Found = tuple[int | None, str | None]


@dataclass
class Lesson:
    key: str
    title: str
    idea: str
    look_at: str
    page: str
    find: Callable[[Facts], Found]
    tab: str | None = None                  # the inspector tab the card opens (dashboard/components/nav.py: TABS)
    cli: tuple[int, ...] = ()               # CLI lessons on the same idea


def _first(mask_fn: Callable[[pd.DataFrame], pd.Series]) -> Callable[[Facts], Found]:
    def find(f: Facts) -> Found:
        hit = f.df[mask_fn(f.df)]
        return (int(hit["step"].iloc[0]), None) if not hit.empty else (None, None)
    return find


def _argmax(col: str) -> Callable[[Facts], Found]:
    def find(f: Facts) -> Found:
        df = f.df
        return (int(df.loc[df[col].idxmax(), "step"]), None) if not df.empty and df[col].max() > 0 else (None, None)
    return find


def _scheduled(pred: Callable[[dict, dict], bool]) -> Callable[[Facts], Found]:
    """The first step with a scheduled entry s (of record rec) for which pred(s, rec) holds, and its request."""
    def find(f: Facts) -> Found:
        for step in sorted(f.records):
            rec = f.records[step]
            for s in rec.get("scheduled", []):
                if pred(s, rec):
                    return step, str(s["request_id"])
        return None, None
    return find


def _admitted(f: Facts) -> Found:
    """The first step where a request that waited (WAITING in an earlier step's queues) becomes
    RUNNING, and that request: the step whose state machine lights WAITING → RUNNING with the
    request in the waiting queue just before. Only when no request ever waited: the first one
    admitted in the step it arrived (the diagram lights arrival → WAITING → RUNNING then)."""
    waited: tuple[int, str] | None = None
    on_arrival: tuple[int, str] | None = None
    for req, seen in f.statuses.items():
        steps = sorted(seen)
        for i, b in enumerate(steps):
            if seen[b] == "RUNNING":
                if i > 0 and seen[steps[i - 1]] == "WAITING":
                    waited = min(waited or (b, req), (b, req))
                elif i == 0:
                    on_arrival = min(on_arrival or (b, req), (b, req))
                break
    return waited or on_arrival or (None, None)


def _preempted(f: Facts) -> Found:
    for step in sorted(f.records):
        ids = f.records[step].get("preempted_req_ids", [])
        if ids:
            return step, str(ids[0])
    return None, None


def _prefix_hit(f: Facts) -> Found:
    for step in sorted(f.records):
        for h in f.records[step].get("prefix_hits", []):
            if h.get("num_hit_tokens"):
                return step, str(h["request_id"])
    return None, None


def _finish(f: Facts) -> Found:
    """The first request that finished on its own (stop or length: update_from_output finished it), else
    the first that finished at all (an abort)."""
    done = f.finishes()
    own = [d for d in done if f.reasons.get(d[1]) in ("stop", "length")]
    first = own or done
    return first[0] if first else (None, None)


def _graph_step(f: Facts) -> Found:
    """The first padded CUDA graph replay, else the first replay (None on CPU runs)."""
    df = f.df
    if "cudagraph_mode" not in df:
        return None, None
    full = df[df["cudagraph_mode"] == "FULL"]
    padded = full[full["cudagraph_padding"] > 0]
    pick = padded if not padded.empty else full
    return (int(pick["step"].iloc[0]), None) if not pick.empty else (None, None)


def _tensor_parallel(f: Facts) -> Found:
    """A TP run's busiest step (every step of it has the collectives; None on one device)."""
    return _argmax("tokens")(f) if f.tp > 1 else (None, None)


LESSONS = [
    Lesson("admit", "WAITING → RUNNING: the scheduler admits a request",
           "A new request waits in the FCFS queue until schedule() gives it tokens from the budget and "
           "allocate_slots() gives it KV blocks.",
           "the lit WAITING → RUNNING edge of the state machine and the running queue (top of the page)",
           "inspector", _admitted, tab="scheduler", cli=(2, 3)),
    Lesson("chunked", "Chunked prefill: a prompt longer than the remaining budget",
           "max_num_batched_tokens caps a step; a long prompt is prefilled over several steps and only its "
           "last chunk samples a token.",
           "the ╱-hatched prefill_chunk in the token-budget bar (Scheduler tab); in the Worker tab its `sampled` "
           "is False in prepare_inputs", "inspector",
           _scheduled(lambda s, rec: s["kind"] == "prefill_chunk"), tab="scheduler", cli=(3,)),
    Lesson("mixed", "Continuous batching: prefill and decode in the same step",
           "There are no prefill and decode phases: each step mixes new chunks with one-token decodes.",
           "the budget bar's mix of chunk kinds (Scheduler tab)", "inspector", _first(lambda d: d["mixed"]),
           tab="scheduler", cli=(3,)),
    Lesson("prefix", "Prefix caching: full blocks found by hash",
           "A block filled with the same tokens after the same prefix has the same hash; a new request "
           "reuses it (ref_cnt grows) instead of recomputing.", "H events and shared (*) blocks in the KV tab",
           "inspector", _prefix_hit, tab="kv", cli=(4, 9)),
    Lesson("nofree", "Admission stops: no free KV blocks",
           "When allocate_slots() refuses the head of the waiting queue, FCFS stops admitting.",
           "why admission stopped, under the budget bar (Scheduler tab)", "inspector",
           _first(lambda d: d["stop_reason"] == "no_free_blocks"), tab="scheduler", cli=(2,)),
    Lesson("budget", "Admission stops: token budget spent",
           "RUNNING requests are served first; whatever budget is left goes to waiting requests.",
           "why admission stopped, under the budget bar (Scheduler tab)", "inspector",
           _first(lambda d: d["stop_reason"] == "budget_exhausted"), tab="scheduler", cli=(3,)),
    Lesson("preempt", "Preemption: RUNNING → PREEMPTED → WAITING",
           "A running request that needs a block when none is free evicts the newest running request: its "
           "blocks are freed and it will be recomputed.",
           "the lit RUNNING → PREEMPTED edge (top) and the F (free) events in the KV tab", "inspector",
           _preempted, tab="kv", cli=(2,)),
    Lesson("resume", "Resuming a preempted request (recompute)",
           "A preempted request comes back through the waiting queue and prefills again (prefix hits help).",
           "the ✕-hatched `resumed` chunk in the budget bar and `resumed` in scheduled_cached_reqs (Scheduler tab)",
           "inspector", _scheduled(lambda s, rec: s["kind"] == "resumed"), tab="scheduler", cli=(2,)),
    Lesson("finish", "A request finishes: blocks go back to the free queue",
           "update_from_output finishes it and frees its blocks: they join the free queue's tail, still hashed, "
           "and stay prefix-cache hits until evicted.",
           "the F (free) events and the free-queue order in the KV tab (the next step's "
           "SchedulerOutput.finished_req_ids tells the worker)", "inspector", _finish, tab="kv", cli=(2, 4)),
    Lesson("condense", "InputBatch condense: rows stay dense",
           "When a request leaves the persistent batch, the last row moves into its hole.",
           "the condense moves under the InputBatch table (Worker tab)", "inspector",
           _first(lambda d: d["condense_moves"] > 0), tab="worker", cli=(5, 9)),
    Lesson("evict", "Eviction: a cached block is reused for new data",
           "Allocating pops the free queue's head; if it still had a hash, that cache entry is evicted.",
           "E events in the KV tab", "inspector", _first(lambda d: d["evictions"] > 0), tab="kv", cli=(4, 9)),
    Lesson("fullest", "The KV cache at its fullest",
           "Usage is the fraction of blocks held by requests; near 100% admissions stop and preemption looms.",
           "the block-pool grid (KV tab)", "inspector", _argmax("kv_usage"), tab="kv", cli=(1, 2)),
    Lesson("slots", "SchedulerOutput → tensors: slot_mapping",
           "prepare_inputs turns scheduled token counts and block tables into positions, query_start_loc "
           "and slot_mapping (slot = block_id × block_size + offset).",
           "the slot_mapping grid and the block_id / offset rows of prepare_inputs (Worker tab)",
           "inspector", _argmax("tokens"), tab="worker", cli=(5, 9)),
    Lesson("cudagraph", "CUDA graphs: a pure-decode step replays a captured graph, padded",
           "A batch of B one-token decodes is padded to the next captured size N ≥ B and replays that size's "
           "graph in one call; padding rows have slot -1 and query_len 0. A step with a prefill chunk runs eager.",
           "the forward-pass line and the device lane in the Worker tab (GPU runs only: open the GPU sample)",
           "inspector", _graph_step, tab="worker", cli=(6,)),
    Lesson("sync", "Control plane and data plane: the sync point",
           "The CPU schedules and prepares inputs; the device runs the forward pass; _bookkeeping_sync is "
           "where the CPU waits for sampled tokens.", "the ▼ sync markers on the timeline", "timeline",
           lambda f: _graph_step(f) if _graph_step(f)[0] is not None else _argmax("tokens")(f), cli=(6,)),
    Lesson("tp", "Tensor parallelism: one SchedulerOutput, N ranks, all-reduces in every layer",
           "With tensor_parallel_size N the weights are split over N worker processes: QKV and gate_up by "
           "columns, o_proj and down_proj by rows, so each rank ends those two with a partial sum that an "
           "all-reduce joins (2 per layer, and the embedding's); the logits are all-gathered. The scheduler "
           "never knows: one SchedulerOutput is broadcast to every rank, and only rank 0 answers.",
           "a WorkerProc lane per rank and the broadcast ⑤ to each (Processes); each rank's "
           "GroupCoordinator.all_reduce spans (Timeline); the communication account (Self-test, Q5)",
           "processes", _tensor_parallel),
]
BY_KEY = {lesson.key: lesson for lesson in LESSONS}


def cards_for_cli(number: int) -> list[Lesson]:
    """The dashboard's lesson cards on the same idea as CLI lesson `number`."""
    return [lesson for lesson in LESSONS if number in lesson.cli]
