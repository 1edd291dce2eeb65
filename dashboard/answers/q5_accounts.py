"""Q5 — the five accounts of one request, from the run store, and why no single number
tells its story.

    time           queue, prefill, decode (ms), TTFT and ITL: the request's llm_request
                   span events (QUEUED, SCHEDULED, FIRST_TOKEN, FINISHED) and the end of
                   every step that gave it a token
    memory         its KV blocks at their peak, in MB (components/kv_memory.block_bytes),
                   against the whole pool and the model's weights (per rank)
    communication  collectives on the steps that served it (Worker.execute_model's
                   vllm_anatomy.num_all_reduce / all_reduce_bytes, when the run has them)
                   and the messages that crossed a process boundary (ZMQ, shared memory)
    CPU            host ms of Scheduler.schedule, GPUModelRunner._update_states and
                   _prepare_inputs, Scheduler.update_from_output on its steps, and its
                   share (by its scheduled tokens in each step)
    request        its status path with step numbers (the queues of every step)
"""
from __future__ import annotations

from typing import Any

from dashboard.answers.common import NOT_RECORDED, Answer, ShowMe, cannot
from dashboard.answers.source import RunSource
from dashboard.words import n_of

CPU_SPANS = {"Scheduler.schedule": "schedule", "GPUModelRunner._update_states": "_update_states",
             "GPUModelRunner._prepare_inputs": "_prepare_inputs", "Scheduler.update_from_output": "update_from_output"}
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")


def _events(span) -> dict[str, list[int]]:
    ev: dict[str, list[int]] = {}
    for e in span.events:
        ev.setdefault(e["name"], []).append(e["time_ns"])
    return ev


def candidates(src: RunSource) -> list[str]:
    """Requests with a finished llm_request span (a span is written when it ends)."""
    return sorted(src.requests, key=lambda r: (not r.isdigit(), int(r) if r.isdigit() else 0, r))


def default_request(src: RunSource, reqs: list[str]) -> str | None:
    """A preempted request if any (its accounts disagree the most), else the one with the most tokens out."""
    def score(r):
        sp = src.requests[r]
        return (len(_events(sp).get("PREEMPTED", [])), sp.attributes.get("gen_ai.usage.output_tokens") or 0)
    return max(reqs, key=score) if reqs else None


def _steps_of(src: RunSource, req: str) -> dict[int, dict]:
    """step -> its scheduled entry for this request."""
    out = {}
    for s in src.steps:
        for e in src.record(s).get("scheduled", []):
            if str(e["request_id"]) == req:
                out[s] = {**e, "step_tokens": sum(x["num_tokens"] for x in src.record(s)["scheduled"])}
    return out


def _status_path(src: RunSource, req: str, finish_step: int | None, reason: str | None) -> list[dict]:
    seen = src.statuses.get(req, {})
    path: list[dict] = []
    for s in sorted(seen):
        st = seen[s]
        if path and path[-1]["status"] == st:
            path[-1]["to step"] = s
        else:
            path.append({"status": st, "from step": s, "to step": s})
    if finish_step is not None:
        path.append({"status": f"FINISHED ({reason})" if reason else "FINISHED", "from step": finish_step,
                     "to step": finish_step})
    return path


def _peak_blocks(mine: dict[int, dict]) -> tuple[int, int | None]:
    """The most KV blocks the request held, and the step it first held them, from its
    scheduled records alone (no snapshot is read: a big run has ~240 KB per step): a
    request's first chunk and a resumed one list all its blocks, every other chunk
    the blocks it added."""
    held, peak, at = 0, 0, None
    for i, s in enumerate(sorted(mine)):
        e = mine[s]
        n = len(e.get("new_block_ids") or [])
        held = n if i == 0 or e["kind"] == "resumed" else held + n
        if held > peak:
            peak, at = held, s
    return peak, at


