"""CachedRequestState and the persistent InputBatch.

Mirrors vllm/v1/worker/gpu_input_batch.py (the "V1" model runner's persistent
batch, as the article describes it).

The runner keeps one CachedRequestState per live request (keyed by req_id) and
one InputBatch whose *rows* are the requests scheduled this step. The batch is
persistent: consecutive steps mostly serve the same requests, so rows are
edited in place (add / remove / condense) rather than rebuilt every step.

NOTE: a row index is a temporary coordinate, valid for one step; req_id is the
stable identity. Every per-row structure (token_ids_cpu, the block table, the
sampling arrays, generators) is indexed by row, so whenever a request changes
row they must all move together — that is what condense() and swap_states() do.

Speculative decoding: a step's draft tokens are written into token_ids_cpu after
num_tokens_no_spec (worker/spec_decode_runner.py); they are not counted as tokens.

Penalties need each row's tokens twice over (vLLM's bookkeeping): the prompt
(from token_ids_cpu, as a padded [R, longest prompt] tensor) and the output so
far (req_output_token_ids: per row, the request's own output list, shared
with its CachedRequestState, so every appended token is seen). Bad words read
the same output lists.

Simplified here: no LoRA, no multimodal, no pooling.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_anatomy.model_executor.sampling_metadata import SamplingMetadata
from vllm_anatomy.sampling_params import _SAMPLING_EPS, SamplingParams
from vllm_anatomy.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    """The worker's own copy of what it needs to know about one request."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    # One list per KV-cache group (we have one group).
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    # NOTE: the worker caches the tokens it sampled itself; the scheduler does
    # not send them back (it only would with pipeline parallelism).
    output_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def get_token_id(self, idx: int) -> int:
        if idx < self.num_prompt_tokens:
            return self.prompt_token_ids[idx]
        return self.output_token_ids[idx - self.num_prompt_tokens]


