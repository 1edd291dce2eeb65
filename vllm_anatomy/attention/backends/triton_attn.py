"""The Triton attention backend: reshape_and_cache + unified_attention.

Mirrors vllm/v1/attention/backends/triton_attn.py (TritonAttentionBackend,
TritonAttentionImpl). Same contract as the torch reference backend
(torch_ref.py): do_kv_cache_update scatters the step's new K/V into the paged
cache, then forward reads K/V only from the cache. One kernel launch each,
whatever mix of prefill chunks and decodes the batch holds.

Simplified here: vLLM's Triton backend views the cache as
[num_blocks, num_kv_heads, block_size, 2 * head_size] and transposes it; we
keep abstract.py's [2, num_blocks, block_size, num_kv_heads, head_dim] (the
FlashAttention layout) for every backend, so kv_cache[0] / kv_cache[1] are the
key / value caches directly. No sliding window, softcap, alibi, sinks or fp8.

Split-KV ("3D") decode, as vLLM: a decode-only batch of at most
seq_threshold_3D requests runs unified_attention's 3D kernel, which needs fp32
scratch buffers for the per-segment partials. vLLM's
TritonAttentionMetadataBuilder allocates them once and hands them to the kernel
through the metadata; we have no per-backend metadata builder, so
TritonAttentionImpl fetches them (once per device and shape, shared by every
layer: layers run one after another) from softmax_segm_buffers below.

Fresh prefills through the prefill kernel (a switch, on by default:
VLLM_ANATOMY_PREFILL_KERNEL=1, for prompts of at least VLLM_ANATOMY_PREFILL_MIN_LEN
tokens): requests with no cached context read their K/V
from the step's key/value tensors in kernels/prefill_attention.py, the rest
stays with unified_attention. Why, when and at what cost: the NOTE at the top of
prefill_split.py. With VLLM_ANATOMY_PREFILL_KERNEL=cudnn the long fresh prefills
go to torch SDPA on cuDNN instead (kernels/prefill_attention_sdpa.py), the short
ones to the prefill kernel (the last NOTE of prefill_split.py).

Decode order (on by default; VLLM_ANATOMY_DECODE_LPT=0 turns it off): a
decode-only step's 2D launch deals its programs out longest context first, in
the order the model runner put into the metadata's decode_seq_order (why, and
how it survives CUDA graphs: attention/backends/decode_order.py).

On a machine without CUDA the kernels run in Triton's interpreter: only when
TRITON_INTERPRET=1 was set before vllm_anatomy.kernels was imported (tests do
that in tests/kernel_tests/conftest.py). It is slow; the CPU default stays "torch".
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton

from vllm_anatomy import envs
from vllm_anatomy.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
)
from vllm_anatomy.attention.backends.prefill_split import PrefillSplit, split_fresh_prefills
from vllm_anatomy.kernels import prefill_attention as pa
from vllm_anatomy.kernels import prefill_attention_sdpa as pa_sdpa
from vllm_anatomy.kernels import reshape_and_cache as rc
from vllm_anatomy.kernels import unified_attention as ua
from vllm_anatomy.tracing.runner_tracer import NULL_KERNEL_TIMER


# vLLM's constants (v1/attention/backends/triton_attn.py).
MIN_LAUNCH_GRID_SIZE_2D = 128  # Minimum launch grid size of 2D kernel
NUM_PAR_SOFTMAX_SEGMENTS = 16  # Number of parallel tiled softmax segments

# NOTE: the CUDA-graph capture sizes the threshold snaps to (vLLM reads them
# from compilation_config in its metadata builder; ours has no config): the
# model runner sets them with set_cudagraph_capture_sizes when full decode
# graphs are on. Left empty, the threshold is not snapped.
_cudagraph_capture_sizes: list[int] = []


def set_cudagraph_capture_sizes(capture_sizes: Sequence[int]) -> None:
    """The capture sizes of full decode graphs (empty: none), before the first forward."""
    _cudagraph_capture_sizes[:] = sorted(capture_sizes)


def get_seq_threshold_3D(num_heads_kv: int, capture_sizes: Sequence[int] = ()) -> int:
    """Decode batches of at most this many requests take the 3D kernel (vLLM's rule).

    The 2D grid has >= num_seqs * num_heads_kv programs: below
    MIN_LAUNCH_GRID_SIZE_2D of them it leaves the GPU underused. With CUDA
    graphs, the threshold snaps to the nearest capture size, so that a batch
    of B requests, padded up to a captured size N, replays the path the rule
    picks for B (B <= threshold exactly when N <= threshold).
    NOTE: a threshold of 0 (MIN_LAUNCH_GRID_SIZE_2D = 0: no 3D at all) stays
    0; vLLM would snap it to the smallest capture size.
    """
    threshold = MIN_LAUNCH_GRID_SIZE_2D // num_heads_kv
    if threshold > 0 and capture_sizes:
        threshold = min(capture_sizes, key=lambda x: abs(x - threshold))
    return threshold


@dataclass
class SoftmaxSegmentBuffers:
    """What vLLM's TritonAttentionMetadataBuilder allocates once for the 3D kernel."""
    seq_threshold_3D: int
    num_par_softmax_segments: int
    softmax_segm_output: torch.Tensor   # [seq_threshold_3D, num_heads_q, segments, headdim_padded] fp32
    softmax_segm_max: torch.Tensor      # [seq_threshold_3D, num_heads_q, segments] fp32
    softmax_segm_expsum: torch.Tensor   # [seq_threshold_3D, num_heads_q, segments] fp32

    @classmethod
    def allocate(cls, seq_threshold_3D: int, num_heads_q: int, headdim: int,
                 device: torch.device | str,
                 num_par_softmax_segments: int = NUM_PAR_SOFTMAX_SEGMENTS) -> SoftmaxSegmentBuffers:
        headdim_padded = triton.next_power_of_2(headdim)
        shape = (seq_threshold_3D, num_heads_q, num_par_softmax_segments)
        return cls(seq_threshold_3D, num_par_softmax_segments,
                   torch.empty(shape + (headdim_padded,), dtype=torch.float32, device=device),
                   torch.empty(shape, dtype=torch.float32, device=device),
                   torch.empty(shape, dtype=torch.float32, device=device))


def decode_seq_threshold_3D(num_heads_kv: int) -> int:
    """get_seq_threshold_3D under the capture sizes set so far: what forward() uses."""
    return get_seq_threshold_3D(num_heads_kv, _cudagraph_capture_sizes)


_segm_buffers: dict[tuple, SoftmaxSegmentBuffers] = {}


def softmax_segm_buffers(num_heads_q: int, num_heads_kv: int, headdim: int,
                         device: torch.device) -> SoftmaxSegmentBuffers:
    """The 3D kernel's buffers for these heads on this device: allocated on the first call
    (the start-up warm-up's first decode, outside any graph capture), then the same tensors
    every time, so a captured graph replays on valid addresses."""
    threshold = decode_seq_threshold_3D(num_heads_kv)
    key = (str(device), num_heads_q, headdim, threshold, NUM_PAR_SOFTMAX_SEGMENTS)
    if key not in _segm_buffers:
        _segm_buffers[key] = SoftmaxSegmentBuffers.allocate(threshold, num_heads_q, headdim, device)
    return _segm_buffers[key]


class TritonAttentionImpl(AttentionImpl):
    _segm: SoftmaxSegmentBuffers | None = None       # the 3D kernel's buffers, fetched on first use

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__(num_heads, head_dim, num_kv_heads, scale)
        # The prefill split's switch (prefill_split.py), read once when the model is built:
        # "0" (off), "1" (fresh prefills -> the prefill kernel) or "cudnn" (those of at least
        # sdpa_min_len tokens -> torch SDPA on cuDNN, the others -> the prefill kernel).
        self.prefill_kernel = envs.VLLM_ANATOMY_PREFILL_KERNEL
        self.use_prefill_kernel = self.prefill_kernel != "0"
        self.sdpa_min_len = envs.VLLM_ANATOMY_PREFILL_SDPA_MIN_LEN if self.prefill_kernel == "cudnn" else None
        self.prefill_min_len = envs.VLLM_ANATOMY_PREFILL_MIN_LEN if self.use_prefill_kernel else 2
        # PDL launches of the decode kernels (kernels/pdl.py), read once with the rest.
        self.pdl = envs.VLLM_ANATOMY_PDL

    def do_kv_cache_update(self, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kernel_timer=NULL_KERNEL_TIMER) -> None:
        """key, value: [T, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, nkv, hd]."""
        key_cache, value_cache = kv_cache.unbind(0)        # views: [num_blocks, block_size, nkv, hd]
        with kernel_timer.kernel("reshape_and_cache", lambda: self._cache_launch_attrs(key)):
            rc.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def fused_qk_norm_rope_kvcache_supported(self) -> bool:
        return True

    def do_qk_norm_rope_kvcache_update(self, qkv: torch.Tensor, positions: torch.Tensor,
                                       q_weight: torch.Tensor, k_weight: torch.Tensor, rms_norm_eps: float,
                                       cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor,
                                       slot_mapping: torch.Tensor, kernel_timer=NULL_KERNEL_TIMER) -> None:
        """One launch instead of fused_qk_norm_rope + reshape_and_cache (kernels/fused_qk_norm_rope_kvcache.py).
        Its span says it holds the cache write (vllm_anatomy.kv_cache_update), which then has none of its own."""
        from vllm_anatomy.kernels import fused_qk_norm_rope_kvcache as fkv
        key_cache, value_cache = kv_cache.unbind(0)
        with kernel_timer.kernel("fused_qk_norm_rope_kvcache",
                                 lambda: self._fused_cache_launch_attrs(qkv, "fused_qk_norm_rope")):
            fkv.fused_qk_norm_rope_kvcache(qkv, self.num_heads, self.num_kv_heads, self.num_kv_heads,
                                           self.head_dim, rms_norm_eps, q_weight, k_weight, cos_sin_cache,
                                           is_neox, positions, key_cache, value_cache, slot_mapping,
                                           pdl=self.pdl)

    def fused_rope_kvcache_supported(self) -> bool:
        return True

    def do_rope_and_kv_cache_update(self, qkv: torch.Tensor, positions: torch.Tensor,
                                    cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor,
                                    slot_mapping: torch.Tensor, kernel_timer=NULL_KERNEL_TIMER) -> None:
        """One launch instead of rotary_embedding + reshape_and_cache (kernels/fused_rope_kvcache.py).
        Its span says it holds the cache write (vllm_anatomy.kv_cache_update), which then has none of its own."""
        from vllm_anatomy.kernels import fused_rope_kvcache as frkv
        key_cache, value_cache = kv_cache.unbind(0)
        with kernel_timer.kernel("fused_rope_kvcache",
                                 lambda: self._fused_cache_launch_attrs(qkv, "rotary_embedding")):
            frkv.fused_rope_kvcache(qkv, self.num_heads, self.num_kv_heads, self.num_kv_heads, self.head_dim,
                                    cos_sin_cache, is_neox, positions, key_cache, value_cache, slot_mapping,
                                    pdl=self.pdl)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                output: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, num_heads, head_dim] -> output [T, num_heads, head_dim] (written in place);
        key / value [T, nkv, hd]: the step's new K/V, read only by the prefill split."""
        num_actual_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        # NOTE: rows past num_actual_tokens are padding (a CUDA-graph-sized
        # batch); the kernel never writes them. Zero them so that the output
        # equals the torch reference everywhere (a slice by a host int: no sync).
        output[num_actual_tokens:].zero_()
        split = self._prefill_split(query, key, value, attn_metadata)
        if split is not None:
            assert key is not None and value is not None
            if split.num_prefill_reqs:
                with attn_metadata.kernel_timer.kernel("prefill_attention",
                                                       lambda: self._prefill_launch_attrs(query, split)):
                    pa.context_attention_fwd(query[:num_actual_tokens], key[:num_actual_tokens],
                                             value[:num_actual_tokens], output[:num_actual_tokens],
                                             None, None, self.scale, work_list=split.work_list)
            if split.sdpa_prefills:
                with attn_metadata.kernel_timer.kernel("prefill_attention_sdpa",
                                                       lambda: self._sdpa_launch_attrs(query, split)):
                    pa_sdpa.sdpa_prefill_attention(query, key, value, output, split.sdpa_prefills, self.scale)
            if split.num_other_reqs == 0:
                return output
        segm = self._segm_buffers(query.device)
        max_query_len = attn_metadata.max_query_len if split is None else split.max_other_query_len
        with attn_metadata.kernel_timer.kernel("unified_attention",
                                               lambda: self._attention_launch_attrs(query, attn_metadata, split)):
            ua.unified_attention(
                q=query[:num_actual_tokens], key_cache=key_cache, value_cache=value_cache,
                out=output[:num_actual_tokens],
                cu_seqlens_q=attn_metadata.query_start_loc, max_seqlen_q=max_query_len,
                seqused_k=attn_metadata.seq_lens, max_seqlen_k=attn_metadata.max_seq_len,
                softmax_scale=self.scale, block_table=attn_metadata.block_table,
                seq_threshold_3D=segm.seq_threshold_3D,
                num_par_softmax_segments=segm.num_par_softmax_segments,
                softmax_segm_output=segm.softmax_segm_output, softmax_segm_max=segm.softmax_segm_max,
                softmax_segm_expsum=segm.softmax_segm_expsum,
                skip_seq=None if split is None else split.skip_seq,
                seq_order=self._seq_order(attn_metadata, split), pdl=self.pdl)
        return output

    @staticmethod
    def _seq_order(attn_metadata: AttentionMetadata, split: PrefillSplit | None) -> torch.Tensor | None:
        """The runner's decode order (decode_order.py) for a decode-only step, else None;
        unified_attention applies it only on its 2D path (use_seq_order)."""
        if split is not None or attn_metadata.max_query_len != 1:
            return None
        return attn_metadata.decode_seq_order

    def _prefill_config(self, dtype: torch.dtype) -> Mapping[str, Any]:
        """The prefill kernel's default config for this dtype, with its block_q (host ints)."""
        return pa.default_config(self.num_heads // self.num_kv_heads, self.head_dim, dtype)

    def _prefill_split(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                       attn_metadata: AttentionMetadata) -> PrefillSplit | None:
        """This step's fresh prefills for the prefill kernel, or None (switch off, no K/V
        handed over, metadata without host copies, or no fresh prefill)."""
        if not self.use_prefill_kernel or key is None or value is None:
            return None
        sdpa_min_len = self.sdpa_min_len
        if sdpa_min_len is not None and not pa_sdpa.sdpa_takes(query.dtype, self.head_dim, query.device):
            sdpa_min_len = None                     # e.g. an fp32 model on CUDA: cuDNN refuses it
        return split_fresh_prefills(attn_metadata, self._prefill_config(query.dtype)["block_q"], query.device,
                                    sdpa_min_len, self.prefill_min_len)

    def _segm_buffers(self, device: torch.device) -> SoftmaxSegmentBuffers:
        segm = self._segm
        if segm is None or segm.softmax_segm_output.device != device:
            segm = self._segm = softmax_segm_buffers(self.num_heads, self.num_kv_heads, self.head_dim, device)
        return segm

    # The launch attributes a timed kernel's span carries, from host-side values only (no device read).
    def _cache_launch_attrs(self, key: torch.Tensor) -> dict:
        num_tokens = key.shape[0]
        return {"vllm_anatomy.grid": list(rc.launch_grid(num_tokens, self.num_kv_heads, self.head_dim)),
                "vllm_anatomy.num_tokens": num_tokens,
                # read K and V, write them into the cache, read the slots
                "vllm_anatomy.bytes": 4 * key.numel() * key.element_size() + 8 * num_tokens}

    def _fused_cache_launch_attrs(self, qkv: torch.Tensor, fused_with: str) -> dict:
        """fused_with: the model's launch the write joined (fused_qk_norm_rope or rotary_embedding)."""
        from vllm_anatomy.kernels import fused_qk_norm_rope as fqk
        num_tokens = qkv.shape[0]
        kv_bytes = num_tokens * self.num_kv_heads * self.head_dim * qkv.element_size()
        q_bytes = num_tokens * self.num_heads * self.head_dim * qkv.element_size()
        return {"vllm_anatomy.grid": list(fqk.launch_grid(num_tokens, self.num_heads, self.num_kv_heads,
                                                          self.head_dim)),
                "vllm_anatomy.num_tokens": num_tokens,
                # the write reshape_and_cache does unfused: K and V into the cache at slot_mapping
                "vllm_anatomy.kv_cache_update": "slot_mapping",
                "vllm_anatomy.fuses": [fused_with, "reshape_and_cache"],
                # q and k read and written back, v read, K and V written into the cache, the slots
                "vllm_anatomy.bytes": 2 * q_bytes + 5 * kv_bytes + 8 * num_tokens}

    def _prefill_launch_attrs(self, query: torch.Tensor, split: PrefillSplit) -> dict:
        cfg = self._prefill_config(query.dtype)
        grid = pa.launch_grid(split.work_list.shape[0], self.num_heads, self.num_kv_heads, cfg["pack_gqa"])
        # Q read + O written, K and V of the prefill tokens read once (the ideal; L2 serves the repeats).
        moved = 2 * split.num_prefill_tokens * (self.num_heads + self.num_kv_heads) * self.head_dim \
            * query.element_size()
        return {"vllm_anatomy.grid": list(grid), "vllm_anatomy.num_tokens": split.num_prefill_tokens,
                "vllm_anatomy.num_reqs": split.num_prefill_reqs, "vllm_anatomy.bytes": moved}

    def _sdpa_launch_attrs(self, query: torch.Tensor, split: PrefillSplit) -> dict:
        # Q read, K and V once, O written, and O read and written again by the copy into the
        # step's output (SDPA has no out=). No grid: the launches are cuDNN's.
        moved = (4 * self.num_heads + 2 * self.num_kv_heads) * split.num_sdpa_tokens * self.head_dim \
            * query.element_size()
        return {"vllm_anatomy.num_tokens": split.num_sdpa_tokens,
                "vllm_anatomy.num_reqs": len(split.sdpa_prefills), "vllm_anatomy.bytes": moved}

    def _attention_launch_attrs(self, query: torch.Tensor, attn_metadata: AttentionMetadata,
                                split: PrefillSplit | None = None) -> dict:
        num_tokens = attn_metadata.num_actual_tokens
        item = query.element_size()
        # NOTE: the keys from the host's values, never from the device (describing a
        # launch must not wait for it): the exact copy where there is one, else the
        # upper bound (the padded drafter batch's decode forwards under async
        # scheduling, where only the device knows how many drafts were rejected:
        # every draft counted as accepted), and the span says which.
        exact, upper_bound = attn_metadata._seq_lens_cpu, attn_metadata.seq_lens_cpu_upper_bound
        host_seq_lens = exact if exact is not None else upper_bound
        num_keys = int(host_seq_lens.sum()) if host_seq_lens is not None else 0
        num_work_tokens, max_query_len = num_tokens, attn_metadata.max_query_len
        if split is not None:   # the fresh prefills' programs exit at once
            num_work_tokens, num_keys = split.num_other_tokens, split.num_other_keys
            max_query_len = split.max_other_query_len
        # Q read + O written, and every request's K and V read once (GQA packed).
        moved = (2 * num_work_tokens * self.num_heads * self.head_dim * item
                 + 2 * num_keys * self.num_kv_heads * self.head_dim * item)
        segm = self._segm_buffers(query.device)
        use_3d = split is None and ua.use_3d_kernel(max_query_len, attn_metadata.num_reqs,
                                                    segm.seq_threshold_3D)
        segments = segm.num_par_softmax_segments if use_3d else None
        if segments is not None:
            # 3D: the fp32 partials (acc, max, sum per segment), written then read by the merge.
            moved += 2 * num_tokens * self.num_heads * segments * (self.head_dim + 2) * 4
        ordered = ua.use_seq_order(max_query_len, use_3d, self._seq_order(attn_metadata, split) is not None)
        grid = ua.default_grid(num_tokens, attn_metadata.num_reqs, self.num_heads, self.num_kv_heads,
                               self.head_dim, max_query_len, segments, seq_order=ordered)
        attrs = {"vllm_anatomy.grid": list(grid), "vllm_anatomy.num_tokens": num_tokens,
                 "vllm_anatomy.num_reqs": attn_metadata.num_reqs, "vllm_anatomy.num_keys": num_keys,
                 "vllm_anatomy.bytes": moved}
        if ordered:
            attrs["vllm_anatomy.seq_order"] = "lpt"      # longest context first (decode_order.py)
        if exact is None and upper_bound is not None:
            attrs["vllm_anatomy.num_keys_upper_bound"] = True
        return attrs


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl
