"""The device lane of one step: where the step's time went on the GPU.

Phases back to back (GPU.prepare_inputs, GPU.model_forward, GPU.compute_logits,
GPU.sample, GPU.d2h), from CUDA events read after the step's one sync point. An
eager step also has one GPU.layer span per decoder layer and, at trace level
full, one GPU.kernel.* span per kernel launch with its grid, token count and
bytes moved, so the achieved bandwidth (bytes / duration) can be read off. A CUDA
graph replay is a single GPU.model_forward span: events cannot be recorded
between a graph's kernels. With a draft model (speculative decoding), after the
target's phases: the drafter's GPU.propose_draft_token_ids, its forwards
(GPU.draft_model_forward, on the layers row) and their kernels.

Also the formatting shared with the timeline figure (bar labels, hover text).
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard.components.code_ref import code_ref
from dashboard.theme import span_color, style_figure
from dashboard.words import n_of

PHASES = ["GPU.prepare_inputs", "GPU.model_forward", "GPU.compute_logits", "GPU.sample", "GPU.d2h"]


def gb_per_s(nbytes, dur_ms) -> float | None:
    """Achieved bandwidth in GB/s (1e9 bytes per second)."""
    if nbytes is None or pd.isna(nbytes) or not dur_ms or pd.isna(dur_ms) or dur_ms <= 0:
        return None
    return float(nbytes) / (float(dur_ms) * 1e-3) / 1e9


def _get(r, key):
    v = r.get(key) if hasattr(r, "get") else None
    if v is None or (not isinstance(v, (list, str)) and pd.isna(v)):
        return None
    return int(v) if isinstance(v, float) and v.is_integer() and key != "dur_ms" else v


def forward_label(r) -> str:
    """`GPU.model_forward · CUDA graph replay, padded 5→8`, `… · piecewise graphs, …` or `… · eager`."""
    mode, padded, n = _get(r, "cudagraph_mode"), _get(r, "num_padded_tokens"), _get(r, "num_scheduled_tokens")
    if mode in ("FULL", "PIECEWISE"):
        size = (f"padded {int(n)}→{int(padded)}" if n is not None and padded is not None and padded > n
                else f"{int(padded)} tokens" if padded is not None else "")
        what = "CUDA graph replay" if mode == "FULL" else "piecewise graphs, attention eager"
        return f"{r['name']} · {what}, {size}".rstrip(", ")
    if mode is not None:
        return f"{r['name']} · eager"
    return r["name"]


def family(df: pd.DataFrame) -> pd.Series:
    """Legend group (and colour) of each span: process-side by class, device phases as
    "device", layers as GPU.layer, kernels by kernel name."""
    fam = df["name"].str.split(".").str[0]
    if "device_row" not in df:
        return fam.where(df["lane"] != "device", "device")
    dev_fam = df["name"].where(df["device_row"] == "kernels", "GPU.layer").where(
        df["device_row"] != "phases", "device")
    if "drafter" in df:       # the draft model's phase and forwards (its kernels: by kernel name)
        dev_fam = dev_fam.where(~(df["drafter"].eq(True) & (df["device_row"] != "kernels")), "drafter")
    return dev_fam.where(df["lane"] == "device", fam)


def _one_label(r) -> str:
    name = r["name"]
    if r.get("host_timing"):
        return f"{name} (host timing)"
    if name == "GPU.layer" and _get(r, "layer") is not None:
        return f"L{int(r['layer'])}"
    if name == "GPU.draft_model_forward" and _get(r, "draft_forward") is not None:
        return f"draft {int(r['draft_forward'])}"
    if name == "GPU.propose_draft_token_ids":
        return "drafter"
    if name.startswith("GPU.kernel."):
        return name[len("GPU.kernel."):]
    if name in ("GPU.model_forward", "GPUModelRunner._model_forward") and r.get("lane") == "device":
        return forward_label(r)
    return name


def bar_label(g: pd.DataFrame) -> list[str]:
    return [_one_label(r) for r in g.to_dict("records")]


def _one_hover(r) -> str:
    step = _get(r, "step_id")
    lines = [_one_label(r) if r["name"] != "GPU.layer" else r["name"],
             f"{f'step {int(step)}' if step is not None else 'outside every step'} · {r['dur_ms']:.3f} ms"]
    if _get(r, "cudagraph_mode") is not None:
        lines.append(f"cudagraph_mode {r['cudagraph_mode']} · {_get(r, 'num_padded_tokens')} tokens run"
                     + (f" · {r['cudagraph_reason']}" if _get(r, "cudagraph_reason") else ""))
    if _get(r, "layer") is not None:
        lines.append(f"decoder layer {int(r['layer'])}")
    if r["name"] == "GPU.propose_draft_token_ids":
        lines.append("the draft model, after the target's sampling (speculative decoding)")
    if r["name"] == "GPU.draft_model_forward" and _get(r, "draft_forward") is not None:
        j = int(r["draft_forward"])
        lines.append(f"draft model forward {j}: " + ("the first pass" if j == 0 else f"decode forward {j}")
                     + f" · {n_of(_get(r, 'num_tokens'), 'token')}")
    if r["name"].startswith("GPU.kernel."):
        layer = _get(r, "kernel_layer")
        rate = gb_per_s(_get(r, "bytes"), r["dur_ms"])
        where = ("draft model" if _get(r, "drafter") else f"layer {int(layer)}" if layer is not None
                 else "outside every decoder layer")
        lines.append(f"{where} · grid {_get(r, 'grid')} · {n_of(_get(r, 'num_tokens'), 'token')}")
        if _get(r, "bytes") is not None:
            lines.append(f"{r['bytes'] / 1e6:.3f} MB moved" + (f" · {rate:.0f} GB/s achieved" if rate else ""))
    if _get(r, "sync_wait_ms") is not None:
        lines.append(f"sync wait {r['sync_wait_ms']:.2f} ms")
    return "<br>".join(lines)


def hover_text(g: pd.DataFrame) -> list[str]:
    return [_one_hover(r) for r in g.to_dict("records")]


# -- the panel of the step inspector --------------------------------------------------------
def kernel_table(dev: pd.DataFrame) -> pd.DataFrame:
    """One row per kernel launch: layer, kernel, grid, tokens, bytes, µs, GB/s."""
    k = dev[dev["device_row"] == "kernels"].sort_values("start_ns")
    fwd = k["kernel_draft_forward"] if "kernel_draft_forward" in k else pd.Series(None, index=k.index, dtype=object)
    # With a draft model (speculative decoding), a first column says whose launch it is: the
    # target's, or the draft model's forward j (0: its first pass).
    model = {"model": ["target" if f is None or pd.isna(f) else f"draft {int(f)}" for f in fwd]} \
        if fwd.notna().any() else {}
    return pd.DataFrame({
        **model,
        "layer": [None if v is None or pd.isna(v) else int(v) for v in k["kernel_layer"]],
        "kernel": k["name"].str.slice(len("GPU.kernel.")), "grid": k["grid"],
        "tokens": k["num_tokens"], "bytes": k["bytes"], "µs": (k["dur_ms"] * 1e3).round(2),
        "GB/s": [gb_per_s(b, d) for b, d in zip(k["bytes"], k["dur_ms"])],
    })


def kernel_summary(launches: pd.DataFrame) -> pd.DataFrame:
    """Per kernel: launches, total and mean time, bytes, bandwidth over all its launches."""
    rows = []
    # (the draft model's launches apart from the target's: "draft 1" -> "draft")
    model = launches["model"].str.split(" ").str[0] if "model" in launches else pd.Series("", index=launches.index)
    for (who, name), g in launches.groupby([model, launches["kernel"]], sort=False):
        total_us = g["µs"].sum()
        nbytes = g["bytes"].sum() if g["bytes"].notna().any() else None
        rows.append({**({"model": who} if who else {}), "kernel": name, "launches": len(g),
                     "total µs": round(total_us, 1),
                     "mean µs": round(total_us / len(g), 2),
                     "MB": None if nbytes is None else nbytes / 1e6,
                     "GB/s": None if nbytes is None or total_us <= 0 else nbytes / (total_us * 1e-6) / 1e9})
    return pd.DataFrame(rows)


# Spec-sheet memory bandwidth (GB/s) by the name the run recorded (meta device_name,
# torch.cuda.get_device_name), first match wins: "NVIDIA H100 80GB HBM3" is an H100 SXM.
PEAK_GBPS_BY_NAME = [("H200", 4800.0, "an H200's HBM3e"), ("H100 PCIe", 2000.0, "an H100 PCIe's HBM2e"),
                     ("H100 NVL", 3900.0, "an H100 NVL's HBM3"), ("H100", 3350.0, "an H100 SXM's HBM3"),
                     ("A100-SXM4-80GB", 2039.0, "an A100 80GB's HBM2e"), ("A100 80GB", 1935.0, "an A100 80GB PCIe's HBM2e"),
                     ("A100", 1555.0, "an A100 40GB's HBM2")]
PEAK_GBPS = 4800.0       # where the GPU is not one of those: the largest, so the note below stays conservative
LAUNCH_BOUND = 0.05      # below 5 % of it, the kernels' bandwidth says little about the memory


def peak_bandwidth(device_name: str | None) -> tuple[float, str] | None:
    """(GB/s, which memory) of the run's GPU from its recorded name; None for a GPU not listed."""
    for key, gbps, what in PEAK_GBPS_BY_NAME:
        if key in (device_name or ""):
            return gbps, what
    return None


