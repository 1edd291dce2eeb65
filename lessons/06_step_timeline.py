"""Lesson 6 — one step's timeline: what is only enqueued, and the one place the CPU waits.

What it teaches
    A step is two calls into the worker: `execute_model(SchedulerOutput, non_block=True)`,
    which returns a Future whose result is None ("go on to sampling"), and
    `sample_tokens(grammar_output)`, which returns the ModelRunnerOutput. Between the two,
    while the device runs the forward, the scheduler builds the structured-output grammar
    bitmask (`Scheduler.get_grammar_bitmask`: None when no request has a grammar). Everything
    `execute_model` does (update the persistent batch, prepare the input tensors, launch the
    forward and the logits) is *enqueued* on the device; the CPU only waits once, in
    `_bookkeeping_sync`, for the sampled token ids to land in host memory. The lesson records
    a short run, watches what the two calls return, reads the spans of every step from the
    run store, checks their order, and finds the single span that carries a sync wait.

    On a CUDA machine it also reads the device lane (GPU.* spans from CUDA events), compares
    how long the host took to *launch* an eager forward with a CUDA graph replay of a decode
    step (the whole forward as one launch), and shows why prefill steps stay eager. On a
    CPU there is no asynchronous device: the lesson says so and shows what the host spans
    mean there.

Run
    python lessons/06_step_timeline.py            # device="auto": CUDA if present, else CPU
    python lessons/06_step_timeline.py --model /path/to/hf_model_dir
"""
from __future__ import annotations

import os
import sys

# NOTE: one intra-op thread: on a 2-core machine shared with other work, torch's spinning
# worker threads make every step several times slower. OMP_NUM_THREADS=2 overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (Stopwatch, chat_prompts, check, dashboard_link, finish, greedy,  # noqa: E402
                     make_llm, open_run, say, title)

from vllm_anatomy.core.outputs import ModelRunnerOutput  # noqa: E402

QUESTIONS = ["Name three primary colours.", "What does a compiler do?"]
MAX_TOKENS = 5

# The step's spans, in the order the article's sequence diagram puts them.
HOST_ORDER = ["Scheduler.schedule", "Executor.execute_model", "Executor.sample_tokens",
              "Scheduler.update_from_output"]
RUNNER_EXECUTE = ["GPUModelRunner._update_states", "GPUModelRunner._prepare_inputs",
                  "GPUModelRunner._model_forward", "GPUModelRunner.compute_logits"]
RUNNER_SAMPLE = ["GPUModelRunner._sample", "GPUModelRunner._bookkeeping_sync"]
DEVICE_ORDER = ["GPU.prepare_inputs", "GPU.model_forward", "GPU.compute_logits", "GPU.sample", "GPU.d2h"]



def _model_arg() -> dict:
    if "--model" in sys.argv:
        return {"model": sys.argv[sys.argv.index("--model") + 1]}
    return {}


def step_spans(run) -> dict[int, list]:
    """Every span of each step's trace (EngineCore.step is the root of its own trace)."""
    spans = run.spans()
    roots = {s.trace_id: s.attributes["vllm_anatomy.step_id"] for s in spans
             if s.name == "EngineCore.step" and "vllm_anatomy.step_id" in s.attributes}
    out: dict[int, list] = {}
    for s in spans:
        if s.trace_id in roots:
            out.setdefault(roots[s.trace_id], []).append(s)
    return out


def one(spans, name):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"expected one {name} span in the step, found {len(found)}"
    return found[0]


def in_order(spans, names) -> bool:
    """Each named span ends before the next one starts (sequential, non-overlapping)."""
    seq = [one(spans, n) for n in names]
    return all(a.end_ns <= b.start_ns for a, b in zip(seq, seq[1:]))


def depth_of(span, by_id) -> int:
    d = 0
    while span.parent_id in by_id:
        span, d = by_id[span.parent_id], d + 1
    return d


