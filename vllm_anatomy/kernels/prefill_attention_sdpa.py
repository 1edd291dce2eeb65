"""prefill_attention_sdpa: causal attention of long fresh prefills through torch's
scaled_dot_product_attention, on cuDNN on a CUDA device.

The same computation as kernels/prefill_attention.py (context_attention_fwd):
each fresh prefill (a request with no cached context) attends causally over
its own K/V, which sits in the step's key/value tensors next to its queries.
The Triton backend sends a fresh prefill here when VLLM_ANATOMY_PREFILL_KERNEL=cudnn
and it has at least VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN tokens (the split:
attention/backends/prefill_split.py); shorter ones stay with the Triton kernel.
Mirrors nothing in vLLM 0.27.1 (docs/vllm-mapping.md, "Ours only").

NOTE: why a library kernel, in an engine whose kernels are its own Triton.
vLLM does not write its prefill attention either: its default CUDA backend
calls FlashAttention (vllm_flash_attn), a library tuned for each GPU
generation by the people who wrote the algorithm. For long prompts attention
is most of a step's FLOPs and its matmul rate is what counts; there our Triton
kernel stops at ~60 % of the bf16 matmul rate on an H100 (bench/prefill_attention.py)
where FlashAttention 3 goes further. cuDNN, a library NVIDIA keeps for exactly
this, runs fused attention on Hopper's tensor cores and is reached through
torch SDPA with no new dependency. So the long prompts call the library, the
way vLLM calls FlashAttention; the Triton kernel stays for the short ones and
as the readable account of the algorithm. Whether this path stays is decided
by the GPU numbers (bench/prefill_attention.py's sdpa_cudnn_views row, and
bench/scaling.py --prefill-kernel cudnn).

What it costs, and why the split sends only long prompts here:
  - one SDPA call per request and layer (host dispatch, and the
    sdpa_kernel context that pins the backend to cuDNN) where the Triton
    kernel takes one launch for all the step's fresh prefills;
  - SDPA has no out=: each call returns a new tensor (served by the caching
    allocator), copied into the request's rows of the step's output;
  - torch caches cuDNN's execution graph per shape (sequence lengths and
    strides included), so the first prompt of a length not seen before builds
    one: bench/scaling.py's ttft series records that first call (warmup_ms).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa_takes(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether this path computes this model's prefills: on CUDA cuDNN's fused attention
    takes fp16/bf16 with head_dim a multiple of 8 up to 128 (more on Hopper with a recent
    cuDNN: not assumed here); a CPU's SDPA takes anything. The backend keeps the other
    models' long prompts on the Triton kernel (an fp32 engine, e.g. the equality tests)."""
    if device.type != "cuda":
        return True
    return dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 128


def _backend(device: torch.device) -> contextlib.AbstractContextManager:
    """cuDNN only on CUDA (an input it refuses is an error, not a silent fallback to
    another backend); on a CPU whichever backend SDPA picks (the CPU tests check the math)."""
    return sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()


def sdpa_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                           prefills: Sequence[tuple[int, int]], softmax_scale: float) -> torch.Tensor:
    """Causal attention of each (q_start, query_len) in `prefills` over its own K/V;
    writes o's rows of those requests and leaves the others alone.

    q/o [T, nh, hd], k/v [T, nkv, hd] (token and head strides free, last dim
    contiguous; nh a multiple of nkv: GQA by enable_gqa, K/V never repeated).
    `prefills`: host ints (PrefillSplit.sdpa_prefills), so nothing is read back
    from the device."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads={q.shape[1]} not a multiple of num_kv_heads={k.shape[1]}")
    with _backend(q.device):
        for start, length in prefills:
            rows = slice(start, start + length)
            # [n, heads, hd] -> [1, heads, n, hd]: views, no copy.
            qq, kk, vv = (t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=softmax_scale,
                                                 enable_gqa=True)
            o[rows].copy_(out.squeeze(0).transpose(0, 1))
    return o
