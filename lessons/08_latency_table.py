"""Lesson 8 — the latency-magnitude table, measured on your own hardware.

What it teaches
    The article closes with a table of how long each part of serving takes, measured for
    Llama-2-7B in FP16 on one A100 80GB with 512-token prompts. Those numbers only mean
    something with their conditions, so this lesson measures the same quantities on the
    machine it runs on, states its own conditions, and prints both side by side:
    TTFT, TPOT, ITL, throughput, and the decode step split into schedule / prepare /
    forward / sample — at batch 1 and at a larger batch.

    The key row: a decode step of B requests costs far less than B decode steps of one
    request, because the step's fixed cost (reading every weight once, plus the per-step
    Python work) is shared by the whole batch. The lesson asserts that the per-token cost
    of a decode step drops as the batch grows, from this run's spans.

Run
    python lessons/08_latency_table.py                # CPU: prompt 64, batch 1 vs 8
    python lessons/08_latency_table.py --model DIR    # any local Llama / Qwen2 / Qwen3 HF dir
    On CUDA the lesson uses the article's prompt length (512) and batch 1 vs 32.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys

# NOTE: one intra-op thread: on a 2-core machine shared with other work, torch's spinning
# worker threads make every step several times slower. OMP_NUM_THREADS=2 overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import (Stopwatch, check, dashboard_link, finish, greedy, make_llm, open_run,  # noqa: E402
                     say, title)

# The article's appendix (§七), as far as its text states figures. Conditions it gives:
ARTICLE_CONDITIONS = ("Llama-2-7B, FP16, one A100 80GB (HBM ~2.0 TB/s), TP=1, prompt 512 tokens, "
                      "no prefix-cache hit, CUDA graphs on")
ARTICLE = {
    "decode step, batch 1 (ms)": "~10 (8-12)",
    "decode step, batch 32 (ms)": "~15",
    "TPOT at batch 1 (ms)": "~10 (= the step)",
    "ITL, steady state": "~ TPOT (spikes on chunked prefill / preemption)",
    "decode throughput, batch 1 (tok/s)": "~100 (1 token / 10 ms)",
    "decode throughput, batch 32 (tok/s)": "~2,100 (32 tokens / 15 ms)",
    "Scheduler.schedule (ms)": "~0.05",
    "prepare inputs (ms)": "~0.1",
    "sampling (ms)": "~0.05",
    "weights read per decode step": "13.5 GB",
    "Python control plane / step": "~1 %",
}
# NOTE: the throughput rows are derived from the step times the article gives (tokens per
# step / step time); the article's TTFT figure for its 512-token prompt is not in the text
# we quote from, so TTFT has no article column.

TEXT = ("The history of computing is a story of layers: vacuum tubes gave way to transistors, "
        "transistors to integrated circuits, and circuits to processors that run programs written "
        "in languages that are themselves compiled by programs. Every layer hides the one below it, "
        "and every layer leaks a little of it too. ")



def _model_arg() -> dict:
    if "--model" in sys.argv:
        return {"model": sys.argv[sys.argv.index("--model") + 1]}
    return {}


def make_prompts(tok, n: int, length: int, first: int) -> list[dict]:
    """n prompts of exactly `length` token ids, each starting at a different offset of a long
    text (no two share a first block, so nothing could be a prefix hit anyway)."""
    ids = tok.encode(TEXT * (2 + (length + 64 * n) // 40))
    return [{"prompt_token_ids": ids[(first + i) * 7:(first + i) * 7 + length]} for i in range(n)]


def ms(ns: float) -> float:
    return ns / 1e6


def event_ns(span, name: str) -> int:
    return next(e["time_ns"] for e in span.events if e["name"] == name)


def measure(run, req_ids: set[str]) -> dict:
    """TTFT / TPOT / ITL / throughput of the given requests, and their decode steps' split."""
    reqs = [r for r in run.requests() if r.request_id in req_ids]
    by_span = {r.span_id: r for r in reqs}
    steps = [s for s in run.spans("EngineCore.step") if any(lk["span_id"] in by_span for lk in s.links)]
    ttft = [ms(event_ns(r, "FIRST_TOKEN") - r.start_ns) for r in reqs]
    tpot = [ms(event_ns(r, "FINISHED") - event_ns(r, "FIRST_TOKEN"))
            / (r.attributes["gen_ai.usage.output_tokens"] - 1) for r in reqs]
    # A request's token i is produced by the i-th step that served it: ITL = gaps between those steps' ends.
    itl = []
    for r in reqs:
        ends = sorted(s.end_ns for s in steps if any(lk["span_id"] == r.span_id for lk in s.links))
        itl += [ms(b - a) for a, b in zip(ends, ends[1:])]
    n_out = sum(r.attributes["gen_ai.usage.output_tokens"] for r in reqs)
    wall = min(r.start_ns for r in reqs), max(event_ns(r, "FINISHED") for r in reqs)
    # Decode steps: one token for each of the batch's requests (no prefill in the step).
    decode = [s for s in steps if s.attributes["vllm_anatomy.num_scheduled_tokens"]
              == s.attributes["vllm_anatomy.num_reqs"] == len(reqs)]
    children = {}
    for s in run.spans():
        if s.step_id is None and s.trace_id in {d.trace_id for d in decode}:
            children.setdefault(s.trace_id, []).append(s)

    def part(names):
        return statistics.median(ms(sum(c.duration_ns for c in children[d.trace_id] if c.name in names))
                                 for d in decode)

    step = statistics.median(ms(d.duration_ns) for d in decode)
    # Consecutive decode steps whose spans overlap (step N+1 scheduled before step N ended).
    by_start = sorted(decode, key=lambda d: d.start_ns)
    overlap = sum(b.start_ns < a.end_ns for a, b in zip(by_start, by_start[1:])) / max(len(by_start) - 1, 1)
    schedule = part({"Scheduler.schedule"})
    prepare = part({"GPUModelRunner._update_states", "GPUModelRunner._prepare_inputs"})
    forward = part({"GPUModelRunner._model_forward", "GPUModelRunner.compute_logits"})
    sample = part({"GPUModelRunner._sample"})
    python = part({"Scheduler.schedule", "GPUModelRunner._update_states", "GPUModelRunner._prepare_inputs",
                   "GPUModelRunner._bookkeeping_sync", "Scheduler.update_from_output"})
    sync = statistics.median(c.attributes.get("vllm_anatomy.sync_wait_ms", 0.0)
                             for d in decode for c in children[d.trace_id] if c.name == "GPUModelRunner._bookkeeping_sync")
    return {"batch": len(reqs), "n_steps": len(decode), "ttft": statistics.median(ttft),
            "tpot": statistics.mean(tpot), "itl_mean": statistics.mean(itl), "itl_max": max(itl),
            "itl_min": min(itl), "step_min": min(ms(d.duration_ns) for d in decode), "overlap": overlap,
            "throughput": n_out / ((wall[1] - wall[0]) / 1e9), "step": step, "schedule": schedule,
            "prepare": prepare, "forward": forward, "sample": sample,
            "python": python - sync,
            "decode_tok_s": len(reqs) / (step / 1e3), "first_step": decode[0].step_id if decode else None}