class InputBatch:

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 device: torch.device | str, pin_memory: bool, vocab_size: int,
                 block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.vocab_size = vocab_size

        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        # Per row: the request's output token list (CachedRequestState.output_token_ids, the
        # same object); read by penalties and bad words. Moves with its row.
        self.req_output_token_ids: list[list[int] | None] = []
        # Rows freed by remove_request, a min-heap: add_request reuses the
        # lowest one, condense() fills the rest.
        self._removed: list[int] = []
        self.last_condense_moves: list[tuple[int, int]] = []

        # [max_num_reqs, max_model_len] int32: every token (prompt + output) of every row.
        self.token_ids_cpu_tensor = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int32,
                                                          pin_memory=pin_memory)
        self.num_computed_tokens_cpu = self.num_computed_tokens_cpu_tensor.numpy()

        self.block_table = BlockTable(block_size, max_num_reqs, -(-max_model_len // block_size),
                                      max_num_batched_tokens, device, pin_memory)

        # Sampling parameters: a CPU array per field (numpy view of a pinned
        # tensor) and a device tensor it is copied to in refresh_metadata().
        self.temperature_cpu_tensor, self.temperature_cpu, self.temperature = self._pair(torch.float32)
        self.top_p_cpu_tensor, self.top_p_cpu, self.top_p = self._pair(torch.float32)
        self.top_k_cpu_tensor, self.top_k_cpu, self.top_k = self._pair(torch.int32)
        self.min_p_cpu_tensor, self.min_p_cpu, self.min_p = self._pair(torch.float32)
        self.greedy_reqs: set[str] = set()
        self.random_reqs: set[str] = set()
        self.top_p_reqs: set[str] = set()
        self.top_k_reqs: set[str] = set()
        self.min_p_reqs: set[str] = set()
        # Penalties, per row (0.0 / 0.0 / 1.0 = off) and the requests using each.
        self.frequency_penalties_cpu_tensor, self.frequency_penalties_cpu, self.frequency_penalties = \
            self._pair(torch.float32)
        self.presence_penalties_cpu_tensor, self.presence_penalties_cpu, self.presence_penalties = \
            self._pair(torch.float32)
        self.repetition_penalties_cpu_tensor, self.repetition_penalties_cpu, self.repetition_penalties = \
            self._pair(torch.float32)
        self.frequency_penalties_reqs: set[str] = set()
        self.presence_penalties_reqs: set[str] = set()
        self.repetition_penalties_reqs: set[str] = set()
        # req_id -> its allowed token ids, and the [R, V] mask built from them (rebuilt
        # only when such a request joins, leaves or moves row, as for logit_bias).
        self.allowed_token_ids: dict[str, list[int]] = {}
        self._allowed_mask_key: tuple = ()
        self._allowed_mask_cache: torch.Tensor | None = None
        # req_id -> its bad words as token sequences.
        self.bad_words_token_ids: dict[str, list[list[int]]] = {}
        # batch row -> generator (seeded requests only); req_id -> logprobs count.
        self.generators: dict[int, torch.Generator] = {}
        self.num_logprobs: dict[str, int] = {}
        # req_id -> (min_tokens, stop token ids it must not sample before that).
        self.min_tokens: dict[str, tuple[int, list[int]]] = {}
        # req_id -> {token id: bias} (vLLM: LogitBiasLogitsProcessor's state).
        self.logit_bias: dict[str, dict[int, float]] = {}
        # The last (rows, token ids, biases) tensors, and the (req_id, row) pairs they were built for.
        self._logit_bias_key: tuple = ()
        self._logit_bias_tensors_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.sampling_metadata: SamplingMetadata | None = None
        # Async scheduling: last step's sampled ids, still on the device [R_prev],
        # and the row each request had then (rows that sampled nothing are absent).
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_index: dict[str, int] | None = None
        self.prev_req_ids: list[str] | None = None     # when every row sampled: the fast path
        # Speculative decoding: this step's drafts of each row, [R] lists (set after
        # condense() by the runner's _update_spec_token_ids); None in a step without drafts.
        self.spec_token_ids: list[list[int]] | None = None

        # Every per-row numpy array: they move together in condense/swap.
        self._row_arrays = (self.num_tokens_no_spec, self.num_prompt_tokens,
                            self.num_computed_tokens_cpu, self.temperature_cpu,
                            self.top_p_cpu, self.top_k_cpu, self.min_p_cpu,
                            self.frequency_penalties_cpu, self.presence_penalties_cpu,
                            self.repetition_penalties_cpu)

    def _pair(self, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        cpu = torch.zeros(self.max_num_reqs, dtype=dtype, pin_memory=self.pin_memory)
        return cpu, cpu.numpy(), torch.zeros(self.max_num_reqs, dtype=dtype, device=self.device)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids of rows [0, num_reqs), valid after condense()."""
        return self._req_ids[:self.num_reqs]  # type: ignore[return-value]

    # -- add / remove -----------------------------------------------------------
    def add_request(self, request: CachedRequestState) -> int:
        """Put a request in the lowest free row (or a new row at the end).

        NOTE: everything that can be wrong with the request is checked first,
        so a refused request (ValueError) leaves the batch untouched; the
        runner then fails that request alone (GPUModelRunner._per_request).
        """
        self._check_request(request)
        if not self._removed and len(self._req_ids) >= self.max_num_reqs:
            raise ValueError(f"InputBatch is full ({self.max_num_reqs} rows)")
        req_index = heapq.heappop(self._removed) if self._removed else len(self._req_ids)
        req_id = request.req_id
        if req_index == len(self._req_ids):
            self._req_ids.append(req_id)
            self.req_output_token_ids.append(request.output_token_ids)
        else:
            self._req_ids[req_index] = req_id
            self.req_output_token_ids[req_index] = request.output_token_ids
        self.req_id_to_index[req_id] = req_index

        num_prompt = request.num_prompt_tokens
        end = num_prompt + len(request.output_token_ids)
        self.token_ids_cpu[req_index, :num_prompt] = request.prompt_token_ids
        self.token_ids_cpu[req_index, num_prompt:end] = request.output_token_ids
        self.num_prompt_tokens[req_index] = num_prompt
        self.num_tokens_no_spec[req_index] = end
        self.num_computed_tokens_cpu[req_index] = request.num_computed_tokens
        self.block_table.add_row(request.block_ids[0], req_index)
        self._add_sampling_params(req_id, req_index, request.sampling_params)
        if request.generator is not None:
            self.generators[req_index] = request.generator
        return req_index

    def _check_request(self, request: CachedRequestState) -> None:
        """Raise ValueError if this request's rows could not be built safely.

        NOTE: the frontend and EngineCore already refused such requests; this
        is the last line, where the ids become indices into [*, vocab_size]
        tensors (a stop id past the vocabulary would crash the whole batch's
        min-tokens masking, not just this request).
        """
        if request.req_id in self.req_id_to_index:
            raise ValueError(f"{request.req_id} is already in the batch")
        num_tokens = request.num_prompt_tokens + len(request.output_token_ids)
        if num_tokens > self.max_model_len:
            raise ValueError(f"{request.req_id}: {num_tokens} tokens exceed max_model_len={self.max_model_len}")
        ids = request.prompt_token_ids
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"{request.req_id}: a prompt token id is outside the vocabulary")
        request.sampling_params.verify(self.vocab_size)

    def _add_sampling_params(self, req_id: str, i: int, sp: SamplingParams) -> None:
        if sp.temperature < _SAMPLING_EPS:
            # NOTE: 0.0 marks the row greedy; the Sampler takes argmax for it.
            self.temperature_cpu[i] = 0.0
            self.greedy_reqs.add(req_id)
        else:
            self.temperature_cpu[i] = sp.temperature
            self.random_reqs.add(req_id)
        self.top_p_cpu[i] = sp.top_p
        if sp.top_p < 1.0:
            self.top_p_reqs.add(req_id)
        top_k = sp.top_k if 0 < sp.top_k < self.vocab_size else self.vocab_size
        self.top_k_cpu[i] = top_k
        if top_k < self.vocab_size:
            self.top_k_reqs.add(req_id)
        self.min_p_cpu[i] = sp.min_p
        if sp.min_p > _SAMPLING_EPS:
            self.min_p_reqs.add(req_id)
        if sp.logprobs is not None:
            self.num_logprobs[req_id] = sp.logprobs
        stop_ids = [t for t in [sp.eos_token_id, *(sp.stop_token_ids or []), *(sp.all_stop_token_ids or [])]
                    if t is not None]
        if sp.min_tokens > 0 and stop_ids:
            self.min_tokens[req_id] = (sp.min_tokens, stop_ids)
        if sp.logit_bias:
            self.logit_bias[req_id] = dict(sp.logit_bias)
        self.frequency_penalties_cpu[i] = sp.frequency_penalty
        if sp.frequency_penalty != 0.0:
            self.frequency_penalties_reqs.add(req_id)
        self.presence_penalties_cpu[i] = sp.presence_penalty
        if sp.presence_penalty != 0.0:
            self.presence_penalties_reqs.add(req_id)
        self.repetition_penalties_cpu[i] = sp.repetition_penalty
        if sp.repetition_penalty != 1.0:
            self.repetition_penalties_reqs.add(req_id)
        if sp.allowed_token_ids:
            self.allowed_token_ids[req_id] = list(sp.allowed_token_ids)
        if sp.bad_words_token_ids:
            self.bad_words_token_ids[req_id] = sp.bad_words_token_ids

    def remove_request(self, req_id: str) -> int | None:
        """Free a request's row. Leaves a hole: call condense() before running a step."""
        req_index = self.req_id_to_index.pop(req_id, None)
        if req_index is None:
            return None
        heapq.heappush(self._removed, req_index)
        self._req_ids[req_index] = None
        self.req_output_token_ids[req_index] = None
        for s in (self.greedy_reqs, self.random_reqs, self.top_p_reqs, self.top_k_reqs, self.min_p_reqs,
                  self.frequency_penalties_reqs, self.presence_penalties_reqs, self.repetition_penalties_reqs):
            s.discard(req_id)
        self.generators.pop(req_index, None)
        self.num_logprobs.pop(req_id, None)
        self.min_tokens.pop(req_id, None)
        self.logit_bias.pop(req_id, None)
        self.allowed_token_ids.pop(req_id, None)
        self.bad_words_token_ids.pop(req_id, None)
        self.block_table.clear_row(req_index)
        return req_index

    # -- moving rows --------------------------------------------------------------
    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange rows i1 and i2 (vLLM uses it to reorder a batch, e.g. decodes first)."""
        id1, id2 = self._req_ids[i1], self._req_ids[i2]
        self._req_ids[i1], self._req_ids[i2] = id2, id1
        for req_id, row in ((id2, i1), (id1, i2)):
            if req_id is not None:
                self.req_id_to_index[req_id] = row
        out = self.req_output_token_ids
        out[i1], out[i2] = out[i2], out[i1]
        # Only the live prefix of the token rows matters.
        n = int(max(self.num_tokens_no_spec[i1], self.num_tokens_no_spec[i2]))
        self.token_ids_cpu[[i1, i2], :n] = self.token_ids_cpu[[i2, i1], :n]
        for arr in self._row_arrays:
            arr[[i1, i2]] = arr[[i2, i1]]
        self.block_table.swap_row(i1, i2)
        g1, g2 = self.generators.pop(i1, None), self.generators.pop(i2, None)
        if g1 is not None:
            self.generators[i2] = g1
        if g2 is not None:
            self.generators[i1] = g2

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self._req_ids[src]
        assert req_id is not None and self._req_ids[dst] is None
        self._req_ids[dst], self._req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = dst
        out = self.req_output_token_ids
        out[dst], out[src] = out[src], None
        n = int(self.num_tokens_no_spec[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        for arr in self._row_arrays:
            arr[dst] = arr[src]
        self.block_table.move_row(src, dst)
        gen = self.generators.pop(src, None)
        if gen is not None:
            self.generators[dst] = gen

    def condense(self) -> list[tuple[int, int]]:
        """Close the holes left by remove_request so rows [0, num_reqs) are dense.

        NOTE: the *last* occupied row moves into the *smallest* hole, repeatedly.
        Each move is one row copy, and at most one move per hole is needed; rows
        already below every hole never move, so most rows keep their index from
        step to step (cheap for everything indexed by row). Kernels need the
        dense prefix: they index rows 0..num_reqs-1.
        Returns (and keeps in last_condense_moves) the (src, dst) moves made.
        """
        moves: list[tuple[int, int]] = []
        holes = sorted(self._removed)
        self._removed = []
        last = len(self._req_ids) - 1
        for hole in holes:
            while last >= 0 and self._req_ids[last] is None:
                last -= 1
            if hole >= last:
                break  # every row above this hole is empty: nothing left to move
            self._move_row(last, hole)
            moves.append((last, hole))
            last -= 1
        del self._req_ids[self.num_reqs:]
        del self.req_output_token_ids[self.num_reqs:]
        self.last_condense_moves = moves
        return moves

    # -- sampling metadata --------------------------------------------------------
    def refresh_metadata(self) -> SamplingMetadata:
        """Copy the sampling arrays of rows [0, num_reqs) to the device and wrap them."""
        n = self.num_reqs

        def to_device(cpu: torch.Tensor, dev: torch.Tensor, used: bool) -> torch.Tensor | None:
            if not used:
                return None
            dev[:n].copy_(cpu[:n], non_blocking=True)
            return dev[:n]

        all_greedy = not self.random_reqs
        no_penalties = not (self.frequency_penalties_reqs or self.presence_penalties_reqs
                            or self.repetition_penalties_reqs)
        # NOTE: the output lists go in only when something reads them (vLLM's rule).
        needs_output_token_ids = not no_penalties or bool(self.bad_words_token_ids)
        self.sampling_metadata = SamplingMetadata(
            temperature=to_device(self.temperature_cpu_tensor, self.temperature, not all_greedy),
            all_greedy=all_greedy,
            all_random=not self.greedy_reqs,
            top_p=to_device(self.top_p_cpu_tensor, self.top_p, bool(self.top_p_reqs)),
            top_k=to_device(self.top_k_cpu_tensor, self.top_k, bool(self.top_k_reqs)),
            min_p=to_device(self.min_p_cpu_tensor, self.min_p, bool(self.min_p_reqs)),
            generators=dict(self.generators),
            max_num_logprobs=max(self.num_logprobs.values()) if self.num_logprobs else None,
            min_tokens=self._rows_below_min_tokens(),
            logit_bias=self._logit_bias_tensors(),
            no_penalties=no_penalties,
            prompt_token_ids=None if no_penalties else self._make_prompt_token_ids_tensor(),
            frequency_penalties=to_device(self.frequency_penalties_cpu_tensor, self.frequency_penalties,
                                          not no_penalties),
            presence_penalties=to_device(self.presence_penalties_cpu_tensor, self.presence_penalties,
                                         not no_penalties),
            repetition_penalties=to_device(self.repetition_penalties_cpu_tensor, self.repetition_penalties,
                                           not no_penalties),
            output_token_ids=list(self.req_output_token_ids) if needs_output_token_ids else [],  # type: ignore[arg-type]
            allowed_token_ids_mask=self._allowed_token_ids_mask(),
            bad_words_token_ids={self.req_id_to_index[r]: ids for r, ids in self.bad_words_token_ids.items()},
            spec_token_ids=self.spec_token_ids,
        )
        return self.sampling_metadata

    def _make_prompt_token_ids_tensor(self) -> torch.Tensor:
        """[R, longest prompt] int64 on the device: each row's prompt, padded with vocab_size.

        NOTE: rebuilt every step that has penalties (as vLLM does), from
        token_ids_cpu: a row's prompt never changes, but rows move.
        """
        n = self.num_reqs
        max_prompt_len = int(self.num_prompt_tokens[:n].max())
        prompt = self.token_ids_cpu[:n, :max_prompt_len].astype(np.int64)          # [R, P]
        cols = np.arange(max_prompt_len)
        prompt[cols >= self.num_prompt_tokens[:n, None]] = self.vocab_size         # the padding
        return torch.from_numpy(prompt).to(self.device, non_blocking=True)

    def _allowed_token_ids_mask(self) -> torch.Tensor | None:
        """[R, V] bool, True where a row may NOT sample (vLLM's sense); None if no row restricts."""
        if not self.allowed_token_ids:
            return None
        key = (self.num_reqs, *((req_id, self.req_id_to_index[req_id]) for req_id in self.allowed_token_ids))
        if key != self._allowed_mask_key:
            mask = torch.zeros((self.num_reqs, self.vocab_size), dtype=torch.bool)
            for req_id, ids in self.allowed_token_ids.items():
                row = self.req_id_to_index[req_id]
                mask[row] = True
                mask[row, ids] = False
            self._allowed_mask_key = key
            self._allowed_mask_cache = mask.to(self.device, non_blocking=True)
        return self._allowed_mask_cache

    def _logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows [B], token ids [B], biases [B]) over every biased (row, token); None if none.

        NOTE: rebuilt only when a biased request joined, left or moved row: a
        bias may list thousands of tokens, and most steps change nothing.
        """
        if not self.logit_bias:
            return None
        key = tuple((req_id, self.req_id_to_index[req_id]) for req_id in self.logit_bias)
        if key != self._logit_bias_key:
            self._logit_bias_key = key
            self._logit_bias_tensors_cache = self._build_logit_bias_tensors()
        return self._logit_bias_tensors_cache

    def _build_logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for req_id, bias in self.logit_bias.items():
            rows.extend([self.req_id_to_index[req_id]] * len(bias))
            token_ids.extend(bias)
            biases.extend(bias.values())
        dev = self.device
        return (torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True),
                torch.tensor(token_ids, dtype=torch.long).to(dev, non_blocking=True),
                torch.tensor(biases, dtype=torch.float32).to(dev, non_blocking=True))

    def _rows_below_min_tokens(self) -> dict[int, list[int]]:
        rows = {}
        for req_id, (min_tokens, stop_ids) in self.min_tokens.items():
            i = self.req_id_to_index[req_id]
            if self.num_tokens_no_spec[i] - self.num_prompt_tokens[i] < min_tokens:
                rows[i] = stop_ids
        return rows

    def snapshot(self) -> dict:
        # NOTE: each per-row array is turned into a list once (tolist), not
        # read element by element: a numpy scalar read and its int() cost more
        # than the whole row's dict otherwise.
        n = len(self._req_ids)
        num_tokens = self.num_tokens_no_spec[:n].tolist()
        num_prompt_tokens = self.num_prompt_tokens[:n].tolist()
        num_computed_tokens = self.num_computed_tokens_cpu[:n].tolist()
        block_ids = self.block_table.row_lists(n)
        rows = [{"index": i, "req_id": req_id,
                 "num_tokens": num_tokens[i],
                 "num_prompt_tokens": num_prompt_tokens[i],
                 "num_computed_tokens": num_computed_tokens[i],
                 "block_ids": block_ids[i]}
                for i, req_id in enumerate(self._req_ids) if req_id is not None]
        return {"num_reqs": self.num_reqs, "rows": rows,
                "condense_moves": [list(m) for m in self.last_condense_moves]}

    def num_blocks(self, row: int) -> int:
        return int(self.block_table.num_blocks_per_row[row])
