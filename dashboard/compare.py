"""Two runs side by side: the article's last lesson is that no number stands alone —
"优化一笔常动另一笔" (improving one account often moves another). A pair is the same prompts
run twice with one engine argument changed (a knob); this module reads both runs and says
what moved.

    KNOBS                        the engine arguments a pair changes, each with what it does and why
                                 each account moves (and, where the knob trades one metric for another
                                 inside an account, which metric pays: `cost`)
    knob_of(meta_a, meta_b)      the knob(s) the two runs' configs differ in
    summary(path, steps, reqs)   one run's five accounts, run level (time, memory, communication,
                                 CPU, request): {metric key: value}
    METRICS                      (account, key, label, unit, lower is better)
    sentences(a, b, knob)        one sentence per account: what moved most, and why
    series(steps)                per step, aligned by step index: step ms, tokens, KV usage,
                                 preemptions so far

Everything comes from the two run stores through tracing/reader.py (the step table the other
pages use, the request spans, the control-plane spans); nothing is typed in by hand but the
mechanisms the sentences name.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import pandas as pd

from dashboard.answers.source import weight_bytes_of
from dashboard.scenarios import NGRAM_K3
from vllm_anatomy.tracing.reader import open_run

ACCOUNTS = ("time", "memory", "communication", "cpu", "request")
ACCOUNT_TITLES = {"time": "Time", "memory": "Memory", "communication": "Communication", "cpu": "CPU",
                  "request": "Request"}
CONTROL_PLANE = ("Scheduler.schedule", "GPUModelRunner._update_states", "GPUModelRunner._prepare_inputs",
                 "GPUModelRunner._bookkeeping_sync", "Scheduler.update_from_output")
# (account, key, label, unit, lower is better: True / False / None = neither)
METRICS = [
    ("time", "wall_s", "wall time, first arrival to last finish", "s", True),
    ("time", "steps", "engine steps", "", True),
    ("time", "steps_per_token", "engine steps per output token (rounds)", "", True),
    ("time", "ttft_ms", "TTFT, median", "ms", True),
    ("time", "tpot_ms", "TPOT (time per output token), mean", "ms", True),
    ("time", "step_ms", "step time, median", "ms", None),
    ("time", "tok_s", "output tokens per second", "tok/s", False),
    ("memory", "peak_blocks", "KV blocks held at the peak", "blocks", None),
    ("memory", "peak_kv_mb", "KV memory at the peak", "MB", None),
    # NOTE: the pool as requests see it: num_gpu_blocks − 1 (block 0 is the null block, never allocated; the
    # run header counts all num_gpu_blocks), so the label says which blocks it counts.
    ("memory", "pool_blocks", "KV pool, usable blocks (num_gpu_blocks − 1: the null block left out)", "", None),
    ("memory", "pool_mb", "KV pool, usable blocks (one rank)", "MB", None),
    ("memory", "weights_mb", "weights (one rank)", "MB", None),
    ("memory", "rolled_back_slots", "KV slots written by rejected drafts, then rolled back", "slots", True),
    ("communication", "ranks", "tensor-parallel ranks", "", None),
    ("communication", "all_reduces_per_step", "all-reduces per step", "", True),
    ("communication", "all_reduces", "all-reduces, whole run", "", True),
    ("communication", "shm_messages", "shared-memory messages (executor ↔ workers)", "", True),
    ("cpu", "host_ms_per_step", "control plane per step (schedule, prepare, sync, update)", "ms", True),
    ("cpu", "host_ms", "control plane, whole run", "ms", True),
    ("request", "requests", "requests finished", "", None),
    ("request", "preemptions", "preemptions", "", True),
    ("request", "hit_tokens", "prefix-cache hit tokens", "tokens", False),
    ("request", "chunked_steps", "steps carrying a partial prefill chunk", "", None),
    ("request", "max_running", "most requests running in one step", "", None),
    ("request", "acceptance_length", "tokens a request gains per step it decodes (mean acceptance length)",
     "tokens", False),
    ("request", "acceptance_rate", "draft tokens accepted", "%", False),
]
# Shown only where one of the two runs speculated (for the other pairs they say nothing).
SPEC_ONLY = ("rolled_back_slots", "acceptance_length", "acceptance_rate")
LABEL = {key: label for _, key, label, _, _ in METRICS}
UNIT = {key: unit for _, key, _, unit, _ in METRICS}


@dataclass(frozen=True)
class Knob:
    arg: str                     # the engine argument (EngineArgs / the run meta's config)
    section: str                 # where the run meta's config keeps it
    label: str                   # how the page names it
    what: str                    # one line: what it does
    why: dict                    # account -> the mechanism behind a move in that account
    lead: tuple = ()             # per account (ACCOUNTS order), the metric its mechanism is about
    needs_gpu: bool = False
    values: tuple = ()           # a default pair (a, b) for the "start a pair" form
    available: bool = True       # False: a place kept for a knob that does not exist yet
    cost: dict = field(default_factory=dict)   # account -> the metric that pays for the lead's gain there


KNOBS = [
    Knob("max_num_seqs", "scheduler_config", "max_num_seqs (batch size)",
         "how many requests may run in one step",
         {"time": "every step reads all the weights once: more requests in a step share that cost, so the same "
                  "tokens take fewer, slightly longer steps",
          "memory": "each running request holds its KV blocks, so more of them at once hold more of the pool",
          "communication": "collectives are per step (2 per layer): fewer steps, fewer all-reduces",
          "cpu": "the control plane is paid per step (its size grows a little with the batch): fewer steps, less "
                 "of it in all",
          "request": "more running requests compete for one KV pool: when it runs out the newest is preempted"},
         lead=("wall_s", "peak_kv_mb", "all_reduces", "host_ms", "max_running"), values=(2, 8)),
    Knob("max_num_batched_tokens", "scheduler_config", "chunk size (max_num_batched_tokens)",
         "the token budget of one step: a longer prompt is prefilled in chunks of at most this",
         {"time": "a larger budget prefills a prompt in fewer steps (a shorter TTFT), but the decodes that share "
                  "a step with a big chunk wait for it",
          "memory": "a prompt's blocks are allocated as its chunks are scheduled: bigger chunks fill the pool sooner",
          "communication": "collectives are per step: fewer, bigger steps, fewer all-reduces",
          "cpu": "fewer steps for the same tokens: less control plane in all",
          "request": "a prompt longer than the budget is split into partial chunks over several steps"},
         lead=("ttft_ms", "peak_kv_mb", "all_reduces", "host_ms", "chunked_steps"), values=(16, 64)),
    Knob("enable_prefix_caching", "cache_config", "prefix caching",
         "full KV blocks found by the hash of their tokens are shared instead of recomputed",
         {"time": "hit tokens are not computed again: shorter prefills, an earlier first token",
          "memory": "a shared block counts once for every request that hits it (ref_cnt > 1), so the same pool "
                    "admits more requests at once",
          "communication": "fewer prefill tokens, the same number of steps: the collectives barely move",
          "cpu": "hit tokens are neither scheduled nor prepared, so there are fewer steps to plan; hashing full "
                 "blocks and looking them up adds a little to each",
          "request": "requests with the same system prompt reuse its blocks (the hit tokens)"},
         lead=("ttft_ms", "peak_kv_mb", "all_reduces", "host_ms", "hit_tokens"), values=(False, True)),
    Knob("async_scheduling", "scheduler_config", "async scheduling",
         "step N+1 is scheduled (with placeholder tokens) while step N runs; the sync point moves to "
         "AsyncGPUModelRunnerOutput.get_output (article §五)",
         # NOTE: the mechanism first, the spans as its evidence: vLLM v0.27.1's EngineCore.step_with_batch_queue
         # schedules and launches step N+1 before it waits for step N's output, so one step's span (schedule →
         # update_from_output) still runs when the next one starts. "{overlap}" is this pair's own count.
         {"time": "async scheduling keeps the scheduler one step ahead (EngineCore.step_with_batch_queue): the host "
                  "schedules step N+1 — placeholder tokens standing in for those step N has not sampled yet — and "
                  "queues it while the GPU runs step N, so the GPU waits less for the host's Python (on a GPU a "
                  "step costs about the larger of the two, not their sum); the evidence is in the spans: step "
                  "N+1's EngineCore.step span starts before step N's ends{overlap}, and as a step's span now lasts "
                  "until its output is processed one call later, each span reads longer; on a CPU every op runs "
                  "synchronously, so there is no device time for the host's work to hide behind",
          "memory": "unchanged: the same requests hold the same blocks",
          "communication": "unchanged: the same steps",
          "cpu": "the same control plane, now hidden behind the device's work on a GPU",
          "request": "a request may get one placeholder token scheduled past its end (discarded)"},
         lead=("step_ms", "peak_kv_mb", "all_reduces", "host_ms_per_step", "requests"), values=(False, True)),
    Knob("enforce_eager", "compilation_config", "CUDA graphs (enforce_eager)",
         "pure-decode steps replay a captured graph instead of launching every kernel from Python",
         {"time": "a replay launches the whole forward in one call: the host no longer paces the device",
          "memory": "captured graphs keep their buffers: a little less room for KV blocks",
          "communication": "unchanged: the graphs capture the same collectives",
          "cpu": "no per-kernel launches from Python on replayed steps",
          "request": "unchanged: the scheduler never knows"},
         lead=("step_ms", "pool_mb", "all_reduces", "host_ms_per_step", "requests"), needs_gpu=True,
         values=(True, False)),
    Knob("tensor_parallel_size", "parallel_config", "tensor parallelism",
         "every layer split over N ranks (worker processes), joined by all-reduces",
         {"time": "on GPUs each rank reads 1/N of the weights per step; on one CPU the ranks share the same cores "
                  "and add collectives, so it is slower",
          "memory": "the weights and the KV heads are split: each rank holds 1/N",
          "communication": "2 all-reduces per layer and 1 for the embedding, every step, on every rank",
          "cpu": "every step is broadcast to N ranks over shared memory",
          "request": "unchanged: one scheduler for all ranks"},
         lead=("step_ms", "peak_kv_mb", "all_reduces_per_step", "host_ms_per_step", "requests"), values=(1, 3)),
    # NOTE: the article's own example of one account paid by another: "投机解码省轮次但涨每步时间"
    # (speculative decoding saves rounds but makes each step longer). Its pair runs copy prompts
    # (scenarios.SPEC_PAIR_WORKLOAD), where prompt lookup finds drafts; `cost` names the step time.
    Knob("speculative_config", "speculative_config", "speculative decoding",
         "a proposer drafts K tokens per request after each step; the next step verifies them in one forward "
         "(the rejection sampler keeps the target's tokens, so greedy text is unchanged)",
         {"time": "a step can give a request up to K + 1 tokens, so the same text takes fewer steps (rounds); each "
                  "step is longer: it runs the model over K + 1 positions per request and the proposer after "
                  "sampling (the article: 投机解码省轮次但涨每步时间)",
          "memory": "drafts are scheduled tokens: allocate_slots gives each a KV slot (a draft model also "
                    "reserves K lookahead slots for its own KV; ngram none); a rejected draft's slot is written, "
                    "then num_computed_tokens rolls back and the next step rewrites it; requests finish in fewer "
                    "steps, so how many hold blocks at once decides the peak",
          "communication": "collectives are per step: fewer steps, fewer all-reduces (each over more tokens)",
          "cpu": "the control plane is paid per step: fewer steps, less of it in all, though each schedules "
                 "the drafts too",
          "request": "each verified step gives a request 1 + its accepted drafts; prompt lookup drafts only where "
                     "the text repeats what came before"},
         lead=("steps_per_token", "rolled_back_slots", "all_reduces", "host_ms", "acceptance_length"),
         values=(None, NGRAM_K3), cost={"time": "step_ms", "memory": "peak_kv_mb"}),
]
BY_ARG = {k.arg: k for k in KNOBS}


def config_value(meta: dict, knob: Knob):
    """The knob's value in a run's meta config (None when the run did not record it)."""
    if knob.arg == "speculative_config":
        return spec_value((meta.get("config") or {}).get("speculative_config"))
    cfg = (meta.get("config") or {}).get(knob.section) or {}
    if knob.arg == "enforce_eager":      # recorded as the resolved graph mode
        mode = cfg.get("cudagraph_mode")
        return None if mode is None else mode == "NONE"
    return cfg.get(knob.arg)


SPEC_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")


def spec_value(sc: dict | None) -> dict | None:
    """A speculative config (the run meta's, or the knob's own) as the fields that choose the drafts;
    None: no speculative decoding."""
    if not sc:
        return None
    out = {k: sc.get(k) for k in SPEC_FIELDS if sc.get(k) is not None}
    if out.get("method") == "ngram":
        out.pop("model", None)                   # ("ngram": the config's placeholder, not a model)
    return out


def spec_text(v: dict | None) -> str:
    """"off", "ngram, K = 3, prompt lookup 2–4", "draft model …, K = 3"."""
    if not v:
        return "off"
    k = v.get("num_speculative_tokens")
    if v.get("method") == "ngram":
        return f"ngram, K = {k}, prompt lookup {v.get('prompt_lookup_min')}–{v.get('prompt_lookup_max')}"
    return f"draft model {str(v.get('model') or '?').rstrip('/').split('/')[-1]}, K = {k}"


def knob_of(meta_a: dict, meta_b: dict) -> list[tuple[Knob, object, object]]:
    """The knobs whose values differ between the two runs' configs."""
    out = []
    for k in KNOBS:
        if not k.available:
            continue
        a, b = config_value(meta_a, k), config_value(meta_b, k)
        if a != b:
            out.append((k, a, b))
    return out


