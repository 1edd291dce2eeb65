"""Speculative decoding in one step: each request's drafts, which of them the target accepted,
the token it emitted itself (recovered at the first rejection, or the bonus after all of them),
and where the rejected drafts' KV went: their slots stay the request's and the next step writes
the real tokens' keys and values over them (step_record.spec_decode, recorded by
Scheduler.update_from_output). Below: the drafts proposed for the next step (each running
request's spec_token_ids). Nothing is drawn for a run without speculative decoding.

With async scheduling the step snapshot is taken at launch, before the step is verified: its
step record has no verifications, and with a draft model its drafts are -1 placeholders (kept on
the device). Then the step's late "spec_decode" snapshot is read instead (docs/trace-format.md),
and the next step's for the drafts proposed after this one."""
from __future__ import annotations

import html

import streamlit as st

from dashboard import data
from dashboard.components.code_ref import code_ref
from dashboard.theme import chip, req_chip
from dashboard.words import n_of

ACCEPTED = "#2E9E5B"
REJECTED = "#C0392B"
UNCHECKED = "#BDBDBD"       # after the first rejection: not even compared
OWN = "#0072B2"             # the target's own token (recovered or bonus)


def token_chip(meta: dict, tok: int, color: str, label: str) -> str:
    """A token as a coloured chip: its id and text (when the run's tokenizer is there); `label` is its tooltip."""
    text = data.decode(meta, [tok])
    shown = f"{tok} {text!r}" if text is not None else str(tok)
    return chip(html.escape(shown), color, title=label)


def verification_lines(meta: dict, v: dict, block_size: int) -> list[str]:
    """One verification as HTML lines: drafts (accepted / rejected / unchecked), output, rejected slots."""
    drafts, n_acc = v["draft_token_ids"], v["num_accepted"]
    first = v["first_draft_position"]
    marks = []
    for j, tok in enumerate(drafts):
        if j < n_acc:
            marks.append(token_chip(meta, tok, ACCEPTED, f"draft {j + 1} at position {first + j}: accepted"))
        elif j == n_acc:
            marks.append(token_chip(meta, tok, REJECTED, f"draft {j + 1} at position {first + j}: rejected"))
        else:
            marks.append(token_chip(meta, tok, UNCHECKED, f"draft {j + 1} at position {first + j}: after a rejection"))
    own = v["output_token_ids"][-1]
    kind = "the bonus token: every draft accepted" if n_acc == len(drafts) else \
        f"the recovered token, instead of draft {n_acc + 1}"
    lines = [f"{req_chip(v['request_id'])} drafts at positions {first}–{first + len(drafts) - 1}: {' '.join(marks)}",
             f"&nbsp;&nbsp;→ accepted {n_acc} of {len(drafts)}, then the target's own token "
             f"{token_chip(meta, own, OWN, kind)} ({kind}): {n_of(len(v['output_token_ids']), 'token')} this step"]
    slots = v.get("rejected_slots") or []
    if slots:
        where = ", ".join(f"slot {s} (block {s // block_size}, offset {s % block_size}) ← position "
                          f"{first + n_acc + i}" for i, s in enumerate(slots))
        lines.append(f"&nbsp;&nbsp;rejected drafts' KV was written to {where}: num_computed_tokens rolls back "
                     f"to {first + n_acc}, so the next step writes the real tokens there")
    return lines


def spec_decode(meta: dict, step: dict, block_size: int, verifications: list[dict],
                late: dict | None = None, next_late: dict | None = None) -> None:
    """`verifications`: the step's SpecDecodeRecords (data.step_data's "verified": reader.verified_drafts);
    `late` / `next_late`: the "spec_decode" snapshots of this step and the next (async scheduling)."""
    scheduler = step["scheduler"]
    scheduled = step["scheduler_output"].get("scheduled_spec_decode_tokens") or {}
    proposed = {r["request_id"]: r.get("spec_token_ids") or [] for r in scheduler.get("running", [])}
    on_device = _has_placeholders(proposed)
    if on_device:       # placeholders: the real drafts are what the next step verified
        real = (next_late or {}).get("scheduled_spec_decode_tokens") or {}
        proposed = {r: real.get(r, ids) for r, ids in proposed.items()}
    if not scheduled and not verifications and not any(proposed.values()):
        return
    st.markdown("**Speculative decoding** — drafts verified this step")
    if late is not None:
        st.caption(f"Async scheduling: this step was verified after its snapshot was taken (at launch"
                   f"{', its drafts -1 placeholders on the device' if _has_placeholders(scheduled) else ''}); "
                   "shown from its spec_decode record, written when its output was processed.")
    if not verifications:
        if not scheduled:
            st.caption("no request had drafts this step")
        elif late is None and _has_placeholders(scheduled):
            st.caption(f"{n_of(len(scheduled), 'request')} scheduled drafts (-1 placeholders: on the device); "
                       "their verification is not recorded (yet)")
        else:
            st.caption("the requests with drafts finished or were aborted before the drafts were verified")
    lines = [line for v in verifications for line in verification_lines(meta, v, block_size)]
    if lines:
        st.markdown("<br>".join(lines), unsafe_allow_html=True)
    nxt = [f"{req_chip(r)} {' '.join(token_chip(meta, t, UNCHECKED, 'draft for the next step') for t in ids)}"
           for r, ids in proposed.items() if ids and -1 not in ids]
    if nxt:
        where = " (on the device: read from the next step's record)" if on_device else ""
        st.markdown(f"Drafts proposed after this step, to verify next step{where}:<br>" + "<br>".join(nxt),
                    unsafe_allow_html=True)
    elif on_device:
        st.caption("Drafts proposed after this step stay on the device (-1 placeholders here); "
                   "no next step has verified them (so far), so their values are not recorded.")
    code_ref("vllm_anatomy/model_executor/rejection_sampler.py",
             "RejectionSampler · Scheduler.update_from_output (rollback) · propose_draft_token_ids")


def _has_placeholders(scheduled: dict) -> bool:
    return any(-1 in ids for ids in scheduled.values())
