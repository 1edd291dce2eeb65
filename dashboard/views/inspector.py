"""Step inspector: one committed step of the open run, scrubbed, played or
followed live. Every panel is drawn from the step's snapshots ("step" from
EngineCore, "model_runner" from the worker) and the previous step's, for the diff;
the Worker tab adds the step's forward-pass decision (CUDA graph or eager) and its
device-lane spans (phases, layers, kernels).

The tabs are bound to the URL's `tab` (a link can open the KV tab) and only the open
tab's panels are computed."""
from __future__ import annotations

import streamlit as st

from dashboard import data, spans, state
from dashboard.answers.cached import source
from dashboard.components.block_pool import block_pool
from dashboard.components.block_tables import block_tables
from dashboard.components.budget import budget
from dashboard.components.device_lane import device_lane
from dashboard.components.diff import diff
from dashboard.components.focus import focus_anchor
from dashboard.components.input_batch import input_batch
from dashboard.components.kv_memory import block_bytes
from dashboard.components.nav import TAB_KEY, TABS
from dashboard.components.parallel_sampling import parallel_sampling_note
from dashboard.components.prepare_inputs import prepare_inputs
from dashboard.components.queues import queues, state_machine, transitions
from dashboard.components.sampled import execution_mode, execution_panel, sampled
from dashboard.components.scrubber import scrubber
from dashboard.components.sched_output import scheduler_output
from dashboard.components.slot_mapping import kv_write_note, slot_mapping
from dashboard.components.spec_decode import spec_decode
from dashboard.components.tensor_parallel import tp_facts, tp_line, tp_panel


def finish_reasons(path: str, version: tuple) -> dict[str, str]:
    reqs = spans.request_table(path, version)
    if isinstance(reqs, data.RunError):
        return {}
    return {r["request_id"]: (r["finish_reasons"] or [""])[0] for r in reqs}


def final_lengths(path: str, version: tuple) -> dict[str, int]:
    """request id -> prompt + output tokens of each finished request (its llm_request span)."""
    reqs = spans.request_table(path, version)
    if isinstance(reqs, data.RunError):
        return {}
    return {r["request_id"]: r["input_tokens"] + r["output_tokens"] for r in reqs
            if r["input_tokens"] is not None and r["output_tokens"] is not None}


def step_spans(path: str, version: tuple, meta: dict, step_id: int):
    df = spans.span_table(path, version, str(meta.get("device")))
    if isinstance(df, data.RunError) or df.empty:
        return None
    return df[df["step_id"] == step_id]


def tensor_parallel(path: str, version: tuple, meta: dict, step_id: int) -> dict | None:
    """The step's ranks and collectives (components/tensor_parallel.py), None unless the run is
    tensor-parallel; when its spans cannot be read, the message, and None (the step is still shown)."""
    if not meta.get("ranks"):
        return None
    src = source(path, version)
    if isinstance(src, data.RunError):
        state.show_error(src)
        return None
    return tp_facts(src, step_id)


def main() -> None:
    st.title("Step inspector")
    cur = state.current()
    if cur is None:
        return
    path, info = cur
    version = data.file_version(path)
    steps = info["steps"]
    step_id = scrubber(steps)
    d = data.step_data(path, step_id)
    if isinstance(d, data.RunError):
        state.show_error(d)
        return
    idx = steps.index(step_id)
    p = data.step_data(path, steps[idx - 1]) if idx > 0 else None
    prev = p["step"] if isinstance(p, dict) else None
    step, mr = d["step"], d["mr"]
    moves = transitions(prev, step, finish_reasons(path, version))
    kv = step["scheduler"]["kv_cache"]
    per_block = block_bytes(info["meta"], mr, kv.get("block_size"))
    c1, c2 = st.columns([2, 3])
    with c1:
        diff(prev, step, moves)
    with c2:
        queues(step, per_block)
    # NOTE: full width: all twelve statuses stay readable (text ≥ 12 px) only at this size.
    state_machine(moves)
    head, _ = execution_mode(info["meta"], (mr.get("prepare_inputs") or {}).get("cudagraph"))
    st.markdown(f":material/memory: Forward pass: **{head}** — why, and the device lane: *Worker* tab")
    tp = tensor_parallel(path, version, info["meta"], step_id)
    if tp is not None:
        st.markdown(tp_line(tp))
    focus_anchor()        # the request a link named, and where a link that names a tab lands
    t_sched, t_kv, t_worker = st.tabs(list(TABS.values()), key=TAB_KEY, bind="query-params")
    if t_sched.open is not False:
        with t_sched:
            budget(step["scheduler"]["step_record"])
            scheduler_output(step["scheduler_output"], step["scheduler"]["step_record"])
    if t_kv.open is not False:
        with t_kv:
            block_pool(kv, step.get("block_pool_events", []), prev["scheduler"]["kv_cache"] if prev else None,
                       per_block)
            parallel_sampling_note(kv)
            block_tables(kv, per_block)
    if t_worker.open is not False:
        with t_worker:
            tokens = data.token_index(path, version)
            if isinstance(tokens, data.RunError):
                state.show_error(tokens)
                tokens = {"sampled": {}, "tokens": {}}
            execution_panel(info["meta"], mr)
            if tp is not None:
                tp_panel(tp)
            lane = step_spans(path, version, info["meta"], step_id)
            device_lane(lane, str(info["meta"].get("device")), step_id, info["meta"].get("device_name"))
            sampled(info["meta"], step_id, tokens, step["scheduler_output"], final_lengths(path, version))
            spec_decode(info["meta"], step, kv["block_size"], d["verified"], d.get("spec"), d.get("next_spec"))
            pi = mr.get("prepare_inputs")
            if pi:
                mode = (pi.get("cudagraph") or {}).get("mode")
                slot_mapping(pi, kv["block_size"], kv_write_note(lane, mode, str(info["meta"].get("device"))))
            prepare_inputs(pi, kv["block_size"])
            input_batch(mr, per_block)


main()