def other_differences(meta_a: dict, meta_b: dict) -> list[str]:
    """Config fields outside the knobs that differ (a fair pair has none but the knob and the resolved
    numbers that follow from it)."""
    ignore = {"trace_dir", "num_gpu_blocks", "model"} | {k.arg for k in KNOBS}
    out = []
    whole = {k.section for k in KNOBS if k.arg == k.section}      # a section that is itself a knob
    for section in sorted(set(meta_a.get("config") or {}) | set(meta_b.get("config") or {})):
        if section in whole:
            continue
        sa = (meta_a.get("config") or {}).get(section) or {}
        sb = (meta_b.get("config") or {}).get(section) or {}
        if not isinstance(sa, dict) or not isinstance(sb, dict):
            continue
        for key in sorted(set(sa) | set(sb)):
            if key not in ignore and sa.get(key) != sb.get(key):
                out.append(f"{section}.{key}: {sa.get(key)} → {sb.get(key)}")
    if meta_a.get("model") != meta_b.get("model"):
        out.append("model")
    return out


# -- one run's accounts -----------------------------------------------------------------------------
def summary(path: str, steps: pd.DataFrame, reqs: list[dict]) -> dict:
    """The five accounts of a whole run: `steps` is its step table (data.step_table), `reqs` its request
    rows (spans.request_table); the rest is read from its spans and meta."""
    with open_run(path) as run:
        meta = run.meta
        step_spans = run.spans("EngineCore.step")
        control = {name: run.spans(name) for name in CONTROL_PLANE}
        workers = run.spans("Worker.execute_model")
    cfg = meta.get("config") or {}
    tp = int((cfg.get("parallel_config") or {}).get("tensor_parallel_size") or 1)
    out: dict = {}
    done = [r for r in reqs if r.get("end_ns")]
    if done:
        t0 = min(r["start_ns"] for r in done)
        t1 = max(r["end_ns"] for r in done)
        out["wall_s"] = (t1 - t0) / 1e9
        ttft = [r["ttft_ms"] for r in done if r.get("ttft_ms") is not None]
        itl = [r["itl_ms"] for r in done if r.get("itl_ms") is not None]
        out["ttft_ms"] = statistics.median(ttft) if ttft else None
        out["tpot_ms"] = statistics.mean(itl) if itl else None
        tokens = sum(r.get("output_tokens") or 0 for r in done)
        out["tok_s"] = tokens / out["wall_s"] if out["wall_s"] > 0 else None
    out["requests"] = len(done)
    out.update(step_overlaps(step_spans))
    out.update(rounds(len(steps), sum(r.get("output_tokens") or 0 for r in done), step_spans,
                      speculative=bool(cfg.get("speculative_config"))))
    # memory: blocks held at the peak (usage x usable blocks), and their bytes
    blocks = (cfg.get("cache_config") or {}).get("num_gpu_blocks") or \
        (cfg.get("cache_config") or {}).get("num_gpu_blocks_override")
    per_block = meta.get("kv_cache_bytes_per_block")
    if not steps.empty and blocks:
        out["pool_blocks"] = int(blocks) - 1
        out["peak_blocks"] = int(round(float(steps["kv_usage"].max()) * (int(blocks) - 1)))
        if per_block:
            out["peak_kv_mb"] = out["peak_blocks"] * per_block / tp / 2 ** 20
            out["pool_mb"] = (int(blocks) - 1) * per_block / tp / 2 ** 20
    weights, _ = weight_bytes_of(meta, tp)
    out["weights_mb"] = weights / 2 ** 20 if weights else None
    # communication
    out["ranks"] = tp
    ranks = {int(r["pid"]): int(r["rank"]) for r in meta.get("ranks") or [] if "pid" in r and "rank" in r}
    rank0 = {p for p, r in ranks.items() if r == 0}
    counts = [int(w.attributes.get("vllm_anatomy.num_all_reduce") or 0) for w in workers
              if "vllm_anatomy.num_all_reduce" in w.attributes and (not rank0 or w.pid in rank0)]
    out["all_reduces"] = sum(counts)
    out["all_reduces_per_step"] = statistics.median(counts) if counts else 0
    backend = (cfg.get("parallel_config") or {}).get("distributed_executor_backend")
    out["shm_messages"] = 4 * len(steps) if backend == "mp" or tp > 1 else 0
    # cpu: the control-plane spans on the host (the output rank's where several ranks run them)
    host = [s.duration_ns / 1e6 for spans in control.values() for s in spans
            if s.process_kind != "worker" or not rank0 or s.pid in rank0]
    out["host_ms"] = sum(host)
    out["host_ms_per_step"] = out["host_ms"] / len(steps) if len(steps) else None
    # request
    if not steps.empty:
        out["preemptions"] = int(steps["preempted"].sum())
        out["hit_tokens"] = int(steps["hit_tokens"].sum())
        out["chunked_steps"] = int(steps["chunked"].sum())
        out["max_running"] = int(steps["running"].max())
    return out


