"""Live-run scenarios: prompts (with the engine step at which each arrives) and the
engine arguments that make one mechanism of the article visible.

A scenario is plain data, handed to the engine process as JSON (dashboard/live.py).
"""
from __future__ import annotations

MUSEUM = ("You are a careful assistant for a museum of computing history. Answer in one short "
          "sentence, precisely, and never invent dates or names you are not sure about.")
LONG_TEXT = ("Paged attention stores the key and value vectors of every token in fixed-size blocks. "
             "A block table maps each request's logical blocks to physical blocks in one shared pool, "
             "so memory is allocated on demand, shared between requests with a common prefix, and "
             "returned to the pool the moment a request finishes or is preempted. "
             "Summarise this paragraph in one sentence.")

ENGINE_ARG_NAMES = ("max_num_batched_tokens", "num_gpu_blocks_override", "block_size", "max_num_seqs",
                    "enable_prefix_caching", "max_model_len", "async_scheduling", "enforce_eager",
                    "tensor_parallel_size")
BOOL_ARGS = ("enable_prefix_caching", "async_scheduling", "enforce_eager")   # passed even when False


def _p(text: str, arrive_step: int = 0, system: str | None = None) -> dict:
    return {"text": text, "arrive_step": arrive_step, "system": system}


SCENARIOS: dict[str, dict] = {
    "tour": {
        "label": "Guided tour: prefix hits, chunked prefill and preemption in one run",
        "engine_args": {"max_num_batched_tokens": 32, "num_gpu_blocks_override": 9, "max_model_len": 120},
        "max_tokens": 14, "ignore_eos": True,
        # NOTE: a pause between steps, so the first live minute can be read: at full speed the tour's
        # ~45 steps pass in seconds on a CPU and it ends on empty queues (the pause is the form's slider).
        "step_delay_s": 0.6,
        "prompts": [_p("What is a CPU?", 0, MUSEUM), _p("Who built ENIAC?", 3, MUSEUM),
                    _p("What is RAM?", 3, MUSEUM), _p("Name an old computer.", 3, MUSEUM),
                    _p(LONG_TEXT, 5)],
    },
    "prefix": {
        "label": "Shared system prompt → prefix-cache hits",
        "engine_args": {}, "max_tokens": 16, "ignore_eos": False,
        "prompts": [_p("What is a CPU?", 0, MUSEUM)] + [_p(q, 3, MUSEUM) for q in
                                                          ("Who built ENIAC?", "What is RAM?", "What was the Altair 8800?")],
    },
    "preemption": {
        "label": "Tiny KV cache → preemption and recompute",
        "engine_args": {"num_gpu_blocks_override": 9, "max_model_len": 96},
        "max_tokens": 40, "ignore_eos": True,
        "prompts": [_p(q) for q in ("Tell me about Alan Turing.", "What is a transistor?",
                                    "Explain virtual memory.", "What is a compiler?")],
    },
    "chunked": {
        "label": "Long prompt → chunked prefill next to decodes",
        "engine_args": {"max_num_batched_tokens": 24},
        "max_tokens": 12, "ignore_eos": False,
        "prompts": [_p("Say hello."), _p(LONG_TEXT, 2), _p("Count to five.", 4)],
    },
    "continuous": {
        "label": "Mixed lengths → continuous batching",
        "engine_args": {"max_num_seqs": 3},
        "max_tokens": 20, "ignore_eos": False,
        "prompts": [_p("Hi!"), _p("Write a haiku about paged memory.", 1), _p(LONG_TEXT, 3),
                    _p("List three prime numbers.", 5), _p("What is 2 + 2?", 8),
                    _p("Name a colour.", 10)],
    },
    "custom": {
        "label": "My own prompts",
        "engine_args": {}, "max_tokens": 24, "ignore_eos": False,
        "prompts": [_p("What is the capital of France?")],
    },
}


