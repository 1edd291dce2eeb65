"""What every lesson shares: record a real run, narrate, check a fact, link to the dashboard.

A lesson is a script (`python lessons/NN_name.py` or `vllm-anatomy lesson N`) that
1. runs a real scenario on the default model with tracing at level "full",
2. narrates what happened, with this run's numbers,
3. checks the facts it teaches from the recorded run store (so it is also a test),
4. ends with the command that opens the dashboard at the run, page and step that shows it.
"""
from __future__ import annotations

import os
import sys
import textwrap
import time
import urllib.parse
from dataclasses import dataclass

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.outputs import RequestOutput
from vllm_anatomy.tracing.reader import Run, open_run

# Where lesson runs are recorded; the dashboard lists this folder too.
LESSON_TRACE_DIR = os.environ.get("VLLM_ANATOMY_LESSON_TRACE_DIR", os.path.join("vllm_anatomy_traces", "lessons"))
DASHBOARD_URL = os.environ.get("VLLM_ANATOMY_DASHBOARD_URL", "http://127.0.0.1:8501")


@dataclass
class RecordedRun:
    llm: LLM
    outputs: list[RequestOutput]
    path: str

    def open(self) -> Run:
        return open_run(self.path)


def make_llm(**engine_args) -> LLM:
    """An LLM on the default model that records a run store at level "full"."""
    engine_args.setdefault("trace_level", "full")
    engine_args.setdefault("trace_dir", LESSON_TRACE_DIR)
    return LLM(**engine_args)


def run_path(llm: LLM) -> str:
    return llm.llm_engine.recorder.run_path


def finish(llm: LLM) -> str:
    """Flush and close the run store (every span written); returns its path."""
    path = run_path(llm)
    llm.llm_engine.shutdown()
    return path


def chat_prompts(llm: LLM, questions: list[str], system: str | None = None) -> list[dict]:
    tok = llm.get_tokenizer()
    prompts = []
    for q in questions:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
        prompts.append({"prompt_token_ids": ids})
    return prompts


def fixed_len(tok, text: str, n: int) -> list[int]:
    """Exactly n token ids: `text` repeated as often as needed, then cut."""
    ids = tok.encode(text)
    while len(ids) < n:
        ids += tok.encode(" " + text)
    return ids[:n]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# -- narration ---------------------------------------------------------------------
def title(text: str) -> None:
    print(f"\n\033[1m{text}\033[0m\n{'=' * len(text)}")


def say(text: str) -> None:
    """One paragraph: line breaks and indentation (e.g. of a multi-line f-string) fold into spaces."""
    print(textwrap.fill(" ".join(text.split()), width=88), end="\n\n")


def check(condition: bool, fact: str) -> None:
    """Assert a fact the lesson teaches, from this run's data; print it when it holds."""
    if not condition:
        raise AssertionError(f"lesson fact does not hold: {fact}")
    print(f"  \u2713 {fact}")


def dashboard_link(path: str, page: str, step: int | None = None) -> str:
    """The command and URL that open the dashboard at this run, page and step."""
    query = {"run": os.path.abspath(path), "page": page}
    if step is not None:
        query["step"] = str(step)
    url = f"{DASHBOARD_URL}/?{urllib.parse.urlencode(query)}"
    trace_dir = os.path.dirname(os.path.abspath(path))
    print("\nSee it in the dashboard:")
    print(f"  vllm-anatomy dashboard --trace-dir {trace_dir}    # then open:")
    print(f"  {url}")
    return url


class Stopwatch:
    def __enter__(self) -> "Stopwatch":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0


if __name__ == "__main__":
    sys.exit("This module is shared by the lessons; run one of lessons/NN_*.py instead.")
