"""Q3 — how the block table reaches the attention kernel, and what a decode does with it.

_prepare_inputs (v0.27.1) hands the attention backend, per step: block_table
[num_reqs, max_num_blocks_per_req] (each InputBatch row's physical block ids,
zero-padded: block 0 is the null block), seq_lens (tokens of K/V each request's
query attends to, this step's included), query_start_loc (where each request's
query tokens start in the flat batch) and slot_mapping (per token:
block_id × block_size + offset, the slot reshape_and_cache writes its new K and V
to; -1 for padding). A decode's kernel walks the first ⌈seq_len / block_size⌉
entries of its row, in order, reading K and V block by block.

Read from: the model_runner snapshot of the step (InputBatch rows, prepare_inputs).
"""
from __future__ import annotations

import math

from dashboard.answers.common import Answer, ShowMe, cannot, ids
from dashboard.answers.source import RunSource
from dashboard.words import n_of

# The kernels that write a step's K/V into the cache at slot_mapping: the attention backend's own, or
# (on CUDA, steps of <= 256 tokens) the model's launch that also does the write: Qwen3's q/k norm + RoPE
# (vllm_anatomy/compilation/qk_norm_rope_kvcache_fusion.py), or Llama's RoPE with
# VLLM_ANATOMY_FUSE_ROPE_KVCACHE=1 (vllm_anatomy/compilation/rope_kvcache_fusion.py).
KV_WRITE_KERNELS = ("reshape_and_cache", "fused_qk_norm_rope_kvcache", "fused_rope_kvcache")
# The call each of KV_WRITE_KERNELS is launched from (row 4 of the chain).
KV_WRITE_CALLS = {"reshape_and_cache": "reshape_and_cache (Attention.do_kv_cache_update)",
                  "fused_qk_norm_rope_kvcache": "fused_qk_norm_rope_kvcache (impl.do_qk_norm_rope_kvcache_update)",
                  "fused_rope_kvcache": "fused_rope_kvcache (impl.do_rope_and_kv_cache_update)"}
# What the layer's launch did besides the write, for each fused one of KV_WRITE_KERNELS.
KV_WRITE_FUSED_WITH = {"fused_qk_norm_rope_kvcache": "q/k norm and RoPE", "fused_rope_kvcache": "RoPE"}


SHOW_TOKENS = 40


def _decodes(src: RunSource, step: int) -> list[tuple[int, str]]:
    """(row, request) of the one-token queries of a step whose table spans more than one block."""
    pi = src.mr(step).get("prepare_inputs") or {}
    out = []
    for i, (req, n) in enumerate(zip(pi.get("req_ids", []), pi.get("num_scheduled_tokens", []))):
        if n == 1 and i < len(pi.get("seq_lens", [])) and pi["seq_lens"][i] > src.block_size:
            out.append((i, str(req)))
    return out


def candidates(src: RunSource) -> list[int]:
    """Steps with a one-token decode whose K/V spans more than one block (from the step records: no
    worker snapshot is read until a step is chosen)."""
    bs = src.block_size
    return [s for s in src.steps if any(e["kind"] == "decode" and e["num_tokens"] == 1
                                        and e.get("num_computed_tokens_before", 0) + 1 > bs
                                        for e in src.record(s).get("scheduled", []))]


def default_step(src: RunSource, cands: list[int]) -> int | None:
    """A step that mixes a decode with a prefill chunk (both kinds of query rows), else a decode step
    with the most rows."""
    def score(s):
        sched = src.record(s).get("scheduled", [])
        kinds = {e["kind"] for e in sched}
        return ("decode" in kinds and bool(kinds - {"decode"}), len(sched), -s)
    for s in sorted(cands, key=score, reverse=True)[:8]:      # the worker may not have recorded it: next one
        if _decodes(src, s):
            return s
    return None