def step_overlaps(step_spans) -> dict:
    """How many consecutive EngineCore.step spans overlap (step N+1 starts before step N's span ends: the
    scheduler ran ahead, async scheduling), of how many consecutive pairs."""
    spans = sorted(step_spans, key=lambda sp: sp.start_ns)
    pairs = list(zip(spans, spans[1:]))
    return {"overlapping_steps": sum(1 for x, y in pairs if y.start_ns < x.end_ns), "step_pairs": len(pairs)}


def overlap_text(a: dict, b: dict, knob: tuple) -> str:
    """" (52 of 52 consecutive step pairs overlap in B, 0 of 49 in A: the Timeline page draws them)", the
    run with the knob on first; "" where a summary lacks the counts."""
    if any(s.get("step_pairs") is None for s in (a, b)):
        return ""
    _, va, vb = knob
    sides = [("A", a), ("B", b)] if va and not vb else [("B", b), ("A", a)]
    first, second = ((f"{s['overlapping_steps']} of {s['step_pairs']}", side) for side, s in sides)
    return (f" ({first[0]} consecutive step pairs overlap in {first[1]}, {second[0]} in {second[1]}: the Timeline "
            "page draws them)")


def rounds(num_steps: int, output_tokens: int, step_spans, speculative: bool) -> dict:
    """The article's rounds (轮次) and what each costs: engine steps, steps per output token, the median
    EngineCore.step span (ms) and speculative decoding's counters (spec_counts)."""
    durations = [s.duration_ns / 1e6 for s in step_spans]
    return {"steps": num_steps, "steps_per_token": num_steps / output_tokens if output_tokens else None,
            "step_ms": statistics.median(durations) if durations else None,
            **spec_counts(step_spans, speculative)}


