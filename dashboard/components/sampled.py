"""How the forward pass of one step ran — a CUDA graph replay (padded to a captured
size) or eager, and why (CudagraphDispatcher.dispatch's decision, recorded per step
in prepare_inputs.cudagraph) — and the tokens the step sampled (token id and text
per request; with speculative decoding every token a verify step emitted: the accepted drafts
and the target's own bonus or recovered token)."""
from __future__ import annotations

import streamlit as st

from dashboard import data
from dashboard.components.code_ref import code_ref
from dashboard.components.spec_decode import ACCEPTED, OWN, UNCHECKED, token_chip
from dashboard.theme import CUDAGRAPH_COLORS, chip, req_chip
from dashboard.words import agree, n_of


def sizes_text(sizes: list[int]) -> str:
    """Capture sizes, abbreviated past 8: `1, 2, 4, 8, 16, …, 512; 51 sizes` (a size is one full graph,
    one set of piecewise graphs, or both: FULL_AND_PIECEWISE captures both up to max_num_seqs)."""
    if len(sizes) <= 8:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:5]))}, …, {sizes[-1]}; {len(sizes)} sizes"


def _decodes(n: int) -> str:
    return n_of(n, "decode")


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
            pad = f"{n_of(padded - n, 'padding row')} {agree(padded - n, 'gets', 'get')}"
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
    why = EAGER_WHY.get(reason_code(cudagraph) or "", "This step launches its kernels one by one.")
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
    mode = (cg or {}).get("mode") or ""
    label = {"FULL": "CUDA graph", "PIECEWISE": "piecewise graphs"}.get(mode, "eager")
    badge = chip(label, CUDAGRAPH_COLORS.get(mode, "#8E8E8E")) if cg else ""
    st.markdown(f"**Forward pass** {badge} **{head}**", unsafe_allow_html=True)
    st.caption(why + (f" Dispatcher said: `{cg['reason']}`." if cg and cg.get("reason") else ""))
    code_ref("vllm_anatomy/worker/cudagraph.py", "CudagraphDispatcher.dispatch → GPUModelRunner.execute_model")


def sampled(meta: dict, step_id: int, tokens: dict, so: dict, final_len: dict[str, int] | None = None) -> None:
    """Per request, the token(s) this step emitted, at their positions. A verify step (speculative
    decoding: the step's drafts in `so`, its SchedulerOutput) emits several: the drafts the target
    accepted, then one token of its own (the bonus after every draft, or the recovered token at the
    first rejected one). `final_len`: request id -> prompt + output tokens of a finished request;
    tokens at or past it were dropped by update_from_output (a verify step's past a stop; with async
    scheduling all of a step scheduled before the stop was known)."""
    picked = tokens["sampled"].get(step_id, {})
    drafts = so.get("scheduled_spec_decode_tokens") or {}
    st.markdown("**Sampled tokens**")
    if not picked:
        st.caption("no request sampled in this step (only partial prefill chunks)")
    lines = []
    for req, (pos, tok, *more) in picked.items():
        if tok is None:
            lines.append(f"{req_chip(req)} position {pos}: last token of the request (not fed back, so not "
                         f"in the run store)")
        elif drafts.get(req):
            lines.append(verified_line(meta, req, pos, [tok, *more], len(drafts[req]), (final_len or {}).get(req)))
        else:
            text = data.decode(meta, [tok])
            end = (final_len or {}).get(req)
            after = f" — {STOPPED_BEFORE.format(end - 1, 'it')}" if end is not None and pos >= end else ""
            # (no tokenizer here: the id alone, not an empty text)
            shown = f" <code>{text.replace('<', '&lt;')!r}</code>" if text is not None else ""
            lines.append(f"{req_chip(req)} position {pos}: token <code>{tok}</code>{shown}{after}")
    st.markdown("<br>".join(lines), unsafe_allow_html=True)
    code_ref("vllm_anatomy/worker/gpu_model_runner.py", "GPUModelRunner.sample_tokens · _bookkeeping_sync")


def verified_line(meta: dict, req: str, pos: int, emitted: list[int], num_drafts: int,
                  final_len: int | None = None) -> str:
    """One request's tokens from a verify step (HTML): the accepted drafts (green), then the target's
    own token (blue), each at its position; those at or past `final_len` (the request's final length)
    grey: it stopped before them, and update_from_output dropped them."""
    n_acc = len(emitted) - 1
    if n_acc == num_drafts:
        kind = "bonus token (every draft accepted)"
    else:
        kind = f"recovered token (instead of draft {n_acc + 1})"
    chips = []
    for j, t in enumerate(emitted):
        label = f"draft {j + 1}, accepted" if j < n_acc else f"the target's {kind}"
        dropped = final_len is not None and pos + j >= final_len
        color = UNCHECKED if dropped else ACCEPTED if j < n_acc else OWN
        chips.append(token_chip(meta, t, color, f"position {pos + j}: {label}"
                                + (": dropped, the request stopped before it" if dropped else "")))
    where = f"positions {pos}–{pos + n_acc}" if n_acc else f"position {pos}"
    line = (f"{req_chip(req)} {where}: {' '.join(chips)} — {n_of(len(emitted), 'token')}: "
            f"{n_of(n_acc, 'accepted draft')} of {num_drafts}, then the {kind}")
    if final_len is not None and pos >= final_len:
        line += "; " + STOPPED_BEFORE.format(final_len - 1, "all of them")
    elif final_len is not None and pos + n_acc >= final_len:
        line += (f"; the request stopped at position {final_len - 1}: update_from_output kept {final_len - pos} "
                 "of them and dropped the rest (grey)")
    return line


# A step scheduled before the request's stop was known (async scheduling schedules step N + 1 before it
# has seen step N's tokens): what the runner sampled for it is dropped.
STOPPED_BEFORE = ("the request had already stopped at position {} (async scheduling: this step was scheduled "
                  "before its stop was known), so update_from_output dropped {}")