def answer(src: RunSource, step: int | None = None, req: str | None = None) -> Answer:
    # Cheap first: the sample's 116 steps, a big run's thousands. Only look at steps with snapshots.
    cands = candidates(src)
    if not cands:
        return cannot("No step of this run has a decoding request whose KV spans more than one block "
                      "(or the worker's prepare_inputs was not recorded).")
    if step not in cands or not _decodes(src, step):
        step = default_step(src, cands)
    if step is None:
        return cannot("The worker's prepare_inputs was not recorded for the decode steps of this run.")
    mr = src.mr(step)
    pi = mr["prepare_inputs"]
    bs = src.block_size
    decs = _decodes(src, step)
    if req is None or str(req) not in [r for _, r in decs]:
        req = max(decs, key=lambda d: pi["seq_lens"][d[0]])[1]
    req = str(req)
    rows = {r["index"]: r for r in mr["input_batch"]["rows"]}
    req_ids = [str(r) for r in pi["req_ids"]]
    ri = req_ids.index(req)
    row = next(r for r in rows.values() if str(r["req_id"]) == req)
    seq_len = pi["seq_lens"][ri]
    n_walk = math.ceil(seq_len / bs)
    walked = row["block_ids"][:n_walk]
    qsl = pi["query_start_loc"]
    tok = qsl[ri]                                  # its one query token's index in the flat batch
    slot = pi["slot_mapping"][tok]
    pos = pi["positions"][tok]
    width = max(len(r["block_ids"]) for r in rows.values())
    max_blocks = math.ceil(src.max_model_len / bs) if src.max_model_len else None
    slots = pi["slot_mapping"]
    cg = pi.get("cudagraph") or {}
    padded = cg.get("num_padded_tokens") and cg.get("num_tokens") and cg["num_padded_tokens"] > cg["num_tokens"]
    slot_ok = slot == walked[pos // bs] * bs + pos % bs if pos // bs < len(walked) else False
    summary = (f"In **step {step}** the attention backend got a `block_table` of {n_of(len(req_ids), 'row')} × "
               f"{max_blocks or width} columns (zero-padded), `seq_lens` {ids(pi['seq_lens'])}, `query_start_loc` "
               f"{ids(qsl)} and a `slot_mapping` of {n_of(len(slots), 'slot')}. Request **{req}** decodes one token at "
               f"position {pos}: `seq_len` = {seq_len}, so the kernel walks ⌈{seq_len} / {bs}⌉ = **{n_of(n_walk, 'block')}** "
               f"{ids(walked)} in order (the last holds {seq_len - (n_walk - 1) * bs} of {bs} tokens), and its new K/V "
               f"goes to **slot {slot}** = block {slot // bs} × {bs} + offset {slot % bs}."
               + (f" The graph replay was padded {cg['num_tokens']} → {cg['num_padded_tokens']} tokens: padding "
                  "slots are -1 (nothing written)." if padded else ""))
    write, eager = kv_write(src, step, tok, slot, bs, cg.get("mode"))
    show = [ShowMe(f"step {step}, Worker tab (slot_mapping, block tables)", "inspector", step, "worker", req)]
    if eager is not None and eager != step:
        show.append(ShowMe(f"step {eager}: an eager step, its K/V-write launches on the device lane",
                           "inspector", eager, "worker"))
    return Answer(
        ok=True, subject=f"request {req} at step {step}", summary=summary,
        chain=_chain(req, row, len(req_ids), bs, slot, walked, seq_len, write, kv_write_kernel(src, eager)),
        tables={"block_table as the kernel receives it": _block_table(rows, req_ids, width, max_blocks),
                "per request": _per_request(pi, req_ids, bs),
                "slot_mapping, split": _slot_mapping_split(pi, req_ids, tok, bs),
                f"blocks request {req} walks": [{"block #": j, "physical block": b,
                                                 "tokens": f"{j * bs}–{min((j + 1) * bs, seq_len) - 1}",
                                                 "K/V read": min(bs, seq_len - j * bs)} for j, b in enumerate(walked)]},
        show_me=show,
        facts={"kv_write": write, "eager_step": eager, "step": step, "request": req, "seq_len": seq_len, "walked": walked, "slot": slot, "position": pos,
               "slot_ok": slot_ok, "block_table": {rid: list(next(x for x in rows.values() if str(x['req_id']) == rid)["block_ids"])
                                                   for rid in req_ids if any(str(x['req_id']) == rid for x in rows.values())},
               "seq_lens": list(pi["seq_lens"]), "query_start_loc": list(qsl), "candidates": cands})


def _block_table(rows: dict[int, dict], req_ids: list[str], width: int, max_blocks: int | None) -> list[dict]:
    """The block table as the kernel receives it: one row per request, zero-padded to max_blocks columns."""
    table = []
    for i, rid in enumerate(req_ids):
        r = next((x for x in rows.values() if str(x["req_id"]) == rid), None)
        b = list(r["block_ids"]) if r else []
        table.append({"row": i, "request": rid, **{f"[{j}]": (b[j] if j < len(b) else 0) for j in range(width)},
                      "…": f"0 × {max_blocks - width}" if max_blocks and max_blocks > width else ""})
    return table


def _slot_mapping_split(pi: dict, req_ids: list[str], tok: int, bs: int) -> list[dict]:
    """slot_mapping split into block id and offset, for at most SHOW_TOKENS columns (a prefill can be
    thousands of tokens): the first ones and this request's."""
    slots = pi["slot_mapping"]
    shown = sorted(set(range(min(len(slots), SHOW_TOKENS))) | {tok})
    return [{"": "token", **{f"t{t}": t for t in shown}},
            {"": "request", **{f"t{t}": req_ids[pi["req_indices"][t]] if t < len(pi["req_indices"]) else "pad"
                               for t in shown}},
            {"": "slot_mapping", **{f"t{t}": slots[t] for t in shown}},
            {"": "block_id = slot // %d" % bs, **{f"t{t}": (slots[t] // bs if slots[t] >= 0 else "pad") for t in shown}},
            {"": "offset = slot %% %d" % bs, **{f"t{t}": (slots[t] % bs if slots[t] >= 0 else "pad") for t in shown}}]


def _per_request(pi: dict, req_ids: list[str], bs: int) -> list[dict]:
    qsl = pi["query_start_loc"]
    return [{"row": i, "request": rid, "query_start_loc": qsl[i], "query tokens": qsl[i + 1] - qsl[i],
             "seq_len": pi["seq_lens"][i], "blocks walked ⌈seq_len/%d⌉" % bs: math.ceil(pi["seq_lens"][i] / bs)}
            for i, rid in enumerate(req_ids)]


def kernel_spans(src: RunSource, name: str, step: int) -> list:
    """The step's device spans of one kernel (`GPU.kernel.<name>`), in launch order (the output rank's);
    the target model's (a draft model's launches, `vllm_anatomy.drafter`, are its own cache's)."""
    out = [s for s in src.spans(f"GPU.kernel.{name}")
           if (s.step_id if s.step_id is not None else s.attributes.get("vllm_anatomy.step_id")) == step
           and not s.attributes.get("vllm_anatomy.drafter")]
    if src.ranks:
        first = {p for p, r in src.ranks.items() if r == 0}
        out = [s for s in out if s.pid in first] or out
    return sorted(out, key=lambda s: s.start_ns)


def kv_write_launches(src: RunSource, step: int) -> tuple[str, list]:
    """(kernel, its launches) of the first of KV_WRITE_KERNELS the step recorded: reshape_and_cache,
    or a fused (q/k norm +) RoPE + KV write; ("reshape_and_cache", []) if none."""
    for kernel in KV_WRITE_KERNELS:
        launches = kernel_spans(src, kernel, step)
        if launches:
            return kernel, launches
    return KV_WRITE_KERNELS[0], []


def kv_write_kernel(src: RunSource, eager: int | None) -> str:
    """The kernel that wrote K/V in the run: the one an eager step recorded (a graph replay ran the
    same path: the fusion's switch and token limit are fixed per captured size), else reshape_and_cache."""
    return kv_write_launches(src, eager)[0] if eager is not None else KV_WRITE_KERNELS[0]


def kv_write(src: RunSource, step: int, tok: int, slot: int, bs: int, mode: str | None) -> tuple[str, int | None]:
    """Where the trail meets the kernel: what this step's reshape_and_cache launches did with batch token
    `tok` (its slot), or why the step recorded none; and an eager step of the run that did record them."""
    kernel, launches = kv_write_launches(src, step)
    eager = next((s for s in src.steps if kv_write_launches(src, s)[1]), None) if not launches else step
    where = f"slot {slot} (block {slot // bs}, offset {slot % bs})"
    if launches:
        a = launches[0].attributes
        us = sum(x.duration_ns for x in launches) / len(launches) / 1e3
        grid = a.get("vllm_anatomy.grid")
        fused = f" (fused with the layer's {KV_WRITE_FUSED_WITH[kernel]})" if kernel in KV_WRITE_FUSED_WITH else ""
        return (f"{n_of(len(launches), 'launch', 'launches')} of `{kernel}`{fused} in this step, one per layer, each over "
                f"{a.get('vllm_anatomy.num_tokens', '?')} tokens" + (f" (grid {list(grid)})" if grid else "")
                + f", {us:.1f} µs on average: batch token {tok} (this request's query) → {where} of every "
                "layer's cache", eager)
    if mode == "FULL":
        why = ("this step replayed one CUDA graph (FULL): the kernel ran inside it, once per layer, and a replay "
               "records no span per kernel")
    elif mode == "PIECEWISE":
        why = ("this step ran piecewise CUDA graphs: the K/V write is captured in each layer's graph piece (only "
               "attention runs eager between them), so the launch has no span of its own")
    elif str(src.meta.get("device", "")).startswith("cuda"):
        why = "no kernel span recorded for this step (kernel spans need trace level full)"
    else:
        why = ("a CPU run: the attention backend writes K/V with a tensor copy, not a kernel launch, so there is "
               "no launch to time")
    return (f"the new K/V goes to {where} of every layer's cache — {why}"
            + (f"; step {eager} was eager and shows the launches" if eager is not None else ""), eager)


def _chain(req: str, row: dict, num_reqs: int, bs: int, slot: int, walked: list[int], seq_len: int,
           write: str, kernel: str) -> list[dict]:
    """From the scheduler's block ids to the kernel's walk, with this request's values."""
    return [{"#": "1", "call": "SchedulerOutput block ids → _update_states", "what happened here":
             f"request {req}'s InputBatch row {row['index']} holds {ids(row['block_ids'])}"},
            {"#": "2", "call": "BlockTable.commit_block_table (H2D)", "what happened here":
             f"block_table[:{num_reqs}] copied to the device, rows zero-padded"},
            {"#": "3", "call": "_prepare_inputs", "what happened here":
             f"positions → slot_mapping (block_table[pos // {bs}] × {bs} + pos % {bs}), seq_lens, query_start_loc"},
            {"#": "4", "call": KV_WRITE_CALLS[kernel], "what happened here":
             f"request {req}: {write}"},
            {"#": "5", "call": "unified_attention (decode)", "what happened here":
             f"reads K/V of blocks {ids(walked)} ({seq_len} tokens) for its one query"}]