def spec_counts(step_spans, speculative: bool) -> dict:
    """Speculative decoding's counters, summed over the run's EngineCore.step spans
    (docs/trace-format.md): the mean acceptance length as vLLM defines it (1 + accepted / drafts: the
    tokens a request gains per step that verified its drafts), the share of draft tokens accepted, and
    the rejected ones (their KV slots were written, then rolled back). Without speculation every step
    gives a decoding request one token: acceptance length 1, nothing rolled back."""
    if not speculative:
        return {"acceptance_length": 1.0, "acceptance_rate": None, "rolled_back_slots": 0, "speculative": False}
    drafts = draft_tokens = accepted = 0
    for s in step_spans:
        a = s.attributes
        drafts += int(a.get("vllm_anatomy.spec_decode.num_drafts") or 0)
        draft_tokens += int(a.get("vllm_anatomy.spec_decode.num_draft_tokens") or 0)
        accepted += int(a.get("vllm_anatomy.spec_decode.num_accepted_tokens") or 0)
    return {"acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": 100 * accepted / draft_tokens if draft_tokens else None,
            "rolled_back_slots": draft_tokens - accepted, "speculative": True,
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted}


def series(steps: pd.DataFrame, spans_ms: dict[int, float]) -> pd.DataFrame:
    """Per step (1, 2, ... in order): step ms, tokens scheduled, KV usage (%), preemptions so far."""
    if steps.empty:
        return pd.DataFrame(columns=["i", "step", "step_ms", "tokens", "kv_usage", "preemptions"])
    s = steps.sort_values("step").reset_index(drop=True)
    return pd.DataFrame({"i": range(1, len(s) + 1), "step": s["step"],
                         "step_ms": [spans_ms.get(int(x)) for x in s["step"]], "tokens": s["tokens"],
                         "kv_usage": s["kv_usage"] * 100, "preemptions": s["preempted"].cumsum()})


