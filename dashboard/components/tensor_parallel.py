"""Tensor parallelism in one step, in the article's terms: how many ranks, how many
collectives and why that many (2 all-reduces per decoder layer — after o_proj and after
down_proj — plus 1 for the vocab-parallel embedding), set against the article's "160
all-reduces per step" (§九 Q5: 2 × 80 layers of a 70B-class model split across GPUs),
and what they cost each rank this step.

    tp_facts(src, step)       the numbers (None for a run without tensor parallelism)
    all_reduce_formula(n, L)  "61 = 2 × 30 layers + 1 (the embedding)"
    tp_line(facts)            one line for above the inspector's tabs
    tp_panel(facts)           the Worker tab's panel: per rank, collectives vs forward

Counts come from rank 0's `Worker.execute_model` span (`vllm_anatomy.num_all_reduce`, ...);
per-rank times from the step's `GroupCoordinator.*` spans (trace level full) and each
rank's `GPUModelRunner._model_forward`.
"""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.answers.source import RunSource
from dashboard.components.code_ref import code_ref

ARTICLE_ALL_REDUCES = 160       # §九 Q5 通信账: 每步 160 次 all-reduce
ARTICLE_LAYERS = 80             # a 70B-class Llama (Llama-2-70B: 80 decoder layers)


def all_reduce_formula(n: int, layers: int | None) -> str:
    """Why a step makes `n` all-reduces: 2 per decoder layer, and what is left over."""
    if not layers:
        return f"{n}"
    rest = n - 2 * layers
    tail = "" if rest == 0 else f" + {rest} (the vocab-parallel embedding)" if rest == 1 else f" + {rest}"
    return f"{n} = 2 × {layers} layers{tail}"


def article_line(n: int | None, layers: int | None) -> str:
    """This run's count against the article's 160."""
    ours = f"this run: **{all_reduce_formula(n, layers)}**" if n is not None else "this run: not recorded"
    return (f"{ours} — the article's **{ARTICLE_ALL_REDUCES} = 2 × {ARTICLE_LAYERS} layers** (a 70B-class model "
            "split across GPUs); both are 2 per layer: one after `o_proj` (attention's row-parallel output) and one "
            "after `down_proj` (the MLP's)")


def tp_facts(src: RunSource, step: int) -> dict | None:
    """Ranks, collectives and their cost in `step`; None unless the run is tensor-parallel."""
    if src.tp <= 1:
        return None
    rank0 = {p for p, r in src.ranks.items() if r == 0}
    counts: dict[str, tuple[int, int]] = {}
    for w in src.spans("Worker.execute_model"):
        if w.attributes.get("vllm_anatomy.step_id") == step and (not rank0 or w.pid in rank0):
            for op in ("all_reduce", "all_gather", "broadcast"):
                if f"vllm_anatomy.num_{op}" in w.attributes:
                    counts[op] = (int(w.attributes[f"vllm_anatomy.num_{op}"] or 0),
                                  int(w.attributes.get(f"vllm_anatomy.{op}_bytes") or 0))
            break
    per_rank: dict[int, dict] = {}
    for s in src.spans_of_step(step):
        rank = src.ranks.get(s.pid)
        if rank is None:
            continue
        row = per_rank.setdefault(rank, {"rank": rank, "pid": s.pid, "collectives": 0, "collective ms": 0.0,
                                         "forward ms": 0.0})
        if s.name.startswith("GroupCoordinator."):
            row["collectives"] += 1
            row["collective ms"] += s.duration_ns / 1e6
        elif s.name == "GPUModelRunner._model_forward":
            row["forward ms"] += s.duration_ns / 1e6
    layers = (src.mr(step) or {}).get("num_kv_cache_layers")
    return {"tp": src.tp, "step": step, "counts": counts, "layers": int(layers) if layers else None,
            "per_rank": [per_rank[r] for r in sorted(per_rank)]}


def tp_line(f: dict) -> str:
    n = f["counts"].get("all_reduce", (None, 0))[0]
    return (f":material/call_split: **Tensor parallel over {f['tp']} ranks**: every rank holds 1/{f['tp']} of each "
            f"layer's weights and runs the same step on its slice; this step made "
            f"{all_reduce_formula(n, f['layers']) if n is not None else 'collectives not recorded'} all-reduces "
            "on every rank — the *Worker* tab compares them with the article's 160.")


def forward_share(collective_ms: float, forward_ms: float) -> str:
    """"37%": a rank's collective time over its `_model_forward` time; a rank without that span this step
    says so, not "—"."""
    return f"{collective_ms / forward_ms:.0%}" if forward_ms else "no _model_forward span on this rank"


def tp_panel(f: dict) -> None:
    ar, ag = f["counts"].get("all_reduce"), f["counts"].get("all_gather")
    st.markdown(f"**Tensor parallelism** · {f['tp']} ranks · step {f['step']}")
    st.markdown(article_line(ar[0] if ar else None, f["layers"]) + "."
                + (f" Each rank hands {ar[1] / 2 ** 20:.2f} MB to its all-reduces this step" if ar else "")
                + (f", and {ag[0]} all-gather ({ag[1] / 2 ** 20:.2f} MB) assembles the logits of the vocabulary "
                   "slices (ParallelLMHead)" if ag and ag[0] else "") + ".")
    if f["per_rank"]:
        df = pd.DataFrame(f["per_rank"])
        df["share of forward"] = [forward_share(c, fw) for c, fw in zip(df["collective ms"], df["forward ms"])]
        df["collective ms"] = df["collective ms"].map(lambda v: f"{v:,.1f}")
        df["forward ms"] = df["forward ms"].map(lambda v: f"{v:,.1f}")
        st.table(df.astype(str), border="horizontal", hide_index=True)
        st.caption("Per rank: its collective spans (GroupCoordinator.*, trace level full) and its `_model_forward`. "
                   "A collective waits for the slowest rank, so the ranks' shares differ; on GPUs NCCL moves the "
                   "bytes over NVLink, on a CPU gloo over TCP on 127.0.0.1.")
    code_ref("vllm_anatomy/distributed/communication_op.py", "tensor_model_parallel_all_reduce")
