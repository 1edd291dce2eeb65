"""Host cost of tracing, CPU only: OMP_NUM_THREADS=1 .venv/bin/python bench/tracing_host_cost.py [--rounds 5]

A tiny random-weight Llama (2 layers, hidden 64, vocab 512) keeps the forward
pass cheap, so what is left of an engine step is host (Python) work:
scheduling, input preparation, output processing and, at levels spans / full,
tracing. 256 requests (prompt 16 tokens, max_tokens 64, ignore_eos) decode
together, on one engine per level (off / spans / full, the traced ones
writing a run store into a temporary trace_dir), all built with the public
`LLM` and driven through its engine (`llm.llm_engine`: add_request, step), as
`LLM.generate` does.

NOTE: the engines run in lockstep, one step each in turn (the order rotates
every round), and every step is timed. On a shared machine the speed drifts
by tens of percent over seconds; two engines' k-th steps run milliseconds
apart, on the same batch, so their difference is what tracing adds. Reported
per level: ms per engine step (the adding of the 256 requests included,
spread over the steps), µs per request-step (that / 256), the throughput
ratio vs off and the added ms per step (medians over the rounds of each
round's paired figures), and the median paired difference of single steps
(adding excluded). The span exporter's thread of one engine may run during
another's step: a little of a traced level's cost can land on its neighbours.
Also per level: the process's CPU ms per step (time.process_time: every
thread, the exporters' included), which a loaded machine disturbs far less
than the wall clock (it still counts a neighbour level's exporter thread).

Prints a table and writes bench/results/tracing_host_cost_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time

LEVELS = ("off", "spans", "full")
VOCAB = 512


def write_tiny_model(path: str) -> None:
    """A small random Llama saved by transformers, and a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t2", "unk_token": "t0"}, f)


def make_llm(path: str, level: str, trace_dir: str, args):
    from vllm_anatomy import LLM
    # NOTE: every request's whole sequence fits in the pool (no preemption), and
    # the batch limits admit all of them: the decode batch is args.requests wide.
    blocks_per_req = -(-(args.prompt_len + args.max_tokens) // 16) + 1
    return LLM(path, device="cpu", max_model_len=512, max_num_seqs=args.requests,
               max_num_batched_tokens=max(2048, args.requests * args.prompt_len),
               num_gpu_blocks_override=args.requests * blocks_per_req + 64,
               async_scheduling=args.async_scheduling,
               trace_level=level, trace_dir=None if level == "off" else trace_dir)


def run_round(engines: dict, prompts: list, params, tag: str, order: list[str]) -> dict[str, dict]:
    """Add the batch to every engine, then step them in turn until all are done."""
    rounds: dict[str, dict] = {}
    for lvl in order:
        engine, t, c = engines[lvl], time.perf_counter(), time.process_time()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        rounds[lvl] = {"add_s": time.perf_counter() - t, "steps_s": [], "tokens": 0,
                       "cpu_s": time.process_time() - c}
    active = list(order)
    while active:
        for lvl in list(active):
            engine, t, c = engines[lvl], time.perf_counter(), time.process_time()
            outputs = engine.step()
            rounds[lvl]["steps_s"].append(time.perf_counter() - t)
            rounds[lvl]["cpu_s"] += time.process_time() - c
            rounds[lvl]["tokens"] += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
            if not engine.has_unfinished_requests():
                active.remove(lvl)
    expected = len(prompts) * params.max_tokens
    assert all(r["tokens"] == expected for r in rounds.values()), "every request decodes max_tokens"
    return rounds


def run(args) -> dict[str, list[dict]]:
    from vllm_anatomy import SamplingParams
    from vllm_anatomy.sampling_params import RequestOutputKind
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(args.prompt_len)]}
               for _ in range(args.requests)]
    # FINAL_ONLY, as LLM.generate asks: one RequestOutput per request, at its end.
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    levels = args.levels.split(",")
    samples: dict[str, list[dict]] = {lvl: [] for lvl in levels}
    with tempfile.TemporaryDirectory() as path, tempfile.TemporaryDirectory() as trace_dir:
        write_tiny_model(path)
        llms = {lvl: make_llm(path, lvl, trace_dir, args) for lvl in levels}
        engines = {lvl: llm.llm_engine for lvl, llm in llms.items()}
        run_round(engines, prompts, params, "warmup", levels)
        for r in range(args.rounds):
            # NOTE: the order rotates each round: no level always steps first (or last).
            order = levels[r % len(levels):] + levels[:r % len(levels)]
            for lvl, res in run_round(engines, prompts, params, f"r{r}", order).items():
                samples[lvl].append(res)
            print(f"round {r}: " + "  ".join(f"{lvl} {ms_per_step(samples[lvl][-1]):6.2f} ms/step" for lvl in levels),
                  flush=True)
        for llm in llms.values():
            llm.llm_engine.shutdown()
        args.run_store_bytes = sum(os.path.getsize(os.path.join(trace_dir, f)) for f in os.listdir(trace_dir))
    return samples


