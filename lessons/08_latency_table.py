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

    Every row also gets its floor: a decode step must at least read every weight and the
    batch's K/V once, so bytes / this machine's measured copy rate is the shortest it can be;
    the lesson prints that floor and how far the step is above it.

Run
    python lessons/08_latency_table.py                # CPU: prompt 64, batch 1 vs 8
    python lessons/08_latency_table.py --model DIR    # any local Llama / Qwen2 / Qwen3 HF dir
    On CUDA the lesson uses the article's prompt length (512) and batch 1 vs 32.

    The article's own model, without its checkpoint (load_format="dummy": the published config's
    shapes, random weights, nothing downloaded), on one GPU:
    python lessons/08_latency_table.py --article --json out.json
        = --model meta-llama/Llama-2-7b-hf --load-format dummy --dtype float16 (batch 1 vs 32, prompt 512)
    A 70B-class model over several GPUs (2 x 80 layers = the article's 160 all-reduces per step):
    python lessons/08_latency_table.py --model meta-llama/Llama-2-70b-hf --load-format dummy --dtype float16 -tp 4
    On a CPU, the same path with a small config: --model vllm-anatomy/tiny-llama --load-format dummy
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

# NOTE: one intra-op thread: on a 2-core machine shared with other work, torch's spinning
# worker threads make every step several times slower. OMP_NUM_THREADS=2 overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import (Stopwatch, check, dashboard_link, finish, greedy, make_llm, open_run,  # noqa: E402
                     say, title)

from vllm_anatomy.model_executor.dummy_configs import num_parameters  # noqa: E402
from vllm_anatomy.tracing.reader import SpanRow  # noqa: E402

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
ARTICLE_HBM_BYTES_PER_S = 2.0e12        # "HBM 带宽约 2.0 TB/s", the A100 80GB of the conditions
ARTICLE_WEIGHT_BYTES = 13.5e9
ARTICLE_MODEL = "meta-llama/Llama-2-7b-hf"
# NOTE: the throughput rows are derived from the step times the article gives (tokens per
# step / step time); the article's TTFT figure for its 512-token prompt is not in the text
# we quote from, so TTFT has no article column. Its floor (13.5 GB / 2.0 TB/s = 6.75 ms at
# batch 1) is ours too, derived from its conditions: the article does not print one.

TEXT = ("The history of computing is a story of layers: vacuum tubes gave way to transistors, "
        "transistors to integrated circuits, and circuits to processors that run programs written "
        "in languages that are themselves compiled by programs. Every layer hides the one below it, "
        "and every layer leaks a little of it too. ")



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Lesson 8: the latency table, on your own hardware")
    p.add_argument("--model", default=None, help="a local HF dir, or with --load-format dummy a built-in config")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--article", action="store_true", help=f"the article's model and dtype: --model {ARTICLE_MODEL} "
                   "--load-format dummy --dtype float16 (needs a GPU with ~25 GB free)")
    p.add_argument("--json", default=None, help="write the table and the measurements to this file")
    args, _ = p.parse_known_args(argv)
    if args.article:
        args.model, args.load_format, args.dtype = args.model or ARTICLE_MODEL, "dummy", "float16"
    return args