def answer(src: RunSource, req: str | None = None) -> Answer:
    reqs = candidates(src)
    if not reqs:
        return cannot("No request of this run has finished (llm_request spans are written when a request ends).")
    if req is None or str(req) not in reqs:
        req = default_request(src, reqs)
    req = str(req)
    span = src.requests[req]
    ev = _events(span)
    a = span.attributes
    n_in, n_out = a.get("gen_ai.usage.input_tokens"), a.get("gen_ai.usage.output_tokens") or 0
    reason = (a.get("gen_ai.response.finish_reasons") or [None])[0]
    queued = ev.get("QUEUED", [span.start_ns])[0]
    mine = _steps_of(src, req)
    time, token_steps = _time_account(src, span, ev, mine, n_in, n_out)
    mem, per_block, weights_from = _memory_account(src, mine)
    comm = _communication_account(src, mine, token_steps)
    cpu = _cpu_account(src, mine)
    finish_step = next((s for s, r in _finish_steps(src) if r == req), None)
    path = _status_path(src, req, finish_step, reason)
    engine_events = [{"event": e["name"], "ms since arrival": round(_ms(e["time_ns"] - queued), 2)}
                     for e in span.events]
    why = _why(time, mem, cpu, len(mine), len(ev.get("PREEMPTED", [])))
    rows = _rows(time, mem, comm, cpu, len(mine), path)
    summary = (f"Request **{req}** ({n_in} prompt tokens, {n_out} generated, {reason or '?'}): "
               + "; ".join(f"**{r['account']}** — {r['value']}" for r in rows[:2]) + ".")
    notes = [f"Weights: {weights_from}."]
    if not comm["have_counts"]:
        notes.append("Collective counts (vllm_anatomy.num_all_reduce on Worker.execute_model) are not in this run.")
    return Answer(
        ok=True, subject=f"request {req}", summary=summary,
        tables=_tables(rows, comm, cpu, path, engine_events),
        chain=[{"#": "why", "call": "no single number", "what happened here": w} for w in why],
        notes=notes, show_me=_show_me(req, mine, mem["at step"], comm["three"]),
        facts={"request": req, "time": time, "memory": mem, "collectives": comm["coll"],
               "have_counts": comm["have_counts"], "ipc": comm["ipc"], "cpu": cpu["rows"], "cpu_total": cpu["total"],
               "cpu_share": cpu["share"], "steps": sorted(mine), "path": path, "candidates": reqs, "why": why,
               "per_block": per_block})


def _ms(ns: float) -> float:
    return ns / 1e6


def _time_account(src: RunSource, span, ev: dict[str, list[int]], mine: dict[int, dict], n_in: int | None,
                  n_out: int) -> tuple[dict, list[int]]:
    """Queue, prefill, decode, TTFT, ITL and e2e (ms); and the steps that gave the request a token."""
    queued = ev.get("QUEUED", [span.start_ns])[0]
    sched = ev.get("SCHEDULED", [None])[0]
    first = ev.get("FIRST_TOKEN", [None])[0]
    fin = ev.get("FINISHED", [span.end_ns])[0]
    # Token times: the end of each step that gave it a token (decode, or the chunk that ends its prompt).
    token_steps = [s for s, e in mine.items() if e["kind"] in ("decode", "final_prefill_chunk")
                   or (e["kind"] == "resumed" and e.get("num_computed_tokens_before", 0) + e["num_tokens"]
                       >= (n_in or 0))]
    ends = [src.step_spans[s].end_ns for s in token_steps if s in src.step_spans]
    gaps = [_ms(b - x) for x, b in zip(ends, ends[1:])]
    # (ms figures, None where the request has none; "why none" below: the words for those)
    time: dict[str, Any] = {"queue ms": _ms(sched - queued) if sched else None,
                            "prefill ms": _ms(first - sched) if first and sched else None,
                            "decode ms": _ms(fin - first) if first else None,
                            "TTFT ms": _ms(first - queued) if first else None,
                            "ITL mean ms": _ms(fin - first) / (n_out - 1) if first and n_out > 1 else None,
                            "ITL max ms (step ends)": max(gaps) if gaps else None,
                            "e2e ms": _ms(span.end_ns - span.start_ns)}
    if n_out == 1:
        # NOTE: its one token is sampled by the step that ends its prompt, and FIRST_TOKEN and FINISHED
        # are both added in the OutputProcessor's one loop over that step's outputs: fin - first is
        # that loop's bookkeeping (0.2 ms on a CPU run), not a decode.
        time["decode ms"] = None
    time["why none"] = _why_none(time, n_out, scheduled=sched is not None, first_token=first is not None)
    return time, token_steps


