"""The run header: what the open run ran on and with, above every page.

    run_header()              the open run's header (nothing when no run is open)
    header_fields(meta, ...)  the (label, value, help) rows, value None = "not recorded"

Read from the run store's meta (tracing/factory.py: run_meta; docs/trace-format.md):
model, device, dtype, async scheduling, CUDA-graph mode, tensor-parallel size, block
size, KV blocks (and MB: kv_cache_bytes_per_block x num_gpu_blocks; for older runs the
block size from a worker snapshot's kv_cache_shape, as the pages compute it), the token budget
per step, max_num_seqs and the trace level. Runs recorded before a field was added
show "not recorded" for it.
"""
from __future__ import annotations

import html
import os

import streamlit as st

from dashboard import data
from dashboard.components.kv_memory import block_bytes, mb

ss = st.session_state
NOT_RECORDED = "not recorded"


def _get(meta: dict, *keys):
    cur = meta
    for k in keys:
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return cur


def header_fields(meta: dict, name: str | None = None, mr: dict | None = None) -> list[tuple[str, str | None, str]]:
    """(label, value or None when the run did not record it, tooltip) for the header. `mr`:
    a "model_runner" snapshot of the run, for the KV block size of runs recorded before the
    meta had it (its kv_cache_shape; components/kv_memory.py: block_bytes)."""
    cfg = meta.get("config")
    if not isinstance(cfg, dict):
        cfg = {}
    model = meta.get("model")
    device = meta.get("device")
    if device and meta.get("device_name"):
        device = f"{device} · {meta['device_name']}"
    dtype = _get(cfg, "model_config", "dtype")
    async_s = _get(cfg, "scheduler_config", "async_scheduling")
    graphs = _get(cfg, "compilation_config", "cudagraph_mode")
    sizes = _get(cfg, "compilation_config", "cudagraph_capture_sizes")
    if graphs and graphs != "NONE" and sizes:
        graphs = f"{graphs} (sizes {sizes[0]}–{sizes[-1]})"
    tp = _get(cfg, "parallel_config", "tensor_parallel_size")
    if tp is None:
        tp = _get(cfg, "parallel_config", "world_size")      # runs recorded before tensor_parallel_size
    blocks = _get(cfg, "cache_config", "num_gpu_blocks")
    if blocks is None:
        # NOTE: a run whose frontend never learnt the engine's count (a multi-process run
        # recorded before the ready message carried it): an override *is* the count.
        blocks = _get(cfg, "cache_config", "num_gpu_blocks_override")
    per_block = block_bytes(meta, mr)
    kv = None
    if blocks is not None:
        kv = f"{blocks:,}" + (f" ({mb(blocks * per_block)})" if per_block else f" (MB {NOT_RECORDED})")
        if per_block and isinstance(tp, int) and tp > 1:
            kv = kv[:-1] + f" over {tp} ranks)"      # every rank holds its own KV heads of each block
    budget = _get(cfg, "scheduler_config", "max_num_batched_tokens")
    rows = [
        ("run", name, "the run store's file name (its name in the URL)"),
        ("model", os.path.basename(str(model).rstrip("/")) if model else None, str(model or "")),
        ("device", device, "where the model ran (model_config.device; the chip's name)"),
        ("dtype", str(dtype).replace("torch.", "") if dtype else None, "weights and KV cache (model_config.dtype)"),
        ("async scheduling", None if async_s is None else ("on" if async_s else "off"),
         "scheduler_config.async_scheduling: step N+1 is scheduled while step N runs on the device"),
        ("CUDA graphs", graphs, "compilation_config.cudagraph_mode: FULL_DECODE_ONLY replays a captured graph for "
                                "pure-decode batches (padded to a capture size); FULL_AND_PIECEWISE also replays "
                                "graph pieces around eager attention for other batches; NONE = always eager "
                                "(every CPU run)"),
        ("TP", None if tp is None else str(tp), "tensor-parallel size (parallel_config.tensor_parallel_size)"),
        ("block size", None if _get(cfg, "cache_config", "block_size") is None
         else f"{_get(cfg, 'cache_config', 'block_size')} tokens", "tokens per KV-cache block (cache_config.block_size)"),
        ("KV blocks", kv, "cache_config.num_gpu_blocks, and their size: K and V of every layer. Block 0 is the "
                          "null block (never allocated): requests hold the other num_gpu_blocks − 1"),
        ("token budget", None if budget is None else f"{budget:,} / step",
         "scheduler_config.max_num_batched_tokens: tokens scheduled per step at most"),
        ("max_num_seqs", None if _get(cfg, "scheduler_config", "max_num_seqs") is None
         else str(_get(cfg, "scheduler_config", "max_num_seqs")), "running requests at most (scheduler_config.max_num_seqs)"),
        ("trace", meta.get("trace_level"), "trace level: off | spans | full (full = per-step snapshots)"),
    ]
    if _get(cfg, "load_config", "load_format") == "dummy":
        rows.insert(2, ("weights", "random (load_format dummy)", "load_config.load_format='dummy': the model's "
                        "config, random weights (model_executor/dummy_loader.py) — its times are the real model's, "
                        "its text is noise"))
    return rows


CSS = """<style>
.va-run-header{font-size:0.86rem;line-height:1.75;color:#31333f;padding:0.1rem 0 0.2rem 0;
  border-bottom:1px solid #e6e6ea;margin-bottom:0.4rem}
.va-run-header .f{white-space:nowrap;margin-right:0.9rem;display:inline-block}
.va-run-header .l{color:#555a66}
.va-run-header .v{font-weight:600;color:#1f2330}
.va-run-header .nr{font-style:italic;color:#6b6f7a;font-weight:400}
</style>"""


def render(rows: list[tuple[str, str | None, str]]) -> str:
    parts = []
    for label, value, help_ in rows:
        v = (f'<span class="v nr">{NOT_RECORDED}</span>' if value is None
             else f'<span class="v">{html.escape(str(value))}</span>')
        parts.append(f'<span class="f" title="{html.escape(help_, quote=True)}"><span class="l">'
                     f'{html.escape(label)}</span> {v}</span>')
    return CSS + '<div class="va-run-header" data-testid="va-run-header">' + "".join(parts) + "</div>"


def run_header(path: str | None = None) -> None:
    """The header of the run at `path` (default: the open run); nothing when there is none
    or it cannot be read (the page says why); the refusal when the URL named a run that
    cannot be opened."""
    if path is None and ss.get("run_error") is not None:
        st.error(ss.run_error.message, icon=":material/block:")     # a run the URL named that cannot be opened
        return
    path = path or ss.get("run_path")
    if not path or not os.path.exists(path):
        return
    info = data.run_info(path, data.file_version(path))
    if isinstance(info, data.RunError):
        return
    mr = None
    if not info["meta"].get("kv_cache_bytes_per_block") and info["steps"]:
        first = data.step_data(path, info["steps"][0])      # an older run: its block size from a snapshot
        mr = first.get("mr") if isinstance(first, dict) else None
    st.markdown(render(header_fields(info["meta"], os.path.basename(path), mr)), unsafe_allow_html=True)
