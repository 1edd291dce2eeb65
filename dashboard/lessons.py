"""The article's concepts, each found in the current run: a finder picks the first
step (or the most telling one) that shows the concept, from the per-step table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd


@dataclass
class Lesson:
    key: str
    title: str
    idea: str
    look_at: str
    page: str
    find: Callable[[pd.DataFrame], int | None]


def _first(mask_fn: Callable[[pd.DataFrame], pd.Series]) -> Callable[[pd.DataFrame], int | None]:
    def find(df: pd.DataFrame) -> int | None:
        hit = df[mask_fn(df)]
        return int(hit["step"].iloc[0]) if not hit.empty else None
    return find


def _argmax(col: str) -> Callable[[pd.DataFrame], int | None]:
    def find(df: pd.DataFrame) -> int | None:
        return int(df.loc[df[col].idxmax(), "step"]) if not df.empty and df[col].max() > 0 else None
    return find


def _graph_step(df: pd.DataFrame) -> int | None:
    """The first padded CUDA graph replay, else the first replay (None on CPU runs)."""
    if "cudagraph_mode" not in df:
        return None
    full = df[df["cudagraph_mode"] == "FULL"]
    padded = full[full["cudagraph_padding"] > 0]
    pick = padded if not padded.empty else full
    return int(pick["step"].iloc[0]) if not pick.empty else None


LESSONS = [
    Lesson("admit", "WAITING → RUNNING: the scheduler admits a request",
           "A new request waits in the FCFS queue until schedule() gives it tokens from the budget and "
           "allocate_slots() gives it KV blocks.", "the state machine and the waiting/running queues",
           "inspector", _first(lambda d: d["num_scheduled"] > 0)),
    Lesson("chunked", "Chunked prefill: a prompt longer than the remaining budget",
           "max_num_batched_tokens caps a step; a long prompt is prefilled over several steps and only its "
           "last chunk samples a token.", "the token-budget bar (hatched chunk) and `sampled` in prepare_inputs",
           "inspector", _first(lambda d: d["chunked"])),
    Lesson("mixed", "Continuous batching: prefill and decode in the same step",
           "There are no prefill and decode phases: each step mixes new chunks with one-token decodes.",
           "the budget bar's mix of chunk kinds", "inspector", _first(lambda d: d["mixed"])),
    Lesson("prefix", "Prefix caching: full blocks found by hash",
           "A block filled with the same tokens after the same prefix has the same hash; a new request "
           "reuses it (ref_cnt grows) instead of recomputing.", "H events and shared (*) blocks in the KV tab",
           "inspector", _first(lambda d: d["hit_tokens"] > 0)),
    Lesson("nofree", "Admission stops: no free KV blocks",
           "When allocate_slots() refuses the head of the waiting queue, FCFS stops admitting.",
           "why admission stopped, under the budget bar", "inspector",
           _first(lambda d: d["stop_reason"] == "no_free_blocks")),
    Lesson("budget", "Admission stops: token budget spent",
           "RUNNING requests are served first; whatever budget is left goes to waiting requests.",
           "why admission stopped", "inspector", _first(lambda d: d["stop_reason"] == "budget_exhausted")),
    Lesson("preempt", "Preemption: RUNNING → PREEMPTED → WAITING",
           "A running request that needs a block when none is free evicts the newest running request: its "
           "blocks are freed and it will be recomputed.", "the lit RUNNING → PREEMPTED edge and F events",
           "inspector", _first(lambda d: d["preempted"] > 0)),
    Lesson("resume", "Resuming a preempted request (recompute)",
           "A preempted request comes back through the waiting queue and prefills again (prefix hits help).",
           "the `resumed` chunk and resumed_req_ids in SchedulerOutput", "inspector", _first(lambda d: d["resumed"])),
    Lesson("finish", "A request finishes: blocks go back to the free queue",
           "Freed blocks join the free queue's tail, still hashed: they stay prefix-cache hits until evicted.",
           "finished_req_ids and the free queue order", "inspector", _first(lambda d: d["finished"] > 0)),
    Lesson("condense", "InputBatch condense: rows stay dense",
           "When a request leaves the persistent batch, the last row moves into its hole.",
           "condense moves in the Worker tab", "inspector", _first(lambda d: d["condense_moves"] > 0)),
    Lesson("evict", "Eviction: a cached block is reused for new data",
           "Allocating pops the free queue's head; if it still had a hash, that cache entry is evicted.",
           "E events in the KV tab", "inspector", _first(lambda d: d["evictions"] > 0)),
    Lesson("fullest", "The KV cache at its fullest",
           "Usage is the fraction of blocks held by requests; near 100% admissions stop and preemption looms.",
           "the block-pool grid", "inspector", _argmax("kv_usage")),
    Lesson("slots", "SchedulerOutput → tensors: slot_mapping",
           "prepare_inputs turns scheduled token counts and block tables into positions, query_start_loc "
           "and slot_mapping (slot = block_id × block_size + offset).", "the slot_mapping plot in the Worker tab",
           "inspector", _argmax("tokens")),
    Lesson("cudagraph", "CUDA graphs: a pure-decode step replays a captured graph, padded",
           "A batch of B one-token decodes is padded to the next captured size N ≥ B and replays that size's "
           "graph in one call; padding rows have slot -1 and query_len 0. A step with a prefill chunk runs eager.",
           "the forward-pass line and the device lane in the Worker tab (GPU runs only: open the GPU sample)",
           "inspector", lambda d: _graph_step(d)),
    Lesson("sync", "Control plane and data plane: the sync point",
           "The CPU schedules and prepares inputs; the device runs the forward pass; _bookkeeping_sync is "
           "where the CPU waits for sampled tokens.", "the sync markers on the timeline", "timeline",
           _argmax("tokens")),
]
