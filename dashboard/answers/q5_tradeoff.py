"""Q5's trade-off, measured: the article's answer names two accounts paid by another —
"大 batch 省时间账但涨显存账、投机解码省轮次但涨每步时间" — and the second half is read here from
the shipped speculative-decoding pair (samples/compare/pairs.json, the pair whose knob is
speculative_config, recorded by scripts/record_compare_pairs.py): the same copy prompts,
greedy, without and with drafts.

    spec_pair(compare_dir)       the manifest entry of that pair, when both its run stores are there
    spec_tradeoff(compare_dir)   its numbers: engine steps per output token (the article's 轮次),
                                 the median step time (每步时间), the mean acceptance length, and
                                 the sentence the Self-test's Q5 quotes; None without the pair

Every number comes from the two run stores (the EngineCore.step spans and their spec-decode
counters, the llm_request spans' output tokens), computed as the Compare page computes them
(dashboard/compare.py: rounds, as its summary does).
"""
from __future__ import annotations

import json
import os

from dashboard.compare import rounds, spec_text
from vllm_anatomy.tracing.reader import TraceStoreError, open_run

ARTICLE = "投机解码省轮次但涨每步时间"


def spec_pair(compare_dir: str) -> dict | None:
    """The shipped pair whose knob is speculative_config (off on its A side), with its files' paths."""
    try:
        with open(os.path.join(compare_dir, "pairs.json")) as f:
            pairs = json.load(f)["pairs"]
    except (OSError, ValueError, KeyError):
        return None
    for p in pairs:
        if p.get("knob") != "speculative_config" or p["a"].get("value"):
            continue
        paths = [os.path.join(compare_dir, p[s]["file"]) for s in ("a", "b")]
        if all(os.path.isfile(x) for x in paths):
            return {**p, "path_a": paths[0], "path_b": paths[1]}
    return None


def _side(path: str) -> dict:
    """One run's rounds: steps, output tokens, steps per token, median step ms, spec counters."""
    with open_run(path) as run:
        steps = len(run.steps())
        step_spans = run.spans("EngineCore.step")
        reqs = run.requests()
        tokens = sum(int(s.attributes.get("gen_ai.usage.output_tokens") or 0) for s in reqs)
        speculative = bool((run.meta.get("config") or {}).get("speculative_config"))
    return {"requests": len(reqs), "output_tokens": tokens, **rounds(steps, tokens, step_spans, speculative)}


def spec_tradeoff(compare_dir: str) -> dict | None:
    """The pair's numbers for the article's trade-off and the sentence that quotes them; None when the pair
    is not shipped or a run store cannot be read."""
    pair = spec_pair(compare_dir)
    if pair is None:
        return None
    try:
        a, b = _side(pair["path_a"]), _side(pair["path_b"])
    except TraceStoreError:
        return None
    if not (a["steps_per_token"] and b["steps_per_token"] and a["step_ms"] and b["step_ms"]
            and b["acceptance_length"] and b["acceptance_rate"] is not None):
        return None
    rounds = b["steps_per_token"] / a["steps_per_token"] - 1
    per_step = b["step_ms"] / a["step_ms"] - 1
    sentence = (f"{ARTICLE} (speculative decoding saves rounds but makes each step longer). In the shipped "
                f"pair (recorded on {pair['device']}: the same {b['requests']} "
                f"copy prompts, greedy), speculative decoding ({spec_text(pair['b']['value'])}) took engine steps per "
                f"output token from {a['steps_per_token']:.3f} to {b['steps_per_token']:.3f} ({rounds:+.0%}: "
                f"{a['steps']} → {b['steps']} steps for {b['output_tokens']} tokens) while the median step "
                f"{'grew' if per_step > 0 else 'fell'} from {a['step_ms']:.0f} to {b['step_ms']:.0f} ms "
                f"({per_step:+.0%}); a request gained "
                f"{b['acceptance_length']:.2f} tokens per step that verified its drafts ("
                f"{b['acceptance_rate']:.0f} % of draft tokens accepted).")
    return {"pair": pair["name"], "title": pair["title"], "device": pair["device"], "a": a, "b": b,
            "steps_per_token_change": rounds, "step_ms_change": per_step, "sentence": sentence,
            "files": (pair["a"]["file"], pair["b"]["file"]),
            "link": f"compare?a={pair['a']['file']}&b={pair['b']['file']}"}