# -- what moved, and why ----------------------------------------------------------------------------
def delta(a, b) -> tuple[float | None, float | None]:
    """(b - a, relative change) or Nones where a value is missing."""
    if a is None or b is None:
        return None, None
    d = b - a
    return d, (d / abs(a) if a else (None if d == 0 else float("inf")))


def fmt(v, unit: str = "") -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float):
        text = f"{v:,.3f}" if abs(v) < 1 else f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    else:
        text = f"{v:,}"
    return f"{text} {unit}".strip()


def value_text(knob: Knob | None, v) -> str:
    if knob is not None and knob.arg == "enforce_eager" and isinstance(v, bool):
        return "on (eager: CUDA graphs off)" if v else "off (CUDA graphs on)"
    if knob is not None and knob.arg == "speculative_config":
        return spec_text(spec_value(v))
    return fmt(v)


NOISE = 0.03        # changes under 3 % are called unchanged
LOWER = {key: lower for _, key, _, _, lower in METRICS}


def quality(key: str, d: float) -> str | None:
    """"better" / "worse" for a move of metric `key` by d, None where neither direction is better."""
    lower = LOWER.get(key)
    return None if lower is None or d == 0 else ("better" if (d < 0) == lower else "worse")


def delta_text(d: float | None) -> str:
    """B − A as the table writes it: three significant digits, never e-notation ('-2,552', not
    '-2.55e+03': a learner reads milliseconds, not exponents)."""
    if d is None:
        return "—"
    if d == 0:
        return "0"
    if abs(d) >= 1000:
        return f"{d:+,.0f}"
    text = f"{d:+.3g}"
    return text if "e" not in text else f"{d:+.6f}".rstrip("0").rstrip(".")


