"""How the forward pass of one step ran — a CUDA graph replay (padded to a captured
size) or eager, and why (CudagraphDispatcher.dispatch's decision, recorded per step
in prepare_inputs.cudagraph) — and the tokens the step sampled (token id and text
per request)."""
from __future__ import annotations

import streamlit as st

from dashboard import data
from dashboard.components.code_ref import code_ref
from dashboard.theme import CUDAGRAPH_COLORS, chip, req_chip


def sizes_text(sizes: list[int]) -> str:
    """Capture sizes, abbreviated past 8: `1, 2, 4, 8, 16, …, 512; 51 sizes` (a size is one full graph,
    one set of piecewise graphs, or both: FULL_AND_PIECEWISE captures both up to max_num_seqs)."""
    if len(sizes) <= 8:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:5]))}, …, {sizes[-1]}; {len(sizes)} sizes"


def _decodes(n: int) -> str:
    return f"{n} decode{'s' if n != 1 else ''}"


def execution_mode(meta: dict, cudagraph: dict | None = None) -> tuple[str, str]:
    """(headline, why) for one step's forward pass.

    With the step's decision (`prepare_inputs.cudagraph`: mode, num_tokens,
    num_padded_tokens, reason): "CUDA graph replay · 5 decodes padded to 8 (captured
    sizes …)" or "eager · <reason>". Runs recorded before the decision was traced
    fall back to what the run's device and compilation config say.
    """
    device = str(meta.get("device", "?"))
    cfg = (meta.get("config") or {}).get("compilation_config") or {}
    sizes = sorted(cfg.get("cudagraph_capture_sizes") or [])
    if not cudagraph:
        if device.startswith("cpu"):
            return ("eager (CPU) — no CUDA graphs without a GPU",
                    "This run predates the per-step CUDA-graph decision in the trace; on a CPU every step runs "
                    "eager.")
        mode = cfg.get("cudagraph_mode")
        head = "CUDA graph replay" if mode not in (None, "NONE", "none") else f"eager ({device})"
        return head, f"This run predates the per-step CUDA-graph decision in the trace (cudagraph_mode {mode})."
    mode, reason = cudagraph.get("mode"), str(cudagraph.get("reason") or "")
    n, padded = int(cudagraph.get("num_tokens") or 0), int(cudagraph.get("num_padded_tokens") or 0)
    captured = f" (captured sizes {sizes_text(sizes)})" if sizes else ""
    if mode == "FULL":
        if padded > n:
            head = f"CUDA graph replay · {_decodes(n)} padded to {padded}{captured}"
            pad = f"{padded - n} padding {'rows get' if padded - n != 1 else 'row gets'}"
            why = (f"A graph replays exactly the kernels captured for {padded} tokens, on the same buffers: the "
                   f"{pad} slot -1 (no KV write), query_len 0 and seq_len 0, so attention skips them, and their "
                   f"logits are never read (logits_indices point at the {n} real rows only).")
        else:
            head = f"CUDA graph replay · {_decodes(n)}, exactly a captured size{captured}"
            why = (f"One call replays every kernel launch captured for {padded} tokens; the step's inputs are new "
                   "values written into the same static buffers, and no padding row is needed this time.")
        return head, why
    if mode == "PIECEWISE":
        pad = f", padded to {padded}" if padded > n else ""
        head = f"piecewise CUDA graphs · {n} tokens{pad}{captured}"
        why = ("Not a uniform decode, so no full graph fits (attention's launch depends on how many requests "
               "and how long each query is). The rest of each layer depends only on the token count: its graph "
               f"pieces, captured for {padded} tokens, replay around one eager attention launch per layer, which "
               "gets this step's metadata (compilation/breakable_cudagraph.py). ~29 replays and 28 launches "
               "instead of ~400 launches.")
        return head, why
    short = reason[:-len(": eager")] if reason.endswith(": eager") else reason
    head = f"eager · {short or 'no reason recorded'}"
    why = EAGER_WHY.get(reason_code(cudagraph), "This step launches its kernels one by one.")
    if reason_code(cudagraph) == "cudagraphs_off" and device.startswith("cpu"):
        why += " On a CPU there are no kernel launches to save."
    return head, why


# Why a step ran eager, by the dispatcher's CudagraphReason code (worker/cudagraph.py).
EAGER_WHY = {
    "prefill_in_batch": "With cudagraph_mode FULL_DECODE_ONLY only uniform decodes (one query token per request) "
                        "have a graph. A prefill chunk has another query length, so this step launches its kernels "
                        "one by one (and the device lane times each layer and kernel); FULL_AND_PIECEWISE would "
                        "replay graph pieces around eager attention.",
    "cudagraphs_off": "This run has cudagraph_mode NONE (always on a CPU, or enforce_eager on a GPU): every step "
                      "launches its kernels one by one.",
    "batch_too_large": "More tokens than the largest captured graph: no graph fits, so this step runs eager "
                       "(max_cudagraph_capture_size bounds the sizes captured at start-up).",
}
# Runs recorded before the code: the code of the dispatcher's sentence, by what it said.
_CODE_OF_OLD_REASON = (("prefill in batch", "prefill_in_batch"), ("CUDA graphs off", "cudagraphs_off"),
                       ("largest graph", "batch_too_large"))


def reason_code(cudagraph: dict) -> str | None:
    """The decision's CudagraphReason code (`reason_code`); for runs recorded before it, read from
    its `reason` sentence."""
    if cudagraph.get("reason_code"):
        return cudagraph["reason_code"]
    reason = str(cudagraph.get("reason") or "")
    return next((code for said, code in _CODE_OF_OLD_REASON if said in reason), None)


def execution_panel(meta: dict, mr: dict) -> None:
    """The forward pass of this step: graph replay or eager, with the one-line why."""
    cg = (mr.get("prepare_inputs") or {}).get("cudagraph")
    head, why = execution_mode(meta, cg)
    mode = (cg or {}).get("mode")
    label = {"FULL": "CUDA graph", "PIECEWISE": "piecewise graphs"}.get(mode, "eager")
    badge = chip(label, CUDAGRAPH_COLORS.get(mode, "#8E8E8E")) if cg else ""
    st.markdown(f"**Forward pass** {badge} **{head}**", unsafe_allow_html=True)
    st.caption(why + (f" Dispatcher said: `{cg['reason']}`." if cg and cg.get("reason") else ""))
    code_ref("vllm_anatomy/worker/cudagraph.py", "CudagraphDispatcher.dispatch → GPUModelRunner.execute_model")


def sampled(meta: dict, step_id: int, tokens: dict, so: dict) -> None:
    picked = tokens["sampled"].get(step_id, {})
    st.markdown("**Sampled tokens**")
    if not picked:
        st.caption("no request sampled in this step (only partial prefill chunks)")
    lines = []
    for req, (pos, tok) in picked.items():
        if tok is None:
            lines.append(f"{req_chip(req)} position {pos}: last token of the request (not fed back, so not "
                         f"in the run store)")
            continue
        text = data.decode(meta, [tok])
        lines.append(f"{req_chip(req)} position {pos}: token <code>{tok}</code> "
                     f"<code>{(text or '').replace('<', '&lt;')!r}</code>")
    st.markdown("<br>".join(lines), unsafe_allow_html=True)
    code_ref("vllm_anatomy/worker/gpu_model_runner.py", "GPUModelRunner.sample_tokens · _bookkeeping_sync")