ONE_TOKEN = "one output token"


def _why_none(time: dict, n_out: int, scheduled: bool, first_token: bool) -> dict[str, str]:
    """For each figure of the time account the request has none of, the words saying why.

    NOTE: a figure missing for a reason the request itself gives (never scheduled, one output token)
    says that reason; one missing from a request that should have it was lost on the way: "not
    recorded in this run"."""
    no_token = "none (no token generated)" if n_out == 0 else NOT_RECORDED
    not_scheduled = "none (never scheduled)" if n_out == 0 else NOT_RECORDED
    one_gap = f"none ({ONE_TOKEN}: no gap between two tokens)"
    reasons = {"queue ms": not_scheduled,
               "prefill ms": no_token if scheduled else not_scheduled,
               "decode ms": f"none ({ONE_TOKEN}, sampled by its prefill: no decode step)" if n_out == 1 else no_token,
               "TTFT ms": no_token,
               "ITL mean ms": one_gap if n_out == 1 else no_token,
               "ITL max ms (step ends)": (one_gap if n_out == 1 else no_token if n_out == 0 or not first_token
                                          else "none (fewer than two of its token steps in this run's spans)")}
    return {k: w for k, w in reasons.items() if time.get(k) is None}


def _memory_account(src: RunSource, mine: dict[int, dict]) -> tuple[dict, float | None, str]:
    """Its KV blocks at their peak against the pool and the weights; the bytes of a block; where the weights' size comes from."""
    from dashboard.components.kv_memory import MB, block_bytes, rank_block_bytes
    mr0 = src.mr(src.steps[0])
    per_block: float | None = block_bytes(src.meta, mr0, src.block_size)
    if src.tp > 1:
        # NOTE: the weights are one rank's (the article's "per GPU"), so the KV is too: a rank holds
        # its own KV heads of every block (its worker's kv_cache_shape; replicated heads when
        # TP > num_kv_heads), not the whole block the run meta's kv_cache_bytes_per_block counts.
        per_block = rank_block_bytes(src.meta, mr0) or (per_block / src.tp if per_block else None)
    peak_blocks, peak_step = _peak_blocks(mine)
    pool = (src.kv(src.steps[0]).get("num_gpu_blocks") or 0) - 1
    weights, weights_from = src.weight_bytes()
    mem = {"peak KV blocks": peak_blocks, "at step": peak_step,
           "KV MB": peak_blocks * per_block / MB if per_block else None,
           "pool MB": pool * per_block / MB if per_block else None, "pool blocks": pool,
           "weights MB": weights / MB if weights else None, "per rank": src.tp > 1}
    return mem, per_block, weights_from


def _communication_account(src: RunSource, mine: dict[int, dict], token_steps: list[int]) -> dict:
    """Collectives on the steps that served it, the messages that crossed a process boundary, and the text saying so."""
    from dashboard.components.kv_memory import MB
    coll = {op: [0, 0] for op in COLLECTIVES}
    have_counts = False
    served_traces = {src.step_spans[s].trace_id for s in mine if s in src.step_spans}
    # NOTE: every rank joins every collective: count one rank's (rank 0), as the article counts
    # "2 all-reduces per layer", not one per rank.
    rank0 = {pid for pid, r in src.ranks.items() if r == 0}
    for w in src.spans("Worker.execute_model"):
        if w.trace_id in served_traces and (not rank0 or w.pid in rank0):
            for op in COLLECTIVES:
                if f"vllm_anatomy.num_{op}" in w.attributes:
                    have_counts = True
                    coll[op][0] += int(w.attributes.get(f"vllm_anatomy.num_{op}") or 0)
                    coll[op][1] += int(w.attributes.get(f"vllm_anatomy.{op}_bytes") or 0)
    n_steps = len(mine)
    kinds = set(src.pids)
    three = "engine_core" in kinds
    shm = "worker" in kinds or src.backend == "mp"
    ipc = {"ZMQ messages (EngineCoreRequest in + EngineCoreOutputs out)": (1 + len(token_steps)) if three else 0,
           "shared-memory messages (execute_model, sample_tokens and their replies)": 4 * n_steps if shm else 0}
    if have_counts:
        comm_why = (f"{n_of(coll['all_reduce'][0], 'all-reduce')} ({coll['all_reduce'][1] / MB:.2f} MB handed to them by "
                    f"each rank) over the {n_of(n_steps, 'step')} that served it: {coll['all_reduce'][0] / max(n_steps, 1):.0f} "
                    f"per step (TP {src.tp}, each joined by all {src.tp} ranks); the steps serve its neighbours too, "
                    "so this is the traffic it shared.")
    else:
        comm_why = (f"0 collectives: tensor-parallel size {src.tp} — the model's weights live on one device, so every "
                    "layer's output is already whole there and nothing needs to be all-reduced. (The article's "
                    "160 all-reduces per step come from a model split across GPUs: 2 per layer.)")
    ipc_why = (("Three processes: its request crossed ZMQ once in, its outputs crossed it once per token step; "
                if three else "One frontend/engine process: no ZMQ hop; ")
               + ("each step crossed the shared-memory queue twice down and twice up." if shm
                  else "the worker is called in-process (UniProcExecutor): no shared-memory hop."))
    return {"coll": coll, "have_counts": have_counts, "ipc": ipc, "three": three, "text": comm_why + " " + ipc_why}


