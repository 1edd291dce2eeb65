"""What every lesson shares: record a real run, narrate, check a fact, link to the dashboard.

A lesson is a script (`python lessons/NN_name.py` or `vllm-anatomy lesson N`) that
1. runs a real scenario on the default model with tracing at level "full",
2. narrates what happened, with this run's numbers,
3. checks the facts it teaches from the recorded run store (so it is also a test),
4. ends with the link that opens the dashboard at the run, page, step, tab and request
   that show it, on the dashboard that is running (or the command that starts one), and
   names the dashboard's lesson cards on the same idea.

The dashboard's address: $VLLM_ANATOMY_DASHBOARD_URL if set, else http://127.0.0.1 on
$STREAMLIT_SERVER_PORT (Streamlit's own variable, which `make run` and `vllm-anatomy
dashboard` honour; `vllm-anatomy lesson N --port P` sets it), else 8501. Runs are
recorded in $VLLM_ANATOMY_LESSON_TRACE_DIR, else in the lessons folder of the
dashboard's trace directory (<$VLLM_ANATOMY_TRACE_DIR or vllm_anatomy_traces>/lessons),
where a dashboard started with the same settings lists them.
"""
from __future__ import annotations

import os
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from vllm_anatomy import LLM, SamplingParams
from vllm_anatomy.engine.arg_utils import teaching_attention_backend
from vllm_anatomy.outputs import RequestOutput
from vllm_anatomy.tracing.reader import Run, open_run

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:      # for dashboard.lessons (the cards) and dashboard.components.tabs
    sys.path.append(REPO_ROOT)
# Where lesson runs are recorded: the lessons folder the dashboard lists (dashboard/state.py: lessons_dir).
LESSON_TRACE_DIR = os.environ.get("VLLM_ANATOMY_LESSON_TRACE_DIR") or os.path.join(
    os.environ.get("VLLM_ANATOMY_TRACE_DIR") or "vllm_anatomy_traces", "lessons")
PORT_ENV = "STREAMLIT_SERVER_PORT"
DEFAULT_PORT = 8501


@dataclass
class RecordedRun:
    llm: LLM
    outputs: list[RequestOutput]
    path: str

    def open(self) -> Run:
        return open_run(self.path)


def snapshot(run: Run, step: int, kind: str = "step") -> dict[str, Any]:
    """The `kind` snapshot ("step" or "model_runner") of one of run.steps(), decoded.

    NOTE: never None for the runs a lesson reads: run.steps() lists the steps whose "step"
    snapshot is committed, and the worker records its "model_runner" snapshot for every step
    it ran (level "full"), before finish() flushes and closes the store. Run.snapshot answers
    None only for a step it has no row of, which would be a recording bug: said here, by name."""
    snap = run.snapshot(step, kind)
    assert snap is not None, f"{run.path}: step {step} has no {kind!r} snapshot"
    return snap


def make_llm(**engine_args) -> LLM:
    """An LLM on the default model that records a run store at level "full" (attention: the torch reference on a CPU)."""
    engine_args.setdefault("trace_level", "full")
    engine_args.setdefault("trace_dir", LESSON_TRACE_DIR)
    engine_args.setdefault("attention_backend", teaching_attention_backend())
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


def dashboard_base() -> str:
    """The running dashboard's address (see the module docstring)."""
    url = os.environ.get("VLLM_ANATOMY_DASHBOARD_URL")
    if url:
        return url.rstrip("/")
    port = os.environ.get(PORT_ENV, "").strip()
    return f"http://127.0.0.1:{port if port.isdigit() else DEFAULT_PORT}"


def dashboard_url(path: str, page: str, step: int | None = None, tab: str | None = None,
                  request: str | None = None, base: str | None = None) -> str:
    """The deep link: run (by file name), page, step, tab (a key of the inspector's TABS; the URL
    carries its label) and request, in the order the dashboard writes them."""
    from dashboard.components.tabs import TABS
    query = {"run": os.path.basename(path), "page": page, "step": None if step is None else str(step),
             "tab": TABS.get(tab, tab) if tab else None, "request": request}
    return f"{base or dashboard_base()}/{page}?" + urllib.parse.urlencode({k: v for k, v in query.items() if v})


def dashboard_answers(base: str, timeout: float = 0.5) -> bool:
    """Does a Streamlit server answer at base (its health endpoint)?"""
    try:
        with urllib.request.urlopen(f"{base}/_stcore/health", timeout=timeout) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def _lesson_number() -> int | None:
    name = os.path.basename(sys.argv[0] or "")
    return int(name[:2]) if name[:2].isdigit() else None


def dashboard_link(path: str, page: str, step: int | None = None, tab: str | None = None,
                   request: str | None = None) -> str:
    """Print the link that opens the dashboard at this run, page, step, tab and request (and how to
    start a dashboard that lists the run, if none answers), then the dashboard's lesson cards on the
    same idea; return the link."""
    base = dashboard_base()
    url = dashboard_url(path, page, step, tab, request, base)
    run_dir = os.path.dirname(os.path.abspath(path))
    port = base.rsplit(":", 1)[-1].split("/")[0]
    trace_arg = os.path.dirname(run_dir) if os.path.basename(run_dir) == "lessons" else run_dir
    start = f"vllm-anatomy dashboard --trace-dir {trace_arg}" + (f" --port {port}" if port.isdigit() else "")
    print("\nSee it in the dashboard:")
    print(f"  {url}")
    if dashboard_answers(base):
        print(f"  (a dashboard answers at {base}: it opens this run if it lists {run_dir}, i.e. was started "
              f"with the same trace directory; else: {start})")
    else:
        print(f"  (no dashboard answers at {base}; start one that lists this run: {start})")
    number = _lesson_number()
    if number is not None:
        try:
            from dashboard.lessons import cards_for_cli
        except ImportError:       # the lessons run without the dashboard's dependencies
            return url
        cards = cards_for_cli(number)
        if cards:
            print("The dashboard's lesson cards on the same idea (each opens the step of this run that shows it):")
            for card in cards:
                print(f"  - {card.title}")
            print(f"  {dashboard_url(path, 'lessons', base=base)}")
    return url


class Stopwatch:
    def __enter__(self) -> "Stopwatch":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0


if __name__ == "__main__":
    sys.exit("This module is shared by the lessons; run one of lessons/NN_*.py instead.")