def build_spec(scenario: str, prompts: list[dict], engine_args: dict, max_tokens: int,
               ignore_eos: bool, step_delay_s: float = 0.0) -> dict:
    """What dashboard/live.py runs: engine arguments without Nones, and the requests."""
    args = {k: v for k, v in engine_args.items() if k in ENGINE_ARG_NAMES and v not in (None, 0, "")}
    for k in BOOL_ARGS:         # (False is a choice: async scheduling off on a GPU, prefix caching off)
        if engine_args.get(k) is not None:
            args[k] = bool(engine_args[k])
    return {"scenario": scenario, "engine_args": args, "max_tokens": int(max_tokens),
            "ignore_eos": bool(ignore_eos), "prompts": prompts, "step_delay_s": float(step_delay_s)}


# -- pairs: the same prompts twice, one engine argument changed (views/compare.py) ----------------
# A workload where every knob below moves something: a shared system prompt (prefix hits), a long
# prompt arriving mid-run (chunked prefill next to decodes), more requests than a small
# max_num_seqs admits, and a KV pool small enough to fill.
PAIR_WORKLOAD = {
    "engine_args": {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 18, "max_model_len": 160,
                    "max_num_seqs": 8},
    "max_tokens": 24, "ignore_eos": True,
    "prompts": [_p(q, i // 2, MUSEUM) for i, q in enumerate(
        ("What is a CPU?", "Who built ENIAC?", "What is RAM?", "Name an old computer.",
         "What was the Altair 8800?", "What is a transistor?"))] + [_p(LONG_TEXT, 2)],
}


# Speculative decoding's pair needs output that prompt lookup can find in the prompt: copy and edit
# tasks (the answer repeats the prompt's words), greedy, as bench/spec_decode.py's repetitive workload.
# The pool and budget are roomy: drafts, not memory pressure or chunking, are what this pair is about.
# NOTE: async scheduling off on both sides: with ngram drafts the engine turns it off (as v0.27.1
# does), so on a GPU, where it is on by default, side A would differ in two knobs.
SPEC_PAIR_WORKLOAD = {
    "engine_args": {"max_num_batched_tokens": 512, "num_gpu_blocks_override": 64, "max_model_len": 256,
                    "max_num_seqs": 8, "async_scheduling": False},
    "max_tokens": 40, "ignore_eos": False,
    "prompts": [_p(q, i // 2) for i, q in enumerate((
        "Repeat this sentence exactly: The night train to the coast leaves at nine, stops at every village "
        "on the way, and reaches the harbour before dawn.",
        "Copy this list exactly, keeping the commas: red, orange, yellow, green, blue, indigo, violet, "
        "black, white, grey.",
        "Repeat after me, word for word: a block table maps each request's logical blocks to physical "
        "blocks in one shared pool of key and value memory.",
        "Write this line of Python again, unchanged: total = sum(price * count for price, count in "
        "zip(prices, counts))"))],
}
# The ngram drafts the pair's B side uses by default (bench/spec_decode.py's: K = 3, prompt lookup 2..4).
NGRAM_K3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def pair_workload(knob: str) -> dict:
    """The prompts and engine arguments a pair on `knob` runs (its own for speculative decoding)."""
    return SPEC_PAIR_WORKLOAD if knob == "speculative_config" else PAIR_WORKLOAD


def pair_specs(knob: str, a, b, processes: int = 1) -> tuple[dict, dict]:
    """The pair workload twice, `knob` (an engine argument: components/compare knobs) set to a, then b."""
    w = pair_workload(knob)
    specs = []
    for side, value in (("a", a), ("b", b)):
        spec = build_spec(f"pair:{knob}", w["prompts"], {**w["engine_args"], knob: value}, w["max_tokens"],
                          w["ignore_eos"])
        spec["engine_args"][knob] = value          # (even a 0 or False: it is the point of the pair)
        spec["pair"] = {"knob": knob, "a": a, "b": b, "side": side}
        if processes == 3:
            spec["processes"] = 3
        specs.append(spec)
    return specs[0], specs[1]
