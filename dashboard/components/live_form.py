"""The form that starts a live run: a scenario (prompts + engine arguments that show
one mechanism), editable prompts, engine arguments and sampling settings.

Prompt lines: `[+N] text` makes the request arrive at engine step N (default 0);
`[+N nosys] text` leaves out the shared system prompt.
"""
from __future__ import annotations

import re

import streamlit as st

from dashboard.scenarios import SCENARIOS, build_spec

ss = st.session_state
PROCESSES = {1: "one process (LLMEngine in-process)",
             3: "three processes, as `vllm-anatomy serve` (API server → EngineCoreProc → worker)"}
LINE = re.compile(r"^\[\+(\d+)( nosys)?\]\s*(.*)$")
ARG_FIELDS = [("max_num_batched_tokens", "max_num_batched_tokens", 0, 8192, "token budget per step (0 = default)"),
              ("num_gpu_blocks_override", "num_gpu_blocks_override", 0, 100000, "KV blocks (0 = from memory)"),
              ("max_num_seqs", "max_num_seqs", 0, 1024, "max running requests (0 = default)"),
              ("max_model_len", "max_model_len", 0, 8192, "max tokens per request (0 = the model's)")]


def prompt_lines(scenario: dict) -> tuple[str, str]:
    system = next((p["system"] for p in scenario["prompts"] if p.get("system")), "")
    lines = []
    for p in scenario["prompts"]:
        nosys = " nosys" if system and not p.get("system") else ""
        lines.append(f"[+{p['arrive_step']}{nosys}] {p['text']}")
    return system, "\n".join(lines)


def parse_prompts(text: str, system: str) -> list[dict]:
    prompts = []
    for raw in text.splitlines():
        raw = raw.strip()
        if not raw:
            continue
        m = LINE.match(raw)
        step, nosys, body = (int(m.group(1)), bool(m.group(2)), m.group(3)) if m else (0, False, raw)
        if body:
            prompts.append({"text": body, "arrive_step": step, "system": None if nosys or not system else system})
    return prompts


def load_scenario() -> None:
    """Callback: fill the form from the chosen scenario."""
    sc = SCENARIOS[ss.lf_scenario]
    ss.lf_system, ss.lf_prompts = prompt_lines(sc)
    for key, *_ in ARG_FIELDS:
        ss[f"lf_{key}"] = int(sc["engine_args"].get(key, 0))
    ss.lf_block_size = int(sc["engine_args"].get("block_size", 16))
    ss.lf_prefix = bool(sc["engine_args"].get("enable_prefix_caching", True))
    ss.lf_max_tokens, ss.lf_ignore_eos = sc["max_tokens"], sc["ignore_eos"]
    ss.lf_delay = float(sc.get("step_delay_s", 0.0))


def live_form() -> dict | None:
    """Draw the form; return the run spec when Start was pressed with valid prompts."""
    if "lf_scenario" not in ss:
        ss.lf_scenario = "tour"
        load_scenario()
    st.selectbox("Scenario", list(SCENARIOS), key="lf_scenario", format_func=lambda k: SCENARIOS[k]["label"],
                 on_change=load_scenario)
    with st.form("live_form", border=False):
        c1, c2 = st.columns([3, 2])
        with c1:
            st.text_input("Shared system prompt (identical prefix → prefix-cache hits)", key="lf_system")
            st.text_area("Prompts, one per line (`[+N] text`: arrives at step N)", key="lf_prompts", height=150)
        with c2:
            a, b = st.columns(2)
            for i, (key, label, lo, hi, help_) in enumerate(ARG_FIELDS):
                (a if i % 2 == 0 else b).number_input(label, lo, hi, key=f"lf_{key}", help=help_)
            a.selectbox("block_size", [8, 16, 32], key="lf_block_size")
            b.number_input("max_tokens", 1, 512, key="lf_max_tokens")
            a.checkbox("enable_prefix_caching", key="lf_prefix")
            b.checkbox("ignore_eos", key="lf_ignore_eos", help="generate exactly max_tokens")
            st.slider("pause between steps (s), to watch it live", 0.0, 2.0, step=0.1, key="lf_delay")
        st.radio("Processes", [1, 3], key="lf_processes", horizontal=True, format_func=PROCESSES.get,
                 help="three: the engine starts as `vllm-anatomy serve` starts it — the OpenAI API server (this "
                      "run's frontend), EngineCoreProc in its own process, the worker behind the shared-memory "
                      "ring (--distributed-executor-backend mp); prompts arrive as HTTP requests. The Processes "
                      "page draws the hops between them.")
        start = st.form_submit_button(":material/play_arrow: Start live run")
    if not start:
        return None
    prompts = parse_prompts(ss.lf_prompts, ss.lf_system.strip())
    if not prompts:
        st.error("Type at least one prompt.")
        return None
    args = {key: ss[f"lf_{key}"] for key, *_ in ARG_FIELDS}
    args.update(block_size=ss.lf_block_size, enable_prefix_caching=ss.lf_prefix)
    spec = build_spec(ss.lf_scenario, prompts, args, ss.lf_max_tokens, ss.lf_ignore_eos, ss.lf_delay)
    if ss.get("lf_processes") == 3:
        spec["processes"] = 3           # dashboard/live_engine.py: drive_http
    return spec
