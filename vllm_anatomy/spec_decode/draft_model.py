"""DraftModelProposer: a small model of the same vocabulary guesses the next K tokens.

Mirrors vllm/v1/spec_decode/draft_model.py (DraftModelProposer) and its base,
vllm/v1/spec_decode/llm_base_proposer.py (SpecDecodeBaseProposer). After the target's step has
been verified and sampled, for every request that sampled a token:

  first pass   one forward of the draft model over the tokens the target
               computed this step whose KV is valid (its chunk, or its last
               token + the accepted drafts) and the token just sampled; greedy
               argmax at that last token = draft 1. This also fills the draft
               model's KV for every position the target computed, so that its
               cache keeps up with the target's.
  K - 1 loops  one token per request: draft j at its position -> draft j + 1.

    target step   [t, d1, d2, d3] verified: d1 accepted, d2 rejected -> outputs [d1, x]
    first pass    [t, d1, x]          positions p .. p+2   -> draft 1 (after x)
    loop          [draft 1] at p+3    -> draft 2;   [draft 2] at p+4 -> draft 3

The draft model has its own KV cache (one tensor per layer of its own), laid
out in the target's blocks: block b of the target's table is block b of the
draft's, so the scheduler's block table and slot mapping serve both (vLLM:
the draft layers join the target's KV-cache group). Every block therefore
costs the draft's bytes too (GPUModelRunner.get_kv_cache_bytes_per_block),
and the draft's writes past the verified tokens land in slots the scheduler
reserved ahead (num_lookahead_tokens = K in allocate_slots). A prefix-cache hit
gives both models their KV: whatever the target computed, the draft computed
in the same slots in the same step.

NOTE: vLLM keeps the rejected drafts in the first pass as padding (slot -1,
"padded drafter batch") so that nothing waits for the host; here the
accepted count is already on the host (the step's sync point was passed),
and the first pass simply leaves the rejected positions out. The drafts are
greedy (vLLM's default draft_sample_method "greedy"): the rejection sampler
treats them as certain (draft_probs None), which keeps sampling exact.

Per step with R requests each verifying K drafts (all accepted), the draft
model runs K forwards: R * (K + 2) tokens, then K - 1 times R tokens
(tests/unit/test_spec_decode_step_counts.py counts them). What makes them
cheap on a GPU, as vLLM's SpecDecodeBaseProposer does:
- persistent input buffers (input_ids, positions, slot_mapping): each forward
  writes values into them, from pinned host memory without a wait (a copy
  from pageable memory would make the host wait for the device every time);
  one staging row per forward of the step, since nothing waits between them;
- PIECEWISE CUDA graphs of the draft model, its own, captured after the
  target's (capture_model), dispatched by its own CudagraphDispatcher, which
  allows only PIECEWISE (vLLM: initialize_cudagraph_keys): a forward up to the
  largest capture size replays graph pieces with attention eager in between,
  instead of launching every kernel from Python; larger ones run eager.
On a CPU (and with cudagraph_mode NONE or FULL_DECODE_ONLY) every forward is eager.

Traced as the target is (the runner's tracer, tracing/runner_tracer.py:
propose_draft_token_ids): each forward runs inside
`kernel_timer.interval("GPU.draft_model_forward")` and its attention metadata
carries `kernel_timer`, so at trace level full on a GPU each forward and its
attention launches get device spans (a piecewise replay: its eager attention;
below full, a null timer whose `with` does nothing).
NOTE: the runner hands the drafter its kernel timer, never a Recorder: the
same seam the target's attention metadata uses, and nothing is computed
differently at any level.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from vllm_anatomy.attention.backends.abstract import PAD_SLOT_ID, AttentionMetadata
from vllm_anatomy.config import CompilationConfig, VllmConfig
from vllm_anatomy.model_executor.loader import get_model
from vllm_anatomy.tracing.runner_tracer import NULL_KERNEL_TIMER
from vllm_anatomy.worker.cpu_gpu_buffer import CpuGpuBuffer
from vllm_anatomy.worker.cudagraph import CUDAGraphMode, CUDAGraphRunner, CudagraphDispatcher

if TYPE_CHECKING:
    from vllm_anatomy.model_executor.models.llama import LlamaForCausalLM
    from vllm_anatomy.worker.gpu_input_batch import InputBatch

# The modes a draft forward may run in (vLLM's drafter dispatcher holds PIECEWISE keys only).
DRAFTER_CUDAGRAPH_MODES = frozenset({CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE})


class DraftModelProposer:

    def __init__(self, vllm_config: VllmConfig, device: torch.device, attn_backend: str,
                 kernel_timer: Any = NULL_KERNEL_TIMER) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.draft_model_config = spec.draft_model_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.block_size = vllm_config.cache_config.block_size
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.device = device
        self.attn_backend = attn_backend
        # The runner's kernel timer (AttentionMetadata.kernel_timer): times each forward and its launches.
        self.kernel_timer = kernel_timer
        self.model: LlamaForCausalLM
        self.kv_caches: list[torch.Tensor] = []
        # The first pass holds each row's verified tokens and its sampled one.
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens + self.max_num_reqs
        pin_memory = device.type == "cuda"
        # Persistent inputs: a graph replays on their addresses.
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_num_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        # Host staging, one row per forward of a step (the K forwards run without a wait in between).
        k, n, r = self.num_speculative_tokens, self.max_num_tokens, self.max_num_reqs
        self._staging_tokens = torch.zeros(k, 3, n, dtype=torch.int64, pin_memory=pin_memory)   # ids, positions, slots
        self._staging_reqs = CpuGpuBuffer(k, 4, r + 1, dtype=torch.int32, device=device, pin_memory=pin_memory)
        self._forward_index = 0
        # The padded drafter batch (propose_padded, async scheduling): per token (source in
        # the target's input ids, slot in its row, row), per row (first flat token,
        # scheduled tokens, drafts, discarded).
        self._padded_tokens = CpuGpuBuffer(3, n, dtype=torch.int64, device=device, pin_memory=pin_memory)
        self._padded_reqs = CpuGpuBuffer(4, r, dtype=torch.int64, device=device, pin_memory=pin_memory)
        self.cudagraph_dispatcher = CudagraphDispatcher(CompilationConfig())
        self.cudagraph_runner = CUDAGraphRunner()
        # Each forward of the last propose(): (runtime mode, tokens, padded tokens), for the trace and tests.
        self.last_forwards: list[tuple[CUDAGraphMode, int, int]] = []

    def load_model(self, *args, **kwargs) -> None:
        self.model = get_model(self.draft_model_config, backend=self.attn_backend).to(self.device)

    def get_kv_cache_bytes_per_block(self) -> int:
        model = self.model
        shape = model.attn_backend.get_kv_cache_shape(1, self.block_size, model.num_kv_heads, model.head_dim)
        return math.prod(shape) * next(model.parameters()).element_size() * model.num_layers

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One tensor per draft layer, in the same blocks as the target's."""
        model = self.model
        shape = model.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, model.num_kv_heads,
                                                      model.head_dim)
        dtype = next(model.parameters()).dtype
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(model.num_layers)]

    # -- CUDA graphs -----------------------------------------------------------------------
    def initialize_cudagraph_keys(self, compilation_config: CompilationConfig) -> None:
        """The drafter's dispatcher over the target's (resolved) capture sizes: PIECEWISE
        keys only, none unless the target captures pieces (vLLM: mixed_mode PIECEWISE)."""
        self.cudagraph_dispatcher = CudagraphDispatcher(compilation_config, self.max_num_reqs)

    @torch.inference_mode()
    def capture_model(self, dummy_metadata: Callable[[int], AttentionMetadata]) -> None:
        """Capture the draft model's pieces for every piecewise size, largest first.
        dummy_metadata(size): harmless metadata of `size` tokens (the runner's dummy step)."""
        for size in sorted(self.cudagraph_dispatcher.piecewise_sizes, reverse=True):
            self.input_ids[:size].zero_()
            self.positions[:size].zero_()
            self.slot_mapping[:size].fill_(PAD_SLOT_ID)                # nothing is written
            metadata = replace(dummy_metadata(size), slot_mapping=self.slot_mapping[:size])
            self.cudagraph_runner.capture(CUDAGraphMode.PIECEWISE, size, lambda: self.model(
                self.input_ids[:size], self.positions[:size], self.kv_caches, metadata))

    # -- propose ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids: list[list[int]], num_scheduled_tokens: np.ndarray,
                num_draft_tokens: np.ndarray, input_batch: InputBatch) -> list[list[int]]:
        """Drafts per batch row, after the step's bookkeeping (token_ids_cpu and
        num_tokens_no_spec hold the accepted tokens; num_computed_tokens_cpu still
        says where the step's tokens started). [] for rows that sampled nothing."""
        num_reqs = len(sampled_token_ids)
        self._forward_index = 0
        self.last_forwards = []
        starts = input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)              # [R]
        num_sampled = np.array([len(t) for t in sampled_token_ids], dtype=np.int64)            # [R]
        # The positions with valid target KV (drafts rejected: left out), plus
        # the sampled token; a partial prefill chunk has no sampled token.
        ends = starts + num_scheduled_tokens[:num_reqs] - num_draft_tokens[:num_reqs] + num_sampled   # [R]
        proposing = np.flatnonzero((num_sampled > 0) & (ends < self.max_model_len))
        draft_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        rows = np.arange(num_reqs)
        drafts = self._first_pass(input_batch, rows, starts, ends, proposing)                   # [P]
        if drafts is None:
            return draft_token_ids
        proposed = [drafts]
        positions = ends[proposing]                                  # where draft 1 goes
        for _ in range(self.num_speculative_tokens - 1):
            drafts = self._decode_step(input_batch, proposing, positions, drafts)
            positions = positions + 1
            proposed.append(drafts)
        # [P, K] -> per row, cut at max_model_len (a draft's position must exist).
        # NOTE: the step's one wait for the device in the drafter.
        table = torch.stack(proposed, dim=1).tolist()
        for row, ids, end in zip(proposing.tolist(), table, ends[proposing].tolist()):
            draft_token_ids[row] = ids[:self.max_model_len - end]
        return draft_token_ids

    def _first_pass(self, input_batch: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                    proposing: np.ndarray) -> torch.Tensor | None:
        """The draft model over each row's [start, end) tokens: its KV written, and
        draft 1 of the proposing rows (argmax at their last token) [P]; None if none propose."""
        query_lens = ends - starts                                                             # [R]
        keep = query_lens > 0
        rows, starts, ends, query_lens = rows[keep], starts[keep], ends[keep], query_lens[keep]
        if not len(rows):
            return None
        cu_query_lens = np.cumsum(query_lens)                                                  # [R']
        total = int(cu_query_lens[-1])
        # Each token's position: its row's start + its index within the row (no per-row loop).
        positions = np.repeat(starts - (cu_query_lens - query_lens), query_lens) + np.arange(total)   # [T]
        req_rows = np.repeat(rows, query_lens)                                                 # [T]
        token_ids = input_batch.token_ids_cpu[req_rows, positions]                             # [T]
        hidden = self._forward(input_batch, rows, token_ids, positions, query_lens, ends)      # [T, H]
        if not len(proposing):
            return None
        # Each proposing row's last token (proposing rows all have tokens: a subset of rows).
        sample_at = cu_query_lens[np.searchsorted(rows, proposing)] - 1                        # [P]
        return self.model.compute_logits(hidden[self._to_device_index(sample_at)]).argmax(dim=-1)   # [P]

    def _decode_step(self, input_batch: InputBatch, rows: np.ndarray, positions: np.ndarray,
                     token_ids: torch.Tensor) -> torch.Tensor:
        """One token per proposing row at `positions` -> the next draft [P]. A position
        at max_model_len or past it is clamped and writes nothing (its draft is cut)."""
        clamped = np.minimum(positions, self.max_model_len - 1)
        hidden = self._forward(input_batch, rows, token_ids, clamped, np.ones(len(rows), dtype=np.int64),
                               clamped + 1, no_write=positions >= self.max_model_len)
        return self.model.compute_logits(hidden[:len(rows)]).argmax(dim=-1)

    def _forward(self, input_batch: InputBatch, rows: np.ndarray, token_ids: np.ndarray | torch.Tensor,
                 positions: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
                 no_write: np.ndarray | None = None, slot_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The draft model on a flat batch of the given batch rows, over its own KV cache
        (block table and slots: the target's rows). Returns hidden states [T or padded, H]."""
        num_tokens, num_reqs = len(positions), len(rows)
        mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(num_tokens, valid_modes=DRAFTER_CUDAGRAPH_MODES)
        padded = batch_descriptor.num_tokens
        self.last_forwards.append((mode, num_tokens, padded))
        j = self._forward_index
        self._forward_index += 1
        # Host values into this forward's staging row, then into the persistent buffers.
        tokens, reqs = self._staging_tokens[j], self._staging_reqs
        block_table = input_batch.block_table
        req_rows = np.repeat(rows, query_lens)
        ids_np, pos_np, slots_np = tokens.numpy()
        pos_np[:num_tokens] = positions
        pos_np[num_tokens:padded] = 0
        slots = slots_np[:padded]
        np.add(block_table.block_table_np[req_rows, positions // self.block_size].astype(np.int64) * self.block_size,
               positions % self.block_size, out=slots[:num_tokens])                          # [T]
        if no_write is not None:
            slots[:num_tokens][no_write] = PAD_SLOT_ID
        slots[num_tokens:] = PAD_SLOT_ID                                 # padding writes nothing
        self.positions[:padded].copy_(tokens[1, :padded], non_blocking=True)
        self.slot_mapping[:padded].copy_(tokens[2, :padded], non_blocking=True)
        if slot_mask is not None:                                        # (device-side: padding writes nothing)
            self.slot_mapping[:num_tokens].masked_fill_(slot_mask, PAD_SLOT_ID)
        if isinstance(token_ids, torch.Tensor):                          # the last drafts, on the device
            self.input_ids[:num_tokens].copy_(token_ids)
        else:
            ids_np[:num_tokens] = token_ids
            ids_np[num_tokens:padded] = 0
            self.input_ids[:padded].copy_(tokens[0, :padded], non_blocking=True)
        qsl_np, seq_lens_np, rows_np = reqs.np[j, 0], reqs.np[j, 1], reqs.np[j, 2]
        qsl_np[0] = 0
        np.cumsum(query_lens, out=qsl_np[1:num_reqs + 1])
        seq_lens_np[:num_reqs] = seq_lens
        rows_np[:num_reqs] = rows
        reqs.gpu[j, :3].copy_(reqs.cpu[j, :3], non_blocking=True)
        if num_reqs and rows[-1] == num_reqs - 1:        # rows 0..R-1 (ascending): the table's first rows
            req_block_table = block_table.get_device_tensor(num_reqs)
        else:
            req_block_table = block_table.block_table[reqs.gpu[j, 2, :num_reqs].long()]
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=num_reqs, max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()), query_start_loc=reqs.gpu[j, 0, :num_reqs + 1],
            seq_lens=reqs.gpu[j, 1, :num_reqs], block_table=req_block_table,
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc_cpu=reqs.cpu[j, 0, :num_reqs + 1], _seq_lens_cpu=reqs.cpu[j, 1, :num_reqs],
            seq_lens_cpu_upper_bound=reqs.cpu[j, 1, :num_reqs],             # (the host knows them: exact)
            kernel_timer=self.kernel_timer)
        return self._run_model(j, mode, num_tokens, padded, metadata)                          # [T or N, H]

    def _run_model(self, j: int, mode: CUDAGraphMode, num_tokens: int, padded: int,
                   metadata: AttentionMetadata) -> torch.Tensor:
        """The draft model over the persistent inputs: forward j of this step, eager or a piecewise
        replay of `padded` tokens; timed as one device span (at trace level full)."""
        with self.kernel_timer.interval("GPU.draft_model_forward", **{
                "vllm_anatomy.draft_forward": j, "vllm_anatomy.num_tokens": num_tokens,
                "vllm_anatomy.num_padded_tokens": padded, "vllm_anatomy.cudagraph_mode": mode.name}):
            if mode is CUDAGraphMode.PIECEWISE:
                return self.cudagraph_runner.replay_piecewise(padded, metadata)               # [N, H]
            return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens], self.kv_caches, metadata)

    # -- propose, padded (async scheduling) ------------------------------------------------
    @torch.inference_mode()
    def propose_padded(self, target_token_ids: torch.Tensor, num_scheduled_tokens: np.ndarray,
                       num_draft_tokens: np.ndarray, starts: np.ndarray, output_token_ids: torch.Tensor,
                       discard: np.ndarray, input_batch: InputBatch) -> torch.Tensor:
        """propose() without reading the step's output on the host: drafts [R, K] on the device.

        vLLM's "padded drafter batch": each row's first-pass query is its
        scheduled tokens plus one slot, at positions start .. start + q, a
        layout the host knows. Only the device knows how many drafts were
        accepted: there the slot after the accepted tokens gets the bonus
        (or recovered) token, and the slots after it, the rejected drafts,
        are padding that writes no KV (slot -1). The bonus token attends only
        to positions up to its own, so the padding changes nothing it sees.

            row with q = 4 (t, d1, d2, d3), d1 accepted, x sampled:
            slot        0    1    2    3    4
            token       t    d1   x    -    -      (-: padding, not written)
            position    p    p+1  p+2  p+3  p+4    -> draft 1 from slot 2

        The K - 1 decode forwards then run at device-side positions (p + 3 ..),
        their slots and seq_lens computed on the device. target_token_ids: the
        step's input ids on the device (drafts included); output_token_ids
        [R, 1 + K] (-1: rejected); starts: each row's first position; discard:
        partial prefill chunks (their KV is written, their drafts unused).
        """
        num_reqs = len(starts)
        self._forward_index = 0
        self.last_forwards = []
        q = num_scheduled_tokens[:num_reqs]
        query_lens = q + 1                                                                  # [R]
        cu = np.cumsum(query_lens)
        total = int(cu[-1])
        first = cu - query_lens                                                             # [R]
        slot = np.arange(total) - np.repeat(first, query_lens)                             # [T] slot within its row
        positions = np.repeat(starts, query_lens) + slot                                    # [T]
        first_q = np.cumsum(q) - q
        # Slot j < q reads the row's j-th target input; slot q is overwritten below.
        src = np.repeat(first_q, query_lens) + np.minimum(slot, np.repeat(q - 1, query_lens))
        tok, req = self._padded_tokens, self._padded_reqs
        tok.np[0, :total], tok.np[1, :total] = src, slot
        tok.np[2, :total] = np.repeat(np.arange(num_reqs), query_lens)
        req.np[0, :num_reqs], req.np[1, :num_reqs], req.np[2, :num_reqs] = first, q, num_draft_tokens[:num_reqs]
        req.np[3, :num_reqs] = discard[:num_reqs]
        tok.gpu[:, :total].copy_(tok.cpu[:, :total], non_blocking=True)
        req.gpu[:, :num_reqs].copy_(req.cpu[:, :num_reqs], non_blocking=True)
        src_d, slot_d, row_d = tok.gpu[0, :total], tok.gpu[1, :total], tok.gpu[2, :total]
        first_d, q_d, n_d = req.gpu[0, :num_reqs], req.gpu[1, :num_reqs], req.gpu[2, :num_reqs]
        discard_d = req.gpu[3, :num_reqs].bool()
        # On the device: how many of each row's tokens are valid, and its bonus token.
        vocab_size = input_batch.vocab_size
        num_sampled = ((output_token_ids >= 0) & (output_token_ids < vocab_size)).sum(dim=1)       # [R]
        num_sampled = torch.where(discard_d, 0, num_sampled)
        num_rejected = torch.where(discard_d, 0, n_d + 1 - num_sampled)                    # [R]
        num_valid = q_d - num_rejected                                                      # [R] the bonus slot
        next_token_ids = output_token_ids.gather(1, (num_sampled - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        token_ids = target_token_ids[src_d]                                                 # [T]
        bonus_index = first_d + num_valid                                                   # [R]
        token_ids.index_copy_(0, bonus_index, torch.where(discard_d, 0, next_token_ids.long()))
        last_written = torch.where(discard_d, q_d - 1, num_valid)
        slot_mask = slot_d > last_written[row_d]                                            # [T] padding
        rows = np.arange(num_reqs)
        clamped = np.minimum(positions, self.max_model_len - 1)
        hidden = self._forward(input_batch, rows, token_ids, clamped, query_lens, starts + query_lens,
                               no_write=positions >= self.max_model_len, slot_mask=slot_mask)    # [T, H]
        drafts = self.model.compute_logits(hidden[bonus_index]).argmax(dim=-1)             # [R]
        proposed = [drafts]
        # Draft 1's position, on the device (positions[bonus] + 1).
        position = self.positions[bonus_index] + 1                                          # [R]
        # NOTE: the host's view of the decode forwards' seq_lens, as v0.27.1's
        # SpecDecodeBaseProposer: the first pass's (exact: the padded layout) are an upper
        # bound from here, since the rejected drafts' slots drop out on the device only
        # (exact when all were accepted); each forward adds one token
        # (_update_positions_dependent_metadata bumps seq_lens_cpu_upper_bound by 1).
        # No exact host copy (v0.27.1 sets _seq_lens_cpu to None), so nothing waits.
        seq_lens_cpu_upper_bound = starts + query_lens                                      # [R]
        for _ in range(self.num_speculative_tokens - 1):
            # (at most max_model_len, as the device's seq_lens: their positions are clamped)
            seq_lens_cpu_upper_bound = np.minimum(seq_lens_cpu_upper_bound + 1, self.max_model_len)
            drafts = self._decode_step_padded(input_batch, num_reqs, position, drafts, discard_d,
                                              seq_lens_cpu_upper_bound)
            position = position + 1
            proposed.append(drafts)
        return torch.stack(proposed, dim=1)                                                 # [R, K]

    def _decode_step_padded(self, input_batch: InputBatch, num_reqs: int, positions: torch.Tensor,
                            token_ids: torch.Tensor, no_write: torch.Tensor,
                            seq_lens_cpu_upper_bound: np.ndarray) -> torch.Tensor:
        """One token per row at device-side `positions` [R] -> the next draft [R]. Slots and
        seq_lens are computed on the device; seq_lens_cpu_upper_bound [R] is the host's bound."""
        mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(num_reqs, valid_modes=DRAFTER_CUDAGRAPH_MODES)
        padded = batch_descriptor.num_tokens
        self.last_forwards.append((mode, num_reqs, padded))
        j = self._forward_index
        self._forward_index += 1
        past_end = positions >= self.max_model_len
        clamped = positions.clamp(max=self.max_model_len - 1)
        block_table = input_batch.block_table.get_device_tensor(num_reqs)
        block_ids = block_table.gather(1, (clamped // self.block_size).unsqueeze(1)).squeeze(1).long()
        slots = (block_ids * self.block_size + clamped % self.block_size).masked_fill_(no_write | past_end,
                                                                                       PAD_SLOT_ID)
        self.positions[:num_reqs].copy_(clamped)
        self.positions[num_reqs:padded].zero_()
        self.slot_mapping[:num_reqs].copy_(slots)
        self.slot_mapping[num_reqs:padded].fill_(PAD_SLOT_ID)
        self.input_ids[:num_reqs].copy_(token_ids)
        self.input_ids[num_reqs:padded].zero_()
        reqs = self._staging_reqs
        reqs.np[j, 0, :num_reqs + 1] = np.arange(num_reqs + 1)
        reqs.gpu[j, 0, :num_reqs + 1].copy_(reqs.cpu[j, 0, :num_reqs + 1], non_blocking=True)
        reqs.np[j, 1, :num_reqs] = seq_lens_cpu_upper_bound          # (host only: never copied to the device)
        # NOTE: no exact host copy of seq_lens (_seq_lens_cpu None): the Triton kernels
        # read the device's, the trace counts keys from the upper bound, and the torch
        # and cpu backends, which mask keys by the exact lengths, read the device once
        # per forward (AttentionMetadata.seq_lens_cpu: free on a CPU, a wait on a GPU).
        metadata = AttentionMetadata(
            num_actual_tokens=num_reqs, num_reqs=num_reqs, max_query_len=1,
            max_seq_len=int(seq_lens_cpu_upper_bound.max()), query_start_loc=reqs.gpu[j, 0, :num_reqs + 1],
            seq_lens=(clamped + 1).int(), block_table=block_table, slot_mapping=self.slot_mapping[:num_reqs],
            query_start_loc_cpu=reqs.cpu[j, 0, :num_reqs + 1], _seq_lens_cpu=None,
            seq_lens_cpu_upper_bound=reqs.cpu[j, 1, :num_reqs], kernel_timer=self.kernel_timer)
        hidden = self._run_model(j, mode, num_reqs, padded, metadata)
        return self.model.compute_logits(hidden[:num_reqs]).argmax(dim=-1)

    def _to_device_index(self, index: np.ndarray) -> torch.Tensor:
        """Host row indices (the first pass's sample rows) as a device tensor, without a wait
        (staging row 0's spare line: written once per step)."""
        buf = self._staging_reqs
        buf.np[0, 3, :len(index)] = index
        return buf.gpu[0, 3, :len(index)].copy_(buf.cpu[0, 3, :len(index)], non_blocking=True).long()
