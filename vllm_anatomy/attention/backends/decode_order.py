"""The order in which unified_attention's 2D kernel runs a decode-only batch: longest context first.

A switch, on by default: VLLM_ANATOMY_DECODE_LPT=0 keeps batch order
(vllm_anatomy/envs.py), read once when the model runner is built. Not vLLM's.

NOTE: why an order at all (list scheduling). A decode-only batch of R requests
launches R x num_kv_heads programs of the 2D kernel (kernels/unified_attention.py),
each reading its request's whole K/V once: its running time is proportional to
the request's context. Far more programs than the GPU holds at once (256 x 8 =
2048 programs against a few hundred resident on 132 multiprocessors), so the GPU
deals them out as slots free up, and blocks are dealt in blockIdx order (observed
on NVIDIA GPUs, not a documented guarantee). That is list scheduling, and the order
of the list is ours to choose. In batch order (request i is program i, contexts
drawn at random) a long request's programs may start in the last wave and run
nearly alone at the end while the rest of the GPU idles: a simulation of nano-vllm's
workload (contexts 100-2048, 2048 programs over ~400 slots) put the busy fraction
at 0.80-0.91. Longest processing time first (Graham's LPT rule, within 4/3 of the
best schedule) starts the long programs first and lets the short ones fill the
gaps at the end: 0.93-0.98 in the same simulation. The sum of the work, and every
value computed, is unchanged: each request still gets exactly one program per KV
head, reading the same keys in the same order.

How it reaches the hardware's order: the kernel's grid is (num_kv_heads, R),
axis 0 (KV heads) fastest, so blockIdx order is (p = 0: every head), (p = 1: every
head), ...; program p of axis 1 serves request seq_order[p]. A request's heads
start together and seq_order[0] is the longest context.

NOTE: where the order comes from: host facts only, no device read. The runner's
host copy of seq_lens (the values it copies to the device this step), sorted
descending with numpy's stable argsort (ties keep batch order), once per step,
into a persistent buffer copied with the step's other inputs. Where seq_lens on
the host are only an upper bound (async speculative decoding counts every draft
as accepted until the device says otherwise) the order may be slightly off: that
changes the speed, never the result, since any permutation computes the same.

NOTE: CUDA graphs. A decode step replays a FULL graph captured at start-up, whose
kernel reads whatever address it was captured with: so the order lives in a
persistent device buffer of max_num_reqs entries (DecodeSeqOrder.buffer), captured
as the dummy metadata's decode_seq_order and refilled before each replay, as
seq_lens and query_start_loc are. A batch of B decodes padded to a captured size
N >= B launches N programs per head: the padding requests (seq_len 0, query_len 0)
sort last, each mapped to itself (entries B .. max_num_reqs - 1 are the identity),
and their programs exit at once.

Only decode-only batches (max_query_len == 1): a prefill or mixed batch keeps the
kernel's binary search over query blocks, and the split-KV (3D) path for a few
decodes ignores the order (its grid already splits each request's keys).

NOTE: so a decode batch of at most seq_threshold_3D requests gets no order at all:
no sort, no copy (host time on the shortest steps, ~1.5 ms at batch 1). That is
safe under CUDA graphs because the threshold snaps to a capture size
(triton_attn.get_seq_threshold_3D): a batch of B <= threshold requests replays a
graph of N <= threshold, which took the 3D path when it was captured and reads no
order. The runner sets the threshold once the model (its KV heads per rank) and
the capture sizes are known; 0 (the default) orders every decode-only batch.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_anatomy.worker.cpu_gpu_buffer import CpuGpuBuffer


def lpt_order(seq_lens: np.ndarray) -> np.ndarray:
    """[R] the requests' indices, longest seq_len first (stable: ties in batch order)."""
    return np.argsort(-seq_lens.astype(np.int64), kind="stable")


class DecodeSeqOrder:
    """The model runner's persistent order buffer (int32 [max_num_reqs], identity past the batch)."""

    def __init__(self, max_num_reqs: int, device: torch.device, pin_memory: bool) -> None:
        self.seq_threshold_3D = 0        # batches of at most this many requests: the 3D path, no order
        self.buffer = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device, pin_memory=pin_memory)
        self.identity = np.arange(max_num_reqs, dtype=np.int32)
        self.buffer.np[:] = self.identity
        self.buffer.copy_to_gpu()

    def prepare(self, seq_lens: np.ndarray, num_reqs: int, max_query_len: int) -> torch.Tensor | None:
        """This step's order on the device ([num_reqs], a view of the buffer), or None for a
        batch that is not decode-only or takes the 3D path. seq_lens: the host's [>= num_reqs]
        values of this step.
        NOTE: the whole buffer is copied (a few KB): a padded graph replay reads past num_reqs."""
        if max_query_len != 1 or num_reqs <= self.seq_threshold_3D:
            return None
        order = self.buffer.np
        order[:num_reqs] = lpt_order(seq_lens[:num_reqs])
        order[num_reqs:] = self.identity[num_reqs:]
        self.buffer.copy_to_gpu()
        return self.buffer.gpu[:num_reqs]

    def for_capture(self, num_reqs: int, query_len: int) -> torch.Tensor | None:
        """The dummy metadata's order (start-up warm-up and graph capture): the identity,
        written on the device; the buffer's address is what a captured graph keeps."""
        if query_len != 1:
            return None
        self.buffer.np[:] = self.identity
        self.buffer.copy_to_gpu()
        return self.buffer.gpu[:num_reqs]