def main() -> None:
    title("Lesson 8 — the latency table, on your own hardware")
    on_cuda = torch.cuda.is_available()      # the engine default, device="auto"
    prompt_len, big, max_tokens = (512, 32, 16) if on_cuda else (64, 8, 6)
    # A KV pool just big enough for the batch: the step snapshots list every block.
    blocks = (big * (prompt_len + max_tokens)) // 16 + 64
    llm = make_llm(enable_prefix_caching=False, num_gpu_blocks_override=blocks, max_model_len=1024,
                   **_model_arg())
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    on_cuda = runner.device.type == "cuda"
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    tok = llm.get_tokenizer()

    with Stopwatch() as sw1:
        single = llm.generate(make_prompts(tok, 1, prompt_len, 0), greedy(max_tokens, ignore_eos=True),
                              use_tqdm=False)
    with Stopwatch() as swb:
        batch = llm.generate(make_prompts(tok, big, prompt_len, 1), greedy(max_tokens, ignore_eos=True),
                             use_tqdm=False)
    path = finish(llm)
    run = open_run(path)
    one = measure(run, {o.request_id for o in single})
    many = measure(run, {o.request_id for o in batch})
    cfg = run.meta["config"]["model_config"]
    async_scheduling = bool(run.meta["config"]["scheduler_config"].get("async_scheduling"))
    graphs = run.meta["config"]["compilation_config"]["cudagraph_mode"] != "NONE"
    if on_cuda:
        hw = torch.cuda.get_device_name(runner.device)
    else:
        hw = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch threads"
    ours = (f"{os.path.basename(cfg['model'])}, {cfg['dtype'].replace('torch.', '')} "
            f"({weight_bytes / 1e6:.0f} MB of weights), {hw}, prompt {prompt_len} tokens, "
            f"{max_tokens} output tokens (ignore_eos), prefix caching off, "
            f"{'CUDA graphs for decode steps' if graphs else 'no CUDA graphs'}")

    print(f"  article: {ARTICLE_CONDITIONS}")
    print(f"  ours:    {ours}\n")
    rows = [
        ("TTFT (ms, median)", None, f"{one['ttft']:.1f}", f"{many['ttft']:.1f}"),
        ("TPOT (ms)", ARTICLE["TPOT at batch 1 (ms)"], f"{one['tpot']:.1f}", f"{many['tpot']:.1f}"),
        ("ITL mean / max (ms)", ARTICLE["ITL, steady state"], f"{one['itl_mean']:.1f} / {one['itl_max']:.1f}",
         f"{many['itl_mean']:.1f} / {many['itl_max']:.1f}"),
        ("throughput, whole run (tok/s)", None, f"{one['throughput']:.1f}", f"{many['throughput']:.1f}"),
        ("decode step (ms, median)", f"{ARTICLE['decode step, batch 1 (ms)']} | b32 "
         f"{ARTICLE['decode step, batch 32 (ms)']}", f"{one['step']:.1f}", f"{many['step']:.1f}"),
        ("decode throughput (tok/s)", f"{ARTICLE['decode throughput, batch 1 (tok/s)'].split(' ')[0]} | b32 "
         f"{ARTICLE['decode throughput, batch 32 (tok/s)'].split(' ')[0]}",
         f"{one['decode_tok_s']:.1f}", f"{many['decode_tok_s']:.1f}"),
        ("  Scheduler.schedule (ms)", ARTICLE["Scheduler.schedule (ms)"], f"{one['schedule']:.3f}",
         f"{many['schedule']:.3f}"),
        ("  _update_states+_prepare_inputs (ms)", ARTICLE["prepare inputs (ms)"], f"{one['prepare']:.3f}",
         f"{many['prepare']:.3f}"),
        ("  _model_forward+compute_logits (ms)", "~10 (most of the step)", f"{one['forward']:.1f}",
         f"{many['forward']:.1f}"),
        ("  _sample (ms)", ARTICLE["sampling (ms)"], f"{one['sample']:.3f}", f"{many['sample']:.3f}"),
        ("  Python control plane / step", ARTICLE["Python control plane / step"],
         f"{one['python'] / one['step']:.1%}", f"{many['python'] / many['step']:.1%}"),
        ("weights read per decode step", ARTICLE["weights read per decode step"],
         f"{weight_bytes / 1e6:.0f} MB", f"{weight_bytes / 1e6:.0f} MB"),
    ]
    w = [max(len(str(r[i] or "-")) for r in rows) for i in range(4)]
    head = ("quantity", "article (A100, batch 1 | 32)", "ours, batch 1", f"ours, batch {big}")
    w = [max(a, len(b)) for a, b in zip(w, head)]
    for r in [head, tuple("-" * x for x in w), *rows]:
        print("  " + "  ".join(str(c if c is not None else "-").ljust(x) for c, x in zip(r, w)))
    print()

    growth = many["step"] / one["step"]
    per_tok_1, per_tok_b = one["step"], many["step"] / big
    bw = weight_bytes / (one["forward"] / 1e3) / 1e9
    say(f"""Batch 1 took {sw1.seconds:.1f} s and batch {big} took {swb.seconds:.1f} s of wall
        time here. The row to look at is the decode step: going from 1 to {big} requests made the
        step {growth:.2f}x longer, not {big}x, so one token costs {per_tok_1:.1f} ms of step at
        batch 1 but {per_tok_b:.1f} ms at batch {big}. Every step streams all
        {weight_bytes / 1e6:.0f} MB of weights through the processor however many rows the
        batch has (at batch 1 that is {bw:.1f} GB/s of effective bandwidth here), and the
        Python work per step ({one['python']:.2f} ms at batch 1) is paid once per step too;
        extra rows add only their own arithmetic and KV reads.""")
    say(f"""TPOT rose from {one['tpot']:.1f} to {many['tpot']:.1f} ms with the batch: each request
        waits for the bigger step, which is the latency half of the trade. ITL is the gap between
        one request's consecutive tokens: in steady synchronous decode it equals the step time
        (with async scheduling, the pipeline's beat: see below), and its
        maximum ({many['itl_max']:.1f} ms at batch {big}) shows the spikes. TTFT includes the
        prefill of everything admitted in the same step: {big} prompts of {prompt_len} tokens
        prefilled together made the batch's TTFT {many['ttft']:.1f} ms against
        {one['ttft']:.1f} ms alone.""")
    if not on_cuda:
        say("""On a CPU the "device" is the CPU itself: the forward is compute as well as memory
            traffic, it runs synchronously (no overlap of Python with the forward), and there are
            no CUDA graphs; torch used the thread count in the conditions line (set
            OMP_NUM_THREADS to change it). So the absolute numbers are a long way from the A100's; what
            carries over is the shape: the step's cost grows much more slowly than the batch.""")
    else:
        say("""On this GPU a decode step replays a CUDA graph (one launch for the whole forward),
            so what is left of the step is the device's work (weights and KV read from HBM) plus
            the Python around it: schedule, prepare_inputs, sampling launches, bookkeeping. At
            batch 1 that Python, not HBM, would be most of the step — which is why the engine,
            like vLLM, schedules asynchronously on a GPU (on in this run): step N+1's Python runs
            while step N's graph replays, so the step costs the larger of the two, not their sum.""")

    check(one["n_steps"] >= max_tokens - 2 and many["n_steps"] >= max_tokens - 2,
          f"measured {one['n_steps']} decode steps at batch 1 and {many['n_steps']} at batch {big}")
    check(many["step"] < big * one["step"],
          f"a decode step of {big} requests ({many['step']:.1f} ms) costs less than {big} steps of one "
          f"({big * one['step']:.1f} ms)")
    check(per_tok_b < per_tok_1,
          f"the per-token cost of a decode step drops with batch: {per_tok_1:.1f} -> {per_tok_b:.1f} ms/token")
    check(many["decode_tok_s"] > one["decode_tok_s"],
          f"decode throughput rises with batch: {one['decode_tok_s']:.1f} -> {many['decode_tok_s']:.1f} tok/s")
    if async_scheduling:
        say(f"""With async scheduling a step's span runs from its schedule() to its update, and the
            next step is scheduled and launched before this one's tokens are waited for: at batch 1,
            {one['overlap']:.0%} of consecutive decode steps overlapped. So a step lives about two
            pipeline beats, while a token comes out every beat: the mean ITL ({one['itl_mean']:.1f} ms)
            is shorter than a step's span ({one['step']:.1f} ms), and two tokens can even arrive
            back to back (min ITL {one['itl_min']:.1f} ms) when the device finished the next step
            while the host was still busy with this one. What bounds ITL is the beat: the larger
            of the host's Python per step and the device's forward, not their sum.""")
        check(one["overlap"] >= 0.9 and one["itl_mean"] < one["step"],
              f"async scheduling: {one['overlap']:.0%} of consecutive decode steps overlap, and a token comes "
              f"every {one['itl_mean']:.1f} ms on average, faster than a step's span ({one['step']:.1f} ms)")
    else:
        check(one["overlap"] == 0 and one["itl_min"] >= one["step_min"],
              f"synchronous steps never overlap, so a token never comes faster than a step: min ITL "
              f"{one['itl_min']:.1f} ms >= shortest decode step {one['step_min']:.1f} ms at batch 1 (the gap "
              "above it is output processing and tracing)")
    dashboard_link(path, "metrics", many["first_step"])


if __name__ == "__main__":
    main()