def bandwidth_heading(device_name: str | None) -> str:
    """The kernel table's heading, naming the run's own GPU's bandwidth (not another card's)."""
    peak = peak_bandwidth(device_name)
    ref = (f"the GPU's memory bandwidth ({peak[1]}: about {peak[0]:,.0f} GB/s)" if peak is not None else
           f"the GPU's memory bandwidth ({device_name or 'this GPU'}: see its spec sheet)")
    return f"**Kernel launches** (this step) · achieved GB/s = bytes moved / duration — compare with {ref}"


def launch_bound_note(launches: pd.DataFrame, device_name: str | None = None) -> str | None:
    """The caveat for tiny kernels: at a few KB to a few MB per launch, a kernel's time is mostly its
    fixed launch and scheduling cost, so bytes / time is far below the memory's bandwidth."""
    rates = [r for r in launches.get("GB/s", []) if r is not None and pd.notna(r)]
    peak = peak_bandwidth(device_name)
    gbps = peak[0] if peak is not None else PEAK_GBPS
    if not rates or max(rates) >= LAUNCH_BOUND * gbps:
        return None
    mb_per = launches["bytes"].dropna()
    size = (f"{mb_per.median() / 1e6:.2f} MB per launch (median)" if not mb_per.empty else "little data per launch")
    return (f"Launch-bound, not bandwidth-bound: this small model's kernels move {size}, so each launch's fixed cost "
            f"(a few µs to start a grid and drain it) dominates its time, and the achieved rate ({min(rates):.1f}–"
            f"{max(rates):.1f} GB/s here) says nothing about the GPU's "
            f"{f'~{gbps:,.0f} GB/s' if peak is not None else 'memory bandwidth'}. Large models and "
            f"batches move MBs to GBs per kernel and approach it; `bench/kernel_bench.py` measures the same kernels at "
            f"those sizes. CUDA graphs exist for this: one replay pays the launch cost once for the whole forward.")


