"""Which requests of a step the Triton backend sends to the prefill kernel.

A switch, on by default: VLLM_ANATOMY_PREFILL_KERNEL=1 (vllm_anatomy/envs.py; =0 turns
it off), or =cudnn (the last NOTE below); only fresh prefills of at least
VLLM_ANATOMY_PREFILL_MIN_LEN tokens (2048) are split off (the NOTE on the threshold).

NOTE: why a split at all. unified_attention (kernels/unified_attention.py)
computes every request of a step in one launch, reading K/V back from the
paged cache through the block table; that is what vLLM's FlashAttention
backend does too (one varlen call, no split). But a *fresh* prefill, a request
with no cached context (num_computed_tokens == 0, e.g. a new prompt without a
prefix-cache hit), has all of its K/V in this step's key/value tensors, next to
its queries, token for token. For it vLLM keeps a separate Triton op,
context_attention_fwd (v1/attention/ops/triton_prefill_attention.py), with no
block table and a grid sized from host-known lengths; ours is
kernels/prefill_attention.py. Long prompts are where attention's matmul rate
matters (a 4k-token prompt's attention is ~2/3 of its prefill FLOPs at 0.6B),
so the long-context points are what this split is for.

The rule (host facts only, no device read): request i is a fresh prefill when
seq_len == query_len (context_len == 0, the scheduler's num_computed_tokens ==
0) and query_len > 1. Those go to the prefill kernel; everything else (decodes,
chunked-prefill continuations, prefix-cache hits, speculative verify rows)
stays with unified_attention, whose programs for the fresh prefills exit at
once (skip_seq). The first chunk of a chunked prompt is fresh; its later
chunks are not.

The trade-off: a mixed batch (decodes + new prompts) now costs two launches
per layer instead of one, plus unified_attention's early-exit programs over the
fresh prefills' query blocks, and a decode-only remainder loses the split-KV
(3D) path (it runs the 2D kernel); a batch of only fresh prefills (or none)
stays one launch. The split is computed once per step, by the first layer that
asks (vLLM's TritonAttentionMetadataBuilder.build runs once per step too), and
kept on the step's AttentionMetadata. CUDA graphs: attention runs eager in a
piecewise replay, with the step's metadata, so the split applies there; the
captured dummy metadata (and so every FULL graph) carries no host copies and
never splits.

NOTE: why only long fresh prefills (VLLM_ANATOMY_PREFILL_MIN_LEN, 2048 by default). The
kernel's gain is attention's matmul rate, which only long prompts need: on an H200
(bench/results/prefill_attention_h200.json) it runs 4k/8k prompts at 63-65 % of the
matmul rate against unified_attention's 42-46 %, but a single 512-token prompt at 10 %,
no better than unified_attention, and 32 x 512 at 26 % against 25 %. What a split costs
is paid per step (a host-built work list, a second launch per layer in a mixed batch, a
decode remainder without its 3D path): on nano-vllm's workload (prompts of 100-1024
tokens) splitting every fresh prefill measured 0.996x without it
(bench/results/throughput_ab_prefill_h200.json, three rounds 0.990-0.997), while the
4k/8k points of bench/scaling.py gain (bench/results/scaling_ctx_vs_vllm_h200.json).
With the threshold, a step whose prompts are all shorter never splits: exactly the
path with the switch off.

NOTE: VLLM_ANATOMY_PREFILL_KERNEL=cudnn, a three-way split. Fresh prefills of
at least VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN query tokens (8192 by default; read
once, with the switch) go to torch SDPA on cuDNN
(kernels/prefill_attention_sdpa.py: why a library kernel there, and what it
costs), one call per request; shorter fresh prefills to the Triton prefill
kernel, whose work list is built over them alone; the rest to unified_attention,
which skips every fresh prefill as before. The rule is the same host facts
(query lengths), decided in the same once-per-step pass, and a step without a
long fresh prefill splits exactly as with =1. Why a length threshold: cuDNN's
gain is attention's matmul rate, which only long prompts need, while its costs
(a call per request, a graph per new length) are paid per request; a step of
many short prompts keeps the Triton kernel's single launch. Why 8192: on an
H100 (cuDNN 9.19, bench/results/prefill_attention_sdpa_h100.json) cuDNN beat
the Triton kernel at 8k (68 / 62 % of the matmul rate at 1x8k / 2x8k against
61 / 58 %) and lost at 4k (54 against 60 % at 1x4k); end to end with 2048 the
4k point and its TTFT got worse (README, issue 34's long-prompt table), the
8k ones better. Between 4k and 8k is unmeasured.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_anatomy import envs
from vllm_anatomy.attention.backends.abstract import AttentionMetadata
from vllm_anatomy.kernels.prefill_attention import prefill_work_list


@dataclass
class PrefillSplit:
    """One step's split (host ints and two small device tensors)."""
    block_q: int                    # the prefill kernel's query tokens per program
    num_prefill_reqs: int           # fresh prefills -> prefill_attention (0: all went to SDPA)
    num_prefill_tokens: int
    work_list: torch.Tensor         # [N, 3] int32 on the device (prefill_work_list)
    num_other_reqs: int             # the rest -> unified_attention
    num_other_tokens: int
    num_other_keys: int             # sum of the rest's seq_lens (for the trace's bytes)
    max_other_query_len: int
    skip_seq: torch.Tensor          # [R] int32 on the device: 1 for the fresh prefills (both kinds)
    # Long fresh prefills -> prefill_attention_sdpa (VLLM_ANATOMY_PREFILL_KERNEL=cudnn):
    # (q_start, query_len) host ints, in request order.
    sdpa_prefills: tuple[tuple[int, int], ...] = ()
    num_sdpa_tokens: int = 0


