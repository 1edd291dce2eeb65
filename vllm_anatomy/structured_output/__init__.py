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

Simplified: one backend (xgrammar), no reasoning parser, no parallel bitmask
filling for batches > 128. With speculative decoding a structured request gets
no drafts (Scheduler.update_draft_token_ids), so it keeps one bitmask row per
step (v0.27.1 validates drafts with the grammar and masks every draft position).
The tokenizer is loaded on the first structured request, not at start-up.
"""
from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from vllm_anatomy.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from vllm_anatomy.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    import torch

    from vllm_anatomy.config import VllmConfig
    from vllm_anatomy.core.request import Request

__all__ = ["StructuredOutputManager", "StructuredOutputGrammar", "StructuredOutputRequest"]


class StructuredOutputManager:
    """Engine-level manager for structured output requests."""

    def __init__(self, vllm_config: VllmConfig, backend: StructuredOutputBackend | None = None) -> None:
        """backend: None = xgrammar over the model's tokenizer, built on first use."""
        self.vllm_config = vllm_config
        self.backend = backend
        # NOTE: the scheduler imports this module: torch (and xgrammar) load only
        # with the first structured request (the pure core stays torch-free).
        self._grammar_bitmask: torch.Tensor | None = None
        # NOTE: compiling is CPU-bound: half the cores (vLLM's choice), not the
        # default of 5 threads per core.
        max_workers = max(1, (multiprocessing.cpu_count() + 1) // 2)
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar_compile")

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; request.structured_output_request.grammar
        becomes a Future the scheduler polls."""
        if request.structured_output_request is None:
            return
        if self.backend is None:
            # NOTE: in the caller's thread, once: the pool's threads share the compiler.
            self.backend = self._make_backend()
        request.structured_output_request.compile_start = time.monotonic()
        request.structured_output_request.grammar = self.executor.submit(self._create_grammar, request)

    def _make_backend(self) -> StructuredOutputBackend:
        from vllm_anatomy.structured_output.backend_xgrammar import XgrammarBackend
        from vllm_anatomy.transformers_utils.tokenizer import get_tokenizer
        mc = self.vllm_config.model_config
        vocab_size = (mc.hf_config or {}).get("vocab_size")
        tokenizer = get_tokenizer(mc.model)
        return XgrammarBackend(self.vllm_config, tokenizer=tokenizer, vocab_size=vocab_size or len(tokenizer))

    def _create_grammar(self, request: Request) -> StructuredOutputGrammar:
        """Runs in the pool. NOTE: an exception stays in the Future: the scheduler
        fails this request alone (FINISHED_ERROR)."""
        struct_request, backend = request.structured_output_request, self.backend
        assert struct_request is not None and backend is not None     # (set by grammar_init)
        try:
            request_type, grammar_spec = struct_request.structured_output_key
            return backend.compile_grammar(request_type, grammar_spec)
        finally:
            struct_request.compile_end = time.monotonic()

    def grammar_bitmask(self, requests: dict[str, Request],
                        structured_output_request_ids: list[str]) -> np.ndarray | None:
        """One bitmask row per id, in that order: [len(ids), ceil(vocab_size / 32)] int32."""
        if not structured_output_request_ids:
            return None
        if self._grammar_bitmask is None:
            assert self.backend is not None, "a request with a grammar went through grammar_init"
            max_batch_size = self.vllm_config.scheduler_config.max_num_seqs
            self._grammar_bitmask = self.backend.allocate_token_bitmask(max_batch_size)
        bitmask = self._grammar_bitmask
        for index, req_id in enumerate(structured_output_request_ids):
            struct_request = requests[req_id].structured_output_request
            grammar = struct_request.grammar if struct_request is not None else None
            # NOTE: the scheduler asks only for requests whose grammar compiled.
            assert isinstance(grammar, StructuredOutputGrammar), f"{req_id}: no compiled grammar"
            if not grammar.is_terminated():
                grammar.fill_bitmask(bitmask, index)
            else:
                # NOTE: a finished grammar constrains nothing (all ones).
                bitmask[index].fill_(-1)
        # NOTE: numpy, not a tensor: much cheaper to send to a worker process. A
        # view of the reused buffer: sample_tokens copies it (or sends it) before
        # the next step refills it.
        return bitmask[:len(structured_output_request_ids)].numpy()

    def should_advance(self, request: Request) -> bool:
        """Whether the request's sampled tokens advance its grammar (always, without
        a reasoning parser; vLLM skips the reasoning part of the output)."""
        return request.use_structured_output

    def clear_backend(self) -> None:
        if self.backend is not None:
            self.backend.destroy()
        self.executor.shutdown(wait=False, cancel_futures=True)