def step_figure(dev: pd.DataFrame) -> go.Figure:
    """The step's device spans on three rows (phases, layers, kernels), in µs (ms past 5 ms)
    since its first one."""
    t0 = dev["start_ns"].min()
    unit, per_ns = ("ms", 1e6) if dev["end_ns"].max() - t0 > 5e6 else ("µs", 1e3)
    dev = dev.assign(start=(dev["start_ns"] - t0) / per_ns, dur=(dev["end_ns"] - dev["start_ns"]) / per_ns,
                     fam=family(dev))
    fig = go.Figure()
    for fam, g in dev.groupby("fam", sort=False):
        fig.add_bar(y=g["device_row"], x=g["dur"], base=g["start"], orientation="h", name=fam,
                    width=0.8, text=bar_label(g), textposition="inside", insidetextanchor="start",
                    marker=dict(color=span_color(fam), line=dict(color="white", width=0.5)),
                    hovertext=hover_text(g), hovertemplate="%{hovertext}<extra></extra>")
    rows = [r for r in ("phases", "layers", "kernels") if r in set(dev["device_row"])]
    fig.update_layout(barmode="overlay", height=90 + 40 * len(rows), margin=dict(l=10, r=10, t=10, b=36),
                      plot_bgcolor="white", xaxis_title=f"{unit} since the step's first device span",
                      yaxis=dict(categoryorder="array", categoryarray=rows[::-1]),
                      showlegend=False)
    style_figure(fig)
    return fig