def make_prompts(tok, n: int, length: int, first: int, vocab_size: int) -> list[dict]:
    """n prompts of exactly `length` token ids, each starting at a different offset of a long
    text (no two share a first block, so nothing could be a prefix hit anyway); ids folded into
    the model's vocabulary (a dummy model's may be smaller than the tokenizer's)."""
    ids = [t % vocab_size for t in tok.encode(TEXT * (2 + (length + 64 * n) // 40))]
    return [{"prompt_token_ids": ids[(first + i) * 7:(first + i) * 7 + length]} for i in range(n)]


def copy_rate(device: str) -> float:
    """This machine's copy rate in bytes moved per second (read + write), best of 5: a 1 GiB device
    copy on a GPU (timed by CUDA events), a 256 MiB memcpy on a CPU."""
    on_cuda = device.startswith("cuda")
    n = (1 << 29) if on_cuda else (1 << 27)                   # fp16 elements: 1 GiB / 256 MiB
    src = torch.ones(n, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        if on_cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            seconds = a.elapsed_time(b) / 1e3
        else:
            t = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t
        best = min(best, seconds)
    return 2 * src.numel() * src.element_size() / best


def kv_bytes_per_token(hf: dict, itemsize: int, tp: int) -> int:
    """K and V of one token, every layer, on one rank (its KV heads; replicated when tp > KV heads)."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    return 2 * hf["num_hidden_layers"] * max(kv_heads // tp, 1) * head_dim * itemsize


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
    # NOTE: with tensor parallelism every rank runs the same spans: count the output rank's (0).
    other_ranks = {int(r["pid"]) for r in run.meta.get("ranks") or [] if r.get("rank") not in (0, None)}
    children: dict[str, list[SpanRow]] = {}
    for s in run.spans():
        if s.step_id is None and s.trace_id in {d.trace_id for d in decode} and s.pid not in other_ranks:
            children.setdefault(s.trace_id, []).append(s)
    all_reduces = [c.attributes["vllm_anatomy.num_all_reduce"] for d in decode for c in children[d.trace_id]
                   if c.name == "Worker.execute_model" and "vllm_anatomy.num_all_reduce" in c.attributes]

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
            "decode_tok_s": len(reqs) / (step / 1e3), "first_step": decode[0].step_id if decode else None,
            "all_reduces_per_step": statistics.median(all_reduces) if all_reduces else None}


def engine_args(args: argparse.Namespace, on_cuda: bool, blocks: int, big: int) -> dict:
    """The lesson's engine: no prefix caching, a KV pool just big enough for the batch (the step
    snapshots list every block), and what the command line asked for."""
    out: dict = {"enable_prefix_caching": False, "num_gpu_blocks_override": blocks, "max_model_len": 1024}
    if on_cuda:
        # CUDA graphs for the decode steps the lesson measures (batch 1 .. big), as the article's setup has them;
        # the prefills run eager (a 7B model's graph captures up to 2,048 tokens would take minutes).
        out["max_num_seqs"] = big
        out["max_cudagraph_capture_size"] = big
    if args.model:
        out["model"] = args.model
    if args.load_format != "auto":
        out["load_format"] = args.load_format
    if args.dtype != "auto":
        out["dtype"] = args.dtype
    if args.tensor_parallel_size > 1:
        out["tensor_parallel_size"] = args.tensor_parallel_size
    return out


def weights_per_rank(llm, hf: dict, itemsize: int, tp: int) -> int:
    """Bytes of weights one rank reads per step: counted on the model when it runs in this process,
    else from the config (worker processes)."""
    executor = llm.llm_engine.engine_core.model_executor
    worker = getattr(executor, "driver_worker", None)
    if worker is not None:
        return sum(p.numel() * p.element_size() for p in worker.model_runner.model.parameters())
    return num_parameters(hf) * itemsize // tp


def main() -> None:
    args = parse_args()
    title("Lesson 8 — the latency table, on your own hardware")
    on_cuda = torch.cuda.is_available()      # the engine default, device="auto"
    if args.article and not on_cuda:
        raise SystemExit("--article runs Llama-2-7B in FP16 (13.5 GB of weights): it needs a CUDA GPU. On a CPU, "
                         "the same path with a small config: --model vllm-anatomy/tiny-llama --load-format dummy")
    prompt_len, big, max_tokens = (512, 32, 16) if on_cuda else (64, 8, 6)
    blocks = (big * (prompt_len + max_tokens)) // 16 + 64
    llm = make_llm(**engine_args(args, on_cuda, blocks, big))
    vc = llm.llm_engine.vllm_config
    hf, tp = vc.model_config.hf_config, vc.parallel_config.tensor_parallel_size
    device = vc.model_config.device
    on_cuda = device.startswith("cuda")
    itemsize = torch.empty((), dtype=vc.model_config.dtype).element_size()
    weight_bytes = weights_per_rank(llm, hf, itemsize, tp)
    kv_per_token = kv_bytes_per_token(hf, itemsize, tp)
    rate = copy_rate(device)
    tok = llm.get_tokenizer()
    vocab = hf["vocab_size"]

    with Stopwatch() as sw1:
        single = llm.generate(make_prompts(tok, 1, prompt_len, 0, vocab), greedy(max_tokens, ignore_eos=True),
                              use_tqdm=False)
    with Stopwatch() as swb:
        batch = llm.generate(make_prompts(tok, big, prompt_len, 1, vocab), greedy(max_tokens, ignore_eos=True),
                             use_tqdm=False)
    path = finish(llm)
    run = open_run(path)
    one = measure(run, {o.request_id for o in single})
    many = measure(run, {o.request_id for o in batch})
    cfg = run.meta["config"]["model_config"]
    async_scheduling = bool(run.meta["config"]["scheduler_config"].get("async_scheduling"))
    graphs = run.meta["config"]["compilation_config"]["cudagraph_mode"] != "NONE"
    if on_cuda:
        hw = torch.cuda.get_device_name(torch.device(device))
    else:
        hw = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch threads"
    dummy = vc.load_config.load_format == "dummy"
    ours = (f"{os.path.basename(cfg['model'])}" + (" (load_format dummy: the config's shapes, random weights)"
                                                   if dummy else "")
            + f", {cfg['dtype'].replace('torch.', '')} ({nbytes(weight_bytes)} of weights"
            + (f" per rank, TP={tp}" if tp > 1 else "") + f"), {hw}"
            + (f" x {tp}" if tp > 1 else "") + f", copy rate {rate / 1e9:.0f} GB/s measured here, prompt "
            f"{prompt_len} tokens, {max_tokens} output tokens (ignore_eos), prefix caching off, "
            f"{'CUDA graphs for decode steps' if graphs else 'no CUDA graphs'}")
    # The floor of a decode step: every weight and the batch's K/V read once, at the copy rate (mean context:
    # the prompt and half the output).
    context = prompt_len + max_tokens / 2
    kv1, kvb = kv_per_token * context, kv_per_token * context * big
    floor1, floorb = (weight_bytes + kv1) / rate * 1e3, (weight_bytes + kvb) / rate * 1e3
    article_floor = ARTICLE_WEIGHT_BYTES / ARTICLE_HBM_BYTES_PER_S * 1e3

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
         nbytes(weight_bytes), nbytes(weight_bytes)),
        ("K/V read per decode step", "- (not given)", nbytes(kv1), nbytes(kvb)),
        ("floor = bytes / copy rate (ms)", f"{article_floor:.2f} (13.5 GB / 2.0 TB/s, derived) | b32 -",
         f"{floor1:.2f}", f"{floorb:.2f}"),
        ("decode step / floor", f"{10 / article_floor:.1f}x (10 ms / {article_floor:.2f}, derived)",
         f"{one['step'] / floor1:.1f}x", f"{many['step'] / floorb:.1f}x"),
    ]
    if tp > 1:
        rows.append(("all-reduces per decode step", "160 (§九: 2 per layer, 70B over GPUs)",
                     str(one["all_reduces_per_step"]), str(many["all_reduces_per_step"])))
    w = [max(len(str(r[i] or "-")) for r in rows) for i in range(4)]
    head = ("quantity", "article (A100, batch 1 | 32)", "ours, batch 1", f"ours, batch {big}")
    w = [max(a, len(b)) for a, b in zip(w, head)]
    for r in [head, tuple("-" * x for x in w), *rows]:
        print("  " + "  ".join(str(c if c is not None else "-").ljust(x) for c, x in zip(r, w)))
    print()
    if args.json:
        write_json(args.json, {"conditions": {"article": ARTICLE_CONDITIONS, "ours": ours}, "device": hw,
                               "tensor_parallel_size": tp, "load_format": vc.load_config.load_format,
                               "copy_rate_bytes_per_s": rate, "weight_bytes_per_rank": weight_bytes,
                               "kv_bytes_per_token_per_rank": kv_per_token, "prompt_len": prompt_len,
                               "max_tokens": max_tokens, "batch": [1, big],
                               "floor_ms": [floor1, floorb], "article_floor_ms_derived": article_floor,
                               "measured": {"1": one, str(big): many}, "run": os.path.basename(path),
                               "table": [dict(zip(head, r)) for r in rows]})
        print(f"  (written: {args.json})\n")

    say(f"""The floor: a decode step cannot be shorter than reading every weight once
        ({nbytes(weight_bytes)}) and the batch's K/V ({nbytes(kv1)} at batch 1,
        {nbytes(kvb)} at batch {big}) at the copy rate measured here ({rate / 1e9:.0f} GB/s):
        {floor1:.2f} and {floorb:.2f} ms. The steps took {one['step'] / floor1:.1f}x and
        {many['step'] / floorb:.1f}x their floors. The article's A100 would need
        {article_floor:.2f} ms for its 13.5 GB at 2.0 TB/s; its ~10 ms step is
        {10 / article_floor:.1f}x that. The weights are the same bytes at batch 1 and at batch
        {big}: that is why the batch is nearly free, until the K/V the batch reads grows to the
        size of the weights.""")

    growth = many["step"] / one["step"]
    per_tok_1, per_tok_b = one["step"], many["step"] / big
    bw = weight_bytes / (one["forward"] / 1e3) / 1e9
    say(f"""Batch 1 took {sw1.seconds:.1f} s and batch {big} took {swb.seconds:.1f} s of wall
        time here. The row to look at is the decode step: going from 1 to {big} requests made the
        step {growth:.2f}x longer, not {big}x, so one token costs {per_tok_1:.1f} ms of step at
        batch 1 but {per_tok_b:.1f} ms at batch {big}. Every step streams all
        {nbytes(weight_bytes)} of weights through the processor however many rows the
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

    if on_cuda:
        check(one["step_min"] >= 0.9 * floor1,
              f"no decode step beats its floor: shortest {one['step_min']:.2f} ms >= 0.9 x {floor1:.2f} ms "
              "(every weight read once at the measured copy rate)")
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


def nbytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


if __name__ == "__main__":
    main()