def fresh_prefill_mask(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """[R] bool: requests whose whole K/V is this step's (and more than one token)."""
    return (seq_lens == query_lens) & (query_lens > 1)


def warm_up_prefill_len(max_num_tokens: int, max_model_len: int) -> int | None:
    """The query length of a start-up dummy prefill that the split takes, so that the prefill
    kernel compiles before the first request and not in a long prompt's first step (Triton
    compiles on first launch; one variant serves every length). None: the switch is off, or
    no step can hold a fresh prefill that long (its first chunk is at most max_num_tokens)."""
    if envs.VLLM_ANATOMY_PREFILL_KERNEL == "0":
        return None
    min_len = envs.VLLM_ANATOMY_PREFILL_MIN_LEN
    return min_len if min_len <= min(max_num_tokens, max_model_len) else None


def routed_prefill_mask(query_lens: np.ndarray, seq_lens: np.ndarray, min_len: int) -> np.ndarray:
    """[R] bool: the fresh prefills of at least min_len tokens: those the split takes."""
    return fresh_prefill_mask(query_lens, seq_lens) & (query_lens >= min_len)


def sdpa_prefill_mask(query_lens: np.ndarray, fresh: np.ndarray, sdpa_min_len: int | None) -> np.ndarray:
    """[R] bool: the fresh prefills that go to SDPA (at least sdpa_min_len tokens; None: none)."""
    if sdpa_min_len is None:
        return np.zeros_like(fresh)
    return fresh & (query_lens >= sdpa_min_len)


def split_fresh_prefills(attn_metadata: AttentionMetadata, block_q: int, device: torch.device,
                         sdpa_min_len: int | None = None, min_len: int = 2) -> PrefillSplit | None:
    """The step's split, computed on the first call and kept on the metadata;
    None when the step has no fresh prefill of at least min_len tokens or its metadata
    has no host copies. Shorter fresh prefills stay with unified_attention.
    sdpa_min_len: fresh prefills at least this long go to SDPA (None: all to the prefill kernel)."""
    key = (block_q, sdpa_min_len, min_len)
    cached = attn_metadata.prefill_split
    if cached is not None and cached[0] == key:
        return cached[1]
    split = _build_split(attn_metadata, block_q, device, sdpa_min_len, min_len)
    attn_metadata.prefill_split = (key, split)
    return split


def _build_split(attn_metadata: AttentionMetadata, block_q: int, device: torch.device,
                 sdpa_min_len: int | None, min_len: int) -> PrefillSplit | None:
    # (the exact host copy only: a split without it would wait for the device)
    qsl_cpu, seq_lens_cpu = attn_metadata.query_start_loc_cpu, attn_metadata._seq_lens_cpu
    if qsl_cpu is None or seq_lens_cpu is None:
        return None
    num_reqs = attn_metadata.num_reqs
    qsl = qsl_cpu[:num_reqs + 1].numpy().astype(np.int64)
    seq_lens = seq_lens_cpu[:num_reqs].numpy().astype(np.int64)
    query_lens = np.diff(qsl)
    fresh = routed_prefill_mask(query_lens, seq_lens, min_len)
    if not fresh.any():
        return None
    other = ~fresh
    sdpa = sdpa_prefill_mask(query_lens, fresh, sdpa_min_len)
    triton = fresh & ~sdpa
    work_list = prefill_work_list(qsl[:-1][triton].tolist(), query_lens[triton].tolist(), block_q)
    # NOTE: one host->device copy per step, from pinned memory, for both tensors.
    packed = torch.cat([work_list.flatten(), torch.from_numpy(fresh.astype(np.int32))])
    if device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    num_items = work_list.shape[0]
    return PrefillSplit(
        block_q=block_q, num_prefill_reqs=int(triton.sum()), num_prefill_tokens=int(query_lens[triton].sum()),
        work_list=packed[:3 * num_items].view(num_items, 3),
        num_other_reqs=int(other.sum()), num_other_tokens=int(query_lens[other].sum()),
        num_other_keys=int(seq_lens[other].sum()),
        max_other_query_len=int(query_lens[other].max()) if other.any() else 0,
        skip_seq=packed[3 * num_items:],
        sdpa_prefills=tuple(zip(qsl[:-1][sdpa].tolist(), query_lens[sdpa].tolist())),
        num_sdpa_tokens=int(query_lens[sdpa].sum()))