def device_lane(step_spans: pd.DataFrame | None, device: str, step_id: int, device_name: str | None = None) -> None:
    """The Worker tab's device panel for one step (step_spans: that step's span_table rows; device_name:
    the run's GPU as recorded, for its memory bandwidth)."""
    dev = None if step_spans is None or step_spans.empty else step_spans[step_spans["lane"] == "device"]
    if dev is None or dev.empty:
        st.markdown("**Device lane** · no device span recorded for this step")
        code_ref("vllm_anatomy/tracing/device_timer.py", "DeviceTimer.mark / kernel / watch_layers → resolve")
        return
    if dev["host_timing"].all():
        parts = " · ".join(f"`{r['name'].split('.')[-1]}` {r['dur_ms']:.2f} ms" for r in dev.to_dict("records"))
        st.markdown(f"**Device lane** · no GPU ({device}): the host timings of the device work — {parts}")
        st.caption("On a CPU every op runs synchronously on the host, so there is no separate device timeline, "
                   "no CUDA graph and no per-kernel timing. Open the GPU sample run to see them.")
        code_ref("vllm_anatomy/tracing/device_timer.py", "DeviceTimer (CUDA only)")
        return
    dev = dev[~dev["host_timing"]]
    n_layers = int((dev["name"] == "GPU.layer").sum())
    launches = kernel_table(dev)
    fwd = dev[dev["name"] == "GPU.model_forward"]
    total = (dev["end_ns"].max() - dev["start_ns"].min()) / 1e6
    head = f"**Device lane** · step {step_id} · {total:.3f} ms on the device"
    if not fwd.empty:
        f = fwd.iloc[0]
        head += f" · forward {f['dur_ms']:.3f} ms ({forward_label(f).split(' · ', 1)[-1]})"
    n_k = len(launches)
    drafter = dev[dev["name"] == "GPU.propose_draft_token_ids"]
    n_draft = int((dev["name"] == "GPU.draft_model_forward").sum())
    if not drafter.empty:
        head += f" · drafter {drafter['dur_ms'].sum():.3f} ms" + (f" ({n_draft} forwards)" if n_draft else "")
    st.markdown(head + f" · {n_of(n_layers, 'layer span')} · {n_of(n_k, 'kernel launch', 'kernel launches')}")
    st.plotly_chart(step_figure(dev), width="stretch", key="device_step_fig", config={"displayModeBar": False})
    if not fwd.empty and fwd.iloc[0].get("cudagraph_mode") == "FULL":
        st.caption("A CUDA graph replay is one span: CUDA events cannot be recorded between a graph's kernels, "
                   "so there is no per-layer or per-kernel timing inside it (an eager step has both).")
    elif not fwd.empty and fwd.iloc[0].get("cudagraph_mode") == "PIECEWISE":
        st.caption("A piecewise replay: graph pieces (everything but attention) replayed around an eager "
                   "attention launch per layer. No per-layer spans (the layers' hooks ran only at capture); "
                   "at trace level full, the eager attention kernels are timed.")
    if not drafter.empty:
        st.caption("Speculative decoding: after the target's sampling, the draft model proposes the next step's "
                   "drafts (`drafter`): its first pass over the step's verified tokens, then one forward per further "
                   "draft (`draft 0`, `draft 1`, … on the layers row; their kernels beside the target's, model "
                   "`draft` below). Its time is what each step pays for the rounds the accepted drafts save."
                   + (" Async scheduling: nothing in the step waits for it; the next step's forward queues behind it."
                      if drafter["padded_drafter_batch"].eq(True).any() else ""))
    if n_layers:
        layers = dev[dev["name"] == "GPU.layer"]
        lay = layers["dur_ms"] * 1e3
        note = ""
        slow = layers.loc[lay.idxmax()]
        if lay.max() > 20 * lay.median() and lay.max() > 50e3:
            note = (f" Layer {_get(slow, 'layer')} took {lay.max() / 1e3:.0f} ms, {lay.max() / lay.median():.0f}× the "
                    "median: most likely the first launch of a new Triton kernel variant, compiled (JIT) on the "
                    "spot; the layers after it reuse the compiled kernel.")
        st.caption(f"Decoder layers: {n_layers} spans, median {lay.median():.1f} µs (min {lay.min():.1f}, "
                   f"max {lay.max():.1f}), {lay.sum() / 1e3:.3f} ms of the forward.{note}")
    if not launches.empty:
        st.markdown(bandwidth_heading(device_name))
        bound = launch_bound_note(launches, device_name)
        if bound:
            st.info(bound, icon=":material/info:")
        rate = {"GB/s": st.column_config.NumberColumn(format="%.1f", help="bytes moved / duration"),
                "MB": st.column_config.NumberColumn(format="%.4f")}
        st.dataframe(kernel_summary(launches), hide_index=True, width="stretch", column_config=rate)
        with st.expander(f"every launch ({len(launches)})"):
            st.dataframe(launches, hide_index=True, width="stretch", height=min(400, 38 + 35 * len(launches)),
                         column_config=rate)
    code_ref("vllm_anatomy/tracing/device_timer.py", "DeviceTimer.mark / kernel / watch_layers → resolve")