def ms(ns: float) -> float:
    return ns / 1e6


def main() -> None:
    title("Lesson 6 — one step's timeline: enqueue, enqueue, enqueue ... and one sync")
    # A small KV pool: the step snapshots list every block, and a GPU's default pool is huge.
    # NOTE: the article's synchronous step. On a GPU the engine (like vLLM) schedules
    # asynchronously by default; the end of the lesson says what that changes.
    llm = make_llm(num_gpu_blocks_override=256, max_model_len=1024, async_scheduling=False, **_model_arg())

    # Watch what the two worker calls return, on this very engine (no copy, no mock).
    executor = llm.llm_engine.engine_core.model_executor
    returned: list[tuple[str, int | None, object]] = []
    real_execute, real_sample = executor.execute_model, executor.sample_tokens

    # NOTE: EngineCore asks for execute_model(non_block=True): a Future, already done
    # in one process; what it holds is what the worker answered.
    def execute_model(scheduler_output, non_block=False):
        result = real_execute(scheduler_output, non_block)
        returned.append(("execute_model", scheduler_output.step_id, result.result() if non_block else result))
        return result

    def sample_tokens(grammar_output, non_block=False):
        result = real_sample(grammar_output, non_block)
        returned.append(("sample_tokens", None, result))
        return result

    executor.execute_model, executor.sample_tokens = execute_model, sample_tokens
    prompts = chat_prompts(llm, QUESTIONS)
    with Stopwatch() as sw:
        outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    executor.execute_model, executor.sample_tokens = real_execute, real_sample
    path = finish(llm)

    run = open_run(path)
    device = run.meta["device"]
    on_cuda = str(device).startswith("cuda")
    steps = step_spans(run)
    step_ids = sorted(i for i in steps if any(s.name == "GPUModelRunner._model_forward" for s in steps[i]))
    # A decode step: every scheduled request got exactly one token (not the first, prefill step).
    decode = [i for i in step_ids
              if one(steps[i], "EngineCore.step").attributes["vllm_anatomy.num_scheduled_tokens"]
              == one(steps[i], "EngineCore.step").attributes["vllm_anatomy.num_reqs"]]
    shown = decode[len(decode) // 2] if decode else step_ids[-1]
    spans = steps[shown]
    by_id = {s.span_id: s for s in spans}
    root = one(spans, "EngineCore.step")

    say(f"""We generated {MAX_TOKENS} tokens for each of {len(QUESTIONS)} chat prompts on
        {device} in {sw.seconds:.1f} s: {len(step_ids)} engine steps. Below is step {shown}, a
        decode step ({root.attributes['vllm_anatomy.num_reqs']} requests, one token each), as
        the run store recorded it: offset from the step's start, duration, and the span tree.""")
    print(f"  {'start ms':>9} {'dur ms':>9}  span")
    for s in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        lane = "   [device lane]" if s.attributes.get("vllm_anatomy.lane") == "device" else ""
        extra = ""
        if "vllm_anatomy.sync_wait_ms" in s.attributes:
            extra = f"   <- sync wait {s.attributes['vllm_anatomy.sync_wait_ms']:.3f} ms"
        print(f"  {ms(s.start_ns - root.start_ns):9.3f} {ms(s.duration_ns):9.3f}  "
              f"{'  ' * depth_of(s, by_id)}{s.name}{lane}{extra}")
    print()

    # 1. What the two calls return.
    execs = [r for r in returned if r[0] == "execute_model"]
    samples = [r for r in returned if r[0] == "sample_tokens"]
    say(f"""EngineCore called Executor.execute_model(non_block=True) {len(execs)} times; every
        call answered a Future whose result was {sorted({type(r[2]).__name__ for r in execs})}:
        the forward pass was handed over, not waited for. While it ran, the scheduler built the
        grammar bitmask (Scheduler.get_grammar_bitmask; no request here has a grammar, so there
        was none to build). The logits stay inside the model runner (execute_model_state) until
        the second call, sample_tokens(grammar_output), which returned a ModelRunnerOutput each
        time — that is where the sampled token ids come back.""")
    check(len(execs) == len(samples) == len(run.spans("EngineCore.step")),
          f"one execute_model and one sample_tokens call per step ({len(execs)} steps)")
    check(all(r[2] is None for r in execs), "Executor.execute_model returned None in every step")
    sampled = [r[2] for r in samples if isinstance(r[2], ModelRunnerOutput)]
    check(len(sampled) == len(samples), "Executor.sample_tokens returned a ModelRunnerOutput in every step")
    n_tokens = sum(len(t) for out in sampled for t in out.sampled_token_ids)
    check(n_tokens == sum(len(o.outputs[0].token_ids) for o in outputs),
          f"the {n_tokens} generated tokens all came back through sample_tokens")

    # 2. The order of spans inside every step.
    ordered = all(in_order(steps[i], HOST_ORDER) and in_order(steps[i], RUNNER_EXECUTE)
                  and in_order(steps[i], RUNNER_SAMPLE) for i in step_ids)
    check(ordered, f"in all {len(step_ids)} steps: schedule -> execute_model -> sample_tokens -> "
                   "update_from_output, and _update_states -> _prepare_inputs -> _model_forward -> "
                   "compute_logits, then _sample -> _bookkeeping_sync")

    # 3. The one sync point.
    syncs = {i: [s for s in steps[i] if "vllm_anatomy.sync_wait_ms" in s.attributes] for i in step_ids}
    check(all(len(v) == 1 and v[0].name == "GPUModelRunner._bookkeeping_sync" for v in syncs.values()),
          "each step has exactly one span that waits for the device: GPUModelRunner._bookkeeping_sync")
    waits = [syncs[i][0].attributes["vllm_anatomy.sync_wait_ms"] for i in step_ids]
    forwards = [one(steps[i], "GPUModelRunner._model_forward").duration_ns for i in step_ids]
    step_durs = [one(steps[i], "EngineCore.step").duration_ns for i in step_ids]
    device_spans = [s for i in step_ids for s in steps[i] if s.attributes.get("vllm_anatomy.lane") == "device"]

    if on_cuda:
        _cuda_part(steps, step_ids, shown, waits, device_spans)
    else:
        fwd_share = sum(forwards) / sum(step_durs)
        say(f"""This run is on the CPU, and a CPU has no asynchronous device: every torch op ran
            to completion before the next Python line. So "enqueued" means "done" here —
            _model_forward's host span IS the forward ({ms(sum(forwards)) / len(forwards):.1f} ms
            per step on average, {fwd_share:.0%} of the step time), the sync has nothing left to
            wait for (sync_wait_ms = {max(waits):.3f} in every step), and there is no device lane
            to read. What this run cannot show: the CPU running ahead of the GPU, the wait at the
            sync being the GPU's real compute time, and CUDA graphs shrinking the launch cost.
            Run this lesson on a CUDA machine to see those.""")
        check(all(w == 0.0 for w in waits), "on the CPU the sync wait is 0 ms in every step")
        check(not device_spans, "on the CPU there are no device-lane (GPU.*) spans")
        check(fwd_share > 0.5, f"on the CPU the host-side forward is most of the step ({fwd_share:.0%})")

    async_scheduling_note()
    dashboard_link(path, "timeline", shown)


def _cuda_part(steps, step_ids, shown, waits, device_spans) -> None:
    """What only a GPU shows: the device lane, a real wait, launch vs. run, graph replays."""
    per_step = {i: {s.name: s for s in steps[i] if s.name in DEVICE_ORDER} for i in step_ids}
    forward = {i: one(steps[i], "GPUModelRunner._model_forward") for i in step_ids}
    graph = [i for i in step_ids if forward[i].attributes.get("vllm_anatomy.cudagraph_mode") == "FULL"]
    eager = [i for i in step_ids if i not in graph]

    def mean_ms(xs):
        return ms(sum(xs) / len(xs)) if xs else float("nan")
    launch_graph = mean_ms([forward[i].duration_ns for i in graph])
    launch_eager = mean_ms([forward[i].duration_ns for i in eager])
    run_dev = mean_ms([per_step[i]["GPU.model_forward"].duration_ns for i in step_ids
                       if "GPU.model_forward" in per_step[i]])
    exec_end_before_dev = sum(
        one(steps[i], "GPUModelRunner.execute_model").end_ns < per_step[i]["GPU.compute_logits"].end_ns
        for i in step_ids if "GPU.compute_logits" in per_step[i])
    busy = [sum(s.duration_ns for s in per_step[i].values()) / one(steps[i], "EngineCore.step").duration_ns
            for i in step_ids]
    say(f"""On this GPU the step has a device lane (GPU.* spans from CUDA events, read after the
        sync). In {exec_end_before_dev} of {len(step_ids)} steps GPUModelRunner.execute_model
        returned before the device finished the logits: the CPU had only queued the work. The
        CPU then waited at _bookkeeping_sync for {sum(waits) / len(waits):.3f} ms per step on
        average (max {max(waits):.3f} ms) — the device finishing what was queued. The device ran
        the forward in {run_dev:.2f} ms per step and was busy {sum(busy) / len(busy):.0%} of
        each step.""")
    reasons = sorted({forward[i].attributes.get("vllm_anatomy.cudagraph_reason", "") for i in graph})
    say(f"""CUDA graphs: {len(graph)} of {len(step_ids)} steps replayed a captured graph
        ({'; '.join(reasons) or 'none'}), the other {len(eager)} ran eager because a prompt was
        being prefilled. Launching the forward took the host {launch_eager:.2f} ms per eager step
        (one Python call and one launch per kernel) vs. {launch_graph:.2f} ms for a graph
        replay (one launch for the whole forward). The padding rows of a padded batch
        write no KV (slot -1) and attend to nothing (query_len 0); their outputs are never read.
        Eager steps also have a GPU.layer span per decoder layer on the device lane.""")
    check(all(w > 0 for w in waits), "on CUDA the CPU really waits at the sync in every step")
    check(all(list(per_step[i]) == DEVICE_ORDER for i in step_ids),
          "every step has device-lane phase spans, in order: " + " -> ".join(DEVICE_ORDER))
    check(all(max(s.end_ns for s in per_step[i].values())
              <= one(steps[i], "GPUModelRunner._bookkeeping_sync").end_ns for i in step_ids),
          "the device lane ends before _bookkeeping_sync returns (the sync waited for all of it)")
    check(exec_end_before_dev > 0, "execute_model returned before the device finished its work "
                                   f"in {exec_end_before_dev} steps")
    check(bool(graph) and bool(eager) and launch_graph < launch_eager,
          f"decode steps replayed CUDA graphs ({len(graph)}), launching them took less host time "
          f"({launch_graph:.2f} ms) than an eager forward ({launch_eager:.2f} ms)")



def async_scheduling_note() -> None:
    say("""What async scheduling (the default on a GPU, --async-scheduling elsewhere) changes in
        this picture: the engine launches step N+1 before it waits for step N
        (EngineCore.step_with_batch_queue). sample_tokens then returns at once, with a handle
        (AsyncGPUModelRunnerOutput) whose get_output() is the sync point, one step later; the
        decode's next input token never visits the host — the next step's _prepare_inputs
        copies it from last step's sampled tensor on the device, where the host only has a -1
        placeholder (AsyncScheduler counts it in num_output_placeholders). In the trace the
        EngineCore.step spans overlap, the wait moves into a get_output span, and on a GPU
        the device lane has no gaps between steps any more: schedule, prepare and bookkeeping
        run while the previous step's forward does.""")


if __name__ == "__main__":
    main()