def _cpu_account(src: RunSource, mine: dict[int, dict]) -> dict:
    """Host ms of the CPU spans on its steps, in total and its share by scheduled tokens; its steps' time."""
    step_of = {sp.trace_id: s for s, sp in src.step_spans.items()}
    rows = {}
    for name, short in CPU_SPANS.items():
        total = share = 0.0
        for sp in src.spans(name):
            s = step_of.get(sp.trace_id)
            if s is None and sp.step_id is not None:
                s = sp.step_id
            if s in mine:
                d = _ms(sp.end_ns - sp.start_ns)
                total += d
                share += d * mine[s]["num_tokens"] / max(mine[s]["step_tokens"], 1)
        rows[short] = (total, share)
    step_ms = sum(_ms(src.step_spans[s].end_ns - src.step_spans[s].start_ns) for s in mine if s in src.step_spans)
    return {"rows": rows, "total": sum(t for t, _ in rows.values()), "share": sum(s for _, s in rows.values()),
            "step_ms": step_ms}


def _why(time: dict, mem: dict, cpu: dict, n_steps: int, preempted: int) -> list[str]:
    """Why no single number: the run's own contrasts between the accounts."""
    why = []
    if time["TTFT ms"] and time["queue ms"] is not None:
        why.append(f"Its TTFT is {time['TTFT ms']:.1f} ms, of which {time['queue ms']:.1f} ms "
                   f"({100 * time['queue ms'] / time['TTFT ms']:.0f} %) was waiting in the queue, not computing: "
                   "the time account alone cannot say whether the GPU was slow or the pool was full.")
    if mem["KV MB"] is not None and mem["weights MB"]:
        why.append(f"Its KV peaked at {mem['KV MB']:.2f} MB{' per rank' if mem.get('per rank') else ''} — "
                   f"{100 * mem['peak KV blocks'] / max(mem['pool blocks'], 1):.0f} % of the pool but "
                   f"{100 * mem['KV MB'] / mem['weights MB']:.2f} % of the {mem['weights MB']:.0f} MB of weights: "
                   "tiny next to the model, yet the scarce resource that decides who runs.")
    if cpu["total"]:
        why.append(f"The host spent {cpu['total']:.2f} ms scheduling and preparing the {n_of(n_steps, 'step')} it was in "
                   f"({cpu['share']:.2f} ms its share by tokens) out of {cpu['step_ms']:.1f} ms of step time: cheap "
                   "per request, but paid again every step for every request.")
    if preempted:
        why.append(f"It was preempted {n_of(preempted, 'time')}: its KV blocks were taken back and everything it had "
                   "computed was computed again — a memory decision that shows up only in its time account.")
    return why


