"""Where a speculative step's device time goes: the target's GPU.step vs the draft model's phase.

    python bench/drafter_device_lane.py --out-dir $OUT          # on a CUDA device (~2-4 min on an H100)

Runs the default model (SmolLM2-135M-Instruct) with `"method": "draft_model"` at trace level full,
for each draft (the model itself: every greedy draft accepted; its first 8 layers: a cheaper draft,
often rejected), scheduling (sync, async) and graphs (the GPU's default FULL_AND_PIECEWISE,
enforce_eager), 8 requests of 64 greedy tokens, K = 3. From each run store's device lane
(docs/trace-format.md: "The drafter on the device lane") it reports, over the verify steps: the
target's device time per step (GPU.step), the drafter's (GPU.propose_draft_token_ids), the drafter's
share of the two, its forwards and kernel launches per step, and the trace checker's counts (every
span within its parent, no Perfetto overlap). Prints a table; writes drafter_device_lane.json and
keeps the run stores (<out-dir>/runs/) for the dashboard's step inspector.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

K = 3
PROMPTS = ["Repeat this sentence exactly: the small red boat sails across the quiet blue lake at dawn.",
           "Count from one to twenty, separated by commas:", "The capital of France is",
           "Write a haiku about the sea.", "List five colours of the rainbow:", "Explain what a GPU is in one line.",
           "Translate 'good morning' into French, Spanish and German:", "def fibonacci(n):"]


def run(model: str, draft: str, async_scheduling: bool, eager: bool, trace_dir: str) -> str:
    from vllm_anatomy import LLM, SamplingParams
    llm = LLM(model, trace_level="full", trace_dir=trace_dir, async_scheduling=async_scheduling, enforce_eager=eager,
              max_model_len=1024, speculative_config={"method": "draft_model", "model": draft,
                                                      "num_speculative_tokens": K})
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    path = llm.llm_engine.recorder.run_path
    llm.llm_engine.shutdown()
    return path


def summarize(path: str) -> dict:
    from vllm_anatomy.tracing.reader import open_run
    from vllm_anatomy.tracing.trace_check import check_run
    with open_run(path) as r:
        spans = r.spans()
        report = check_run(r)
    verify = {s.attributes["vllm_anatomy.step_id"] for s in spans if s.name == "EngineCore.step"
              and "vllm_anatomy.spec_decode.num_drafts" in s.attributes}

    def per_step(name: str) -> dict[int, float]:
        return {s.attributes["vllm_anatomy.step_id"]: (s.end_ns - s.start_ns) / 1e6 for s in spans
                if s.name == name and s.attributes.get("vllm_anatomy.step_id") in verify}
    target, drafter = per_step("GPU.step"), per_step("GPU.propose_draft_token_ids")
    both = set(target) & set(drafter)
    kernels = [s for s in spans if s.name.startswith("GPU.kernel.") and s.attributes.get("vllm_anatomy.drafter")
               and s.attributes.get("vllm_anatomy.step_id") in both]
    forwards = [s for s in spans if s.name == "GPU.draft_model_forward" and s.attributes.get("vllm_anatomy.step_id") in both]
    modes = sorted({s.attributes["vllm_anatomy.cudagraph_mode"] for s in forwards})
    return {"run": os.path.basename(path), "verify_steps": len(verify), "with_both": len(both),
            "target_ms": statistics.median(target[i] for i in both) if both else None,
            "drafter_ms": statistics.median(drafter[i] for i in both) if both else None,
            "drafter_share": statistics.median(drafter[i] / (drafter[i] + target[i]) for i in both) if both else None,
            "forwards_per_step": len(forwards) / max(1, len(both)), "draft_modes": modes,
            "drafter_kernels_per_step": len(kernels) / max(1, len(both)),
            "strict_violations": report.strict_violations, "jaeger_warnings": report.jaeger_warnings,
            "perfetto_overlaps": report.perfetto_overlaps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target model dir (default: the default model)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("needs a CUDA device: the device lane is timed with CUDA events")
        return 2
    from vllm_anatomy.transformers_utils.default_model import ensure_default_model
    from vllm_anatomy.transformers_utils.draft_model_utils import write_truncated_draft
    model = args.model or str(ensure_default_model())
    runs_dir = os.path.join(args.out_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    drafts = {"self": model, "8 layers": write_truncated_draft(model, 8, tempfile.mkdtemp(prefix="draft8-"))}
    rows = []
    for draft_name, draft in drafts.items():
        for async_scheduling in (False, True):
            for eager in (False, True):
                row = {"draft": draft_name, "async_scheduling": async_scheduling,
                       "graphs": "eager" if eager else "FULL_AND_PIECEWISE",
                       **summarize(run(model, draft, async_scheduling, eager, runs_dir))}
                rows.append(row)
                print(" · ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                      flush=True)
    head = ("draft", "async", "graphs", "target ms", "drafter ms", "drafter share", "fwd/step", "kern/step", "strict")
    print("\n" + " | ".join(head))
    for r in rows:
        print(" | ".join(str(x) for x in (
            r["draft"], r["async_scheduling"], r["graphs"], _f(r["target_ms"]), _f(r["drafter_ms"]),
            _f(r["drafter_share"]), _f(r["forwards_per_step"]), _f(r["drafter_kernels_per_step"]),
            r["strict_violations"])))
    out = os.path.join(args.out_dir, "drafter_device_lane.json")
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "k": K, "rows": rows}, f, indent=1)
    print(f"\nwrote {out}")
    return 0 if all(r["strict_violations"] == 0 and r["with_both"] > 0 for r in rows) else 1


def _f(v) -> str:
    return "—" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    sys.exit(main())
