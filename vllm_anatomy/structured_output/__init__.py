"""StructuredOutputManager: compile grammars off the step, build each step's bitmask.

Mirrors vllm/v1/structured_output/__init__.py. Engine-level; three moments:

    grammar_init(request)       EngineCore.preprocess_add_request (EngineCoreProc:
                                its input thread): submit the compile to a thread
                                pool; the request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    grammar_bitmask(...)        Scheduler.get_grammar_bitmask, while the device runs
                                the step's forward: one row per structured request
    should_advance(request)     Scheduler.update_from_output: the sampled tokens
                                advance each request's matcher (accept_tokens)

NOTE: why a thread pool and a waiting state, not a compile inside the step: a
JSON schema can take from milliseconds to seconds to compile against a 50k-150k
token vocabulary. Compiled in the step it would stall every other request's
decode for that long; compiled in the pool it overlaps the steps, and the
scheduler simply passes the request over (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
until its Future is done, then promotes it to WAITING.

NOTE: (ours; issue 29) the pool is a GrammarCompileExecutor (compile_executor.py),
not vLLM's plain ThreadPoolExecutor: its threads run at a lower CPU priority and,
with xgrammar's own threads, use at most half the CPUs (compile_budget), so a
huge schema cannot take the forward pass's cores; each compile has a CPU-time budget
(VLLM_ANATOMY_GRAMMAR_COMPILE_TIMEOUT_S) and is cancelled as soon as its request
finishes or is aborted while it still compiles. A compile that fails, times out,
or yields a grammar whose first mask allows no token of this vocabulary finishes
its request with FINISHED_ERROR and says why in stop_reason (GRAMMAR_ERROR_PREFIX):
the server answers that with a 400, not a 500 (serving_engine.raise_if_error).

Speculative decoding (as v0.27.1): a structured request's drafts are first cut
at the first one its grammar refuses (Scheduler.update_draft_token_ids:
grammar.validate_tokens), then grammar_bitmask gives it one row per draft
position plus one for the bonus token; the verify step masks each of those
logits rows (utils.apply_grammar_bitmask):

    drafts [d0, d1]:  row 0 = mask(state)            (what may replace d0)
                      row 1 = mask(state + d0)       (what may follow d0)
                      row 2 = mask(state + d0 + d1)  (the bonus token)
                      then the grammar is rolled back by the 2 advances

Simplified: one backend (xgrammar), no reasoning parser, no parallel bitmask
filling for batches > 128. The tokenizer is loaded by the first compile (in
the pool), not at start-up.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from vllm_anatomy import envs
from vllm_anatomy.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from vllm_anatomy.structured_output.compile_executor import GrammarCompileExecutor, compile_budget
from vllm_anatomy.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    import torch

    from vllm_anatomy.config import VllmConfig
    from vllm_anatomy.core.request import Request

__all__ = ["StructuredOutputManager", "StructuredOutputGrammar", "StructuredOutputRequest"]

logger = logging.getLogger(__name__)

# A request finished with FINISHED_ERROR whose stop_reason starts with this failed
# because of its own constraint (the rest of stop_reason says how): a 400, not a 500.
GRAMMAR_ERROR_PREFIX = "structured_outputs: "


class GrammarMatchesNothing(ValueError):
    """The compiled grammar allows no token at all at its start."""


class StructuredOutputManager:
    """Engine-level manager for structured output requests."""

    def __init__(self, vllm_config: VllmConfig, backend: StructuredOutputBackend | None = None) -> None:
        """backend: None = xgrammar over the model's tokenizer, built on first use."""
        self.vllm_config = vllm_config
        self.backend = backend
        # NOTE: the scheduler imports this module: torch (and xgrammar) load only
        # with the first structured request (the pure core stays torch-free).
        self._grammar_bitmask: torch.Tensor | None = None
        # NOTE: compiling is CPU-bound: workers x xgrammar threads = half the CPUs
        # (vLLM: half the CPUs of workers, 8 xgrammar threads each), at low priority.
        max_workers, self.compile_threads = compile_budget()
        self.executor = GrammarCompileExecutor(max_workers, thread_name_prefix="grammar_compile")
        self.compile_timeout_s: float = envs.VLLM_ANATOMY_GRAMMAR_COMPILE_TIMEOUT_S
        self._backend_lock = threading.Lock()

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; request.structured_output_request.grammar
        becomes a Future the scheduler polls."""
        if request.structured_output_request is None:
            return
        request.structured_output_request.compile_start = time.monotonic()
        # NOTE: cancel_if: an abort (or any finish) while the grammar compiles
        # cancels the compile within CANCEL_POLL_S, queued or running.
        request.structured_output_request.grammar = self.executor.submit(
            self._create_grammar, request, timeout=self.compile_timeout_s, cancel_if=request.is_finished,
            on_failure=lambda error: self._grammar_failed(request, error))

    def _get_backend(self) -> StructuredOutputBackend:
        """The backend, built by the first compile that needs it (in a pool thread, at its
        low priority: importing xgrammar and reading the vocabulary take seconds of CPU)."""
        with self._backend_lock:
            if self.backend is None:
                self.backend = self._make_backend()
            return self.backend

    def _make_backend(self) -> StructuredOutputBackend:
        from vllm_anatomy.structured_output.backend_xgrammar import XgrammarBackend
        from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
        mc = self.vllm_config.model_config
        vocab_size = (mc.hf_config or {}).get("vocab_size")
        tokenizer = get_tokenizer(mc.model)
        return XgrammarBackend(self.vllm_config, tokenizer=tokenizer, vocab_size=vocab_size or len(tokenizer),
                               max_threads=self.compile_threads)

    def _create_grammar(self, request: Request) -> StructuredOutputGrammar:
        """Runs in the pool. NOTE: an exception stays in the Future: the scheduler
        fails this request alone (FINISHED_ERROR)."""
        struct_request = request.structured_output_request
        assert struct_request is not None       # (grammar_init checked)
        try:
            backend = self._get_backend()
            request_type, grammar_spec = struct_request.structured_output_key
            grammar = backend.compile_grammar(request_type, grammar_spec)
            # NOTE: (ours) a grammar whose first mask is empty would make the sampler
            # pick from all -inf logits (token 0), which the grammar then refuses:
            # refused here, before the request takes a batch slot.
            if not grammar.is_terminated() and not grammar.allows_any_token():
                raise GrammarMatchesNothing("the constraint allows no token of this model's vocabulary "
                                            "at the start of the output, so it can match nothing")
            return grammar
        finally:
            if struct_request.compile_end is None:      # (an abandoned compile ended long ago)
                struct_request.compile_end = time.monotonic()

    @staticmethod
    def _grammar_failed(request: Request, error: BaseException) -> None:
        """A compile failed or ran out of time (before its Future says so): the compile
        window ends now (an abandoned compile's thread may run on), and the request's
        stop_reason says why (read when the scheduler finishes it with FINISHED_ERROR)."""
        struct_request = request.structured_output_request
        if struct_request is not None and struct_request.compile_end is None:
            struct_request.compile_end = time.monotonic()
        logger.warning("Request %s: its grammar failed: %r", request.request_id, str(error)[:500])
        request.stop_reason = f"{GRAMMAR_ERROR_PREFIX}{error}"

    def grammar_bitmask(self, requests: dict[str, Request], structured_output_request_ids: list[str],
                        scheduled_spec_decode_tokens: dict[str, list[int]]) -> np.ndarray | None:
        """[sum over ids of (1 + its scheduled drafts), ceil(vocab_size / 32)] int32: for each id,
        in that order, one row per draft position and one for the bonus (or only) token."""
        if not structured_output_request_ids:
            return None
        if self._grammar_bitmask is None:
            assert self.backend is not None, "a request with a grammar went through grammar_init"
            max_batch_size = self.vllm_config.scheduler_config.max_num_seqs
            # NOTE: one row per token the verify step may sample: each draft position and the bonus.
            self._grammar_bitmask = self.backend.allocate_token_bitmask(
                max_batch_size * (1 + self.vllm_config.num_speculative_tokens))
        cumulative_index = 0
        for req_id in structured_output_request_ids:
            struct_request = requests[req_id].structured_output_request
            grammar = struct_request.grammar if struct_request is not None else None
            # NOTE: the scheduler asks only for requests whose grammar compiled.
            assert isinstance(grammar, StructuredOutputGrammar), f"{req_id}: no compiled grammar"
            apply_bitmask = True
            state_advancements = 0
            for token in scheduled_spec_decode_tokens.get(req_id, ()):
                self._fill_bitmasks(((grammar, cumulative_index, apply_bitmask),))
                # NOTE: async scheduling: a -1 stands for a draft the grammar refused
                # (Scheduler.update_draft_token_ids_in_output); the rows after it
                # allow everything: the rejection sampler stops at this position.
                if token == -1:
                    apply_bitmask = False
                elif apply_bitmask and not grammar.is_terminated():
                    # (the drafts were validated: the grammar accepts them)
                    if not grammar.accept_tokens(req_id, [token]):
                        raise AssertionError((token, req_id, scheduled_spec_decode_tokens))
                    state_advancements += 1
                cumulative_index += 1
            self._fill_bitmasks(((grammar, cumulative_index, apply_bitmask),))
            cumulative_index += 1
            # NOTE: the drafts are not output yet: the grammar goes back to where it stood.
            if state_advancements > 0:
                grammar.rollback(state_advancements)
        # NOTE: numpy, not a tensor: much cheaper to send to a worker process. A
        # view of the reused buffer: sample_tokens copies it (or sends it) before
        # the next step refills it.
        return self._grammar_bitmask[:cumulative_index].numpy()

    def _fill_bitmasks(self, batch: Iterable[tuple[StructuredOutputGrammar, int, bool]]) -> None:
        """For each (grammar, row, apply_bitmask): that row of the bitmask, the grammar's next-token mask."""
        assert self._grammar_bitmask is not None
        for grammar, index, apply_bitmask in batch:
            if apply_bitmask and not grammar.is_terminated():
                grammar.fill_bitmask(self._grammar_bitmask, index)
            else:
                # NOTE: a finished grammar (or a row after a refused draft) constrains nothing (all ones).
                self._grammar_bitmask[index].fill_(-1)

    def should_advance(self, request: Request) -> bool:
        """Whether the request's sampled tokens advance its grammar (always, without
        a reasoning parser; vLLM skips the reasoning part of the output)."""
        return request.use_structured_output

    def clear_backend(self) -> None:
        # NOTE: shutdown may run twice (an explicit shutdown(), then the LLM's
        # finalizer); the backend is destroyed once and forgotten.
        if self.backend is not None:
            self.backend.destroy()
            self.backend = None
        self.executor.shutdown()