def _rows(time: dict, mem: dict, comm: dict, cpu: dict, n_steps: int, path: list[dict]) -> list[dict]:
    """The five accounts, one line each."""
    return [{"account": "time", "value": (f"queue {ms_text(time, 'queue ms')} · prefill {ms_text(time, 'prefill ms')} "
                                          f"· decode {ms_text(time, 'decode ms')}; TTFT {ms_text(time, 'TTFT ms')}; "
                                          f"{itl_text(time)}")},
            {"account": "memory", "value": (f"{mem['peak KV blocks']} KV blocks at step {mem['at step']}: "
                                            f"{mb_text(mem['KV MB'], 2)}, pool {mem['pool blocks']} blocks: "
                                            f"{mb_text(mem['pool MB'], 1)}, weights {mb_text(mem['weights MB'], 0)}"
                                            + (" (each per rank)" if mem.get("per rank") else ""))},
            {"account": "communication", "value": comm["text"]},
            {"account": "CPU", "value": ", ".join(f"{k} {t:.2f} ms" for k, (t, _) in cpu["rows"].items())
             + f" — {cpu['total']:.2f} ms over its {n_of(n_steps, 'step')}, its share {cpu['share']:.2f} ms"},
            {"account": "request", "value": " → ".join(
                f"{p['status']}@{p['from step']}" + (f"–{p['to step']}" if p["to step"] != p["from step"] else "")
                for p in path)}]


def _tables(rows: list[dict], comm: dict, cpu: dict, path: list[dict], engine_events: list[dict]) -> dict:
    from dashboard.components.kv_memory import MB
    return {"the five accounts": rows,
            "CPU, per span (ms)": [{"span": k, "total on its steps": round(t, 3), "its share": round(s, 3)}
                                   for k, (t, s) in cpu["rows"].items()],
            "status path": path, "engine events": engine_events,
            "communication": [{"what": k, "count": v} for k, v in comm["ipc"].items()]
            + [{"what": f"{op} (count, MB)", "count": f"{c} ({b / MB:.2f} MB)"} for op, (c, b) in comm["coll"].items()]}


def _show_me(req: str, mine: dict[int, dict], peak_step: int | None, three: bool) -> list[ShowMe]:
    show = [ShowMe(f"request {req}'s journey", "journey", first_step_of(mine), None, req)]
    if peak_step is not None:
        show.append(ShowMe(f"step {peak_step}, KV cache tab: its blocks at their peak", "inspector", peak_step, "kv", req))
    if three:
        show.append(ShowMe(f"the three processes at step {first_step_of(mine)}", "processes", first_step_of(mine), None, req))
    return show


def first_step_of(mine: dict) -> int | None:
    return min(mine) if mine else None


def _finish_steps(src: RunSource) -> list[tuple[int, str]]:
    from dashboard.answers.q4_finish import finishes
    return finishes(src)


def ms_text(time: dict, key: str, nd: int = 1) -> str:
    """"204.5 ms", or, where the request has no such figure, why: "none (never scheduled)"; "not recorded
    in this run" where it should have one (the time account's "why none", from _why_none)."""
    x = time.get(key)
    return f"{x:,.{nd}f} ms" if x is not None else (time.get("why none") or {}).get(key, NOT_RECORDED)


def itl_text(time: dict) -> str:
    """"ITL mean 54.8 ms, max 57.2 ms"; a request with no gap between tokens says so once:
    "ITL none (one output token: no gap between two tokens)", never "ITL mean —, max —".

    NOTE: the inter-token latency is a time between two generated tokens: a request that generated
    one has none, and a dash in its place reads as a number lost on the way."""
    mean, top = "ITL mean ms", "ITL max ms (step ends)"
    if time.get(mean) is None and time.get(top) is None and ms_text(time, mean) == ms_text(time, top):
        return f"ITL {ms_text(time, mean)}"
    return f"ITL mean {ms_text(time, mean)}, max {ms_text(time, top)}"


def mb_text(x: float | None, nd: int = 1) -> str:
    """"4.92 MB", or, where the run lacks the figure, the words "not recorded in this run".

    NOTE: never "— MB": a dash before a unit reads as a number lost on the way (found on the H100 sample,
    whose model files stayed on the recording machine and whose meta has no model_weight_bytes)."""
    return NOT_RECORDED if x is None else f"{x:,.{nd}f} MB"