def ms_per_step(res: dict) -> float:
    """A round's ms per engine step, the adding of the requests spread over the steps."""
    return 1e3 * (res["add_s"] + sum(res["steps_s"])) / len(res["steps_s"])


def cpu_ms_per_step(res: dict) -> float:
    """A round's process CPU ms per engine step (adding included; every thread of the process)."""
    return 1e3 * res["cpu_s"] / len(res["steps_s"])


def summarise(samples: dict[str, list[dict]], requests: int) -> dict[str, dict]:
    off = samples.get("off")
    out = {}
    for lvl, rounds in samples.items():
        ms = [ms_per_step(r) for r in rounds]
        cpu = [cpu_ms_per_step(r) for r in rounds]
        res = {"ms_per_step_rounds": ms, "ms_per_step_best": min(ms), "ms_per_step_median": statistics.median(ms),
               "cpu_ms_per_step_rounds": cpu, "cpu_ms_per_step_median": statistics.median(cpu),
               "us_per_request_step": 1e3 * statistics.median(ms) / requests,
               "add_ms_per_request": statistics.median(1e3 * r["add_s"] / requests for r in rounds),
               "steps_per_round": len(rounds[0]["steps_s"])}
        if off is not None:
            base = [ms_per_step(r) for r in off]
            added = statistics.median(x - o for x, o in zip(ms, base))
            step_diffs = [1e3 * (x - o) for r, ro in zip(rounds, off) for x, o in zip(r["steps_s"], ro["steps_s"])]
            res["added_cpu_ms_per_step"] = statistics.median(x - o for x, o in zip(cpu, map(cpu_ms_per_step, off)))
            res.update({"throughput_ratio_vs_off": statistics.median(o / x for x, o in zip(ms, base)),
                        "added_ms_per_step": added, "added_us_per_request_step": 1e3 * added / requests,
                        "added_ms_per_step_paired_steps": statistics.median(step_diffs),
                        "added_ms_per_request_add": res["add_ms_per_request"] - statistics.median(
                            1e3 * r["add_s"] / requests for r in off)})
        out[lvl] = res
    return out


def print_table(table: dict[str, dict]) -> None:
    nan = float("nan")
    print(f"\n{'level':<6} {'ms/step':>8} {'(best)':>7} {'µs/req-step':>12} {'x off':>7} {'+ms/step':>9} "
          f"{'+µs/req-step':>13} {'+ms/step (steps)':>17} {'+ms/req add':>12} {'cpu ms/step':>12} {'+cpu ms':>8}")
    for lvl, r in table.items():
        print(f"{lvl:<6} {r['ms_per_step_median']:>8.2f} {r['ms_per_step_best']:>7.2f} "
              f"{r['us_per_request_step']:>12.1f} {r.get('throughput_ratio_vs_off', nan):>7.3f} "
              f"{r.get('added_ms_per_step', nan):>9.2f} {r.get('added_us_per_request_step', nan):>13.1f} "
              f"{r.get('added_ms_per_step_paired_steps', nan):>17.2f} {r.get('added_ms_per_request_add', nan):>12.3f} "
              f"{r['cpu_ms_per_step_median']:>12.2f} {r.get('added_cpu_ms_per_step', nan):>8.2f}")
    print("(medians over rounds; x off and the added figures pair each level's round, or step, with off's)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--levels", default=",".join(LEVELS), help="comma-separated; put off first")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the GPU default's engine loop (launch step N+1, then finish step N)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "tracing_host_cost_cpu.json"))
    args = ap.parse_args()
    table = summarise(run(args), args.requests)
    print_table(table)
    results = {"workload": {"requests": args.requests, "prompt_len": args.prompt_len,
                            "max_tokens": args.max_tokens, "ignore_eos": True, "rounds": args.rounds,
                            "async_scheduling": args.async_scheduling},
               "machine": machine(), "levels": table, "run_store_bytes": args.run_store_bytes}
    write_results(args.out, results)
    print(f"run stores: {args.run_store_bytes / 1e6:.1f} MB; wrote {args.out}")


def machine() -> dict:
    """The host a result was measured on (the load of its other users included)."""
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "loadavg_1m": os.getloadavg()[0]}


def write_results(path: str, results: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