def change_text(rel: float) -> str:
    """A relative change as text; from zero there is no ratio, only "from 0"."""
    return "from 0" if rel == float("inf") else f"{rel:+.0%}"


def _move(a: dict, b: dict, key: str, rel: float) -> str:
    pct = change_text(rel)
    return f"{LABEL[key]} {fmt(a.get(key), UNIT[key])} → {fmt(b.get(key), UNIT[key])} ({pct})"


def sentences(a: dict, b: dict, knobs: list[tuple[Knob, object, object]]) -> dict[str, str]:
    """Per account: the metric the knob's mechanism is about (else the one that moved most), its two values,
    the largest move the other way where the account has one (the trade-off inside it), and the mechanism."""
    out = {}
    knob = knobs[0][0] if len(knobs) == 1 else None
    for i, account in enumerate(ACCOUNTS):
        moves = {}
        for acc, key, _, _, _ in METRICS:
            d, rel = delta(a.get(key), b.get(key))
            if acc == account and d is not None and rel is not None and d != 0 and abs(rel) >= NOISE:
                moves[key] = (d, rel)
        why = (knob.why.get(account) if knob else None) or ""
        if "{overlap}" in why:
            why = why.replace("{overlap}", overlap_text(a, b, knobs[0]))
        if not moves:
            out[account] = ("unchanged within noise (every " + ACCOUNT_TITLES[account].lower() + " metric moved by "
                            f"less than {NOISE:.0%})" + (f" — {why}." if why and "unchanged" in why else "."))
            continue
        biggest = max(moves, key=lambda k: abs(moves[k][1]))
        lead = knob.lead[i] if knob and len(knob.lead) > i and knob.lead[i] in moves else biggest
        text = _move(a, b, lead, moves[lead][1])
        q = quality(lead, moves[lead][0])
        other = [k for k in moves if k != lead and q and quality(k, moves[k][0]) not in (None, q)]
        cost = knob.cost.get(account) if knob else None
        if cost in moves and cost != lead:       # the knob's own trade-off inside this account
            text += f", while {_move(a, b, cost, moves[cost][1])}"
        elif other:
            k = max(other, key=lambda k: abs(moves[k][1]))
            text += f", while {_move(a, b, k, moves[k][1])}"
        elif biggest != lead and abs(moves[biggest][1]) > abs(moves[lead][1]) + 0.1:
            text += f"; the largest move: {_move(a, b, biggest, moves[biggest][1])}"
        out[account] = text + (f" — {why}." if why else ".")
    return out
