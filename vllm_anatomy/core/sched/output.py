"""What the scheduler tells the workers each step: SchedulerOutput.

Mirrors vllm/v1/core/sched/output.py. NOTE: only ids and numbers cross this
boundary — block ids, never KVCacheBlock objects — so a worker in another
process can rebuild its view from the message alone. New requests are sent in
full once; after that only the diff (CachedRequestData).
"""
from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from vllm_anatomy.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """A request the worker has not seen (or one resumed after preemption in vLLM's V2 runner).

    NOTE: vLLM's fields for what this engine has no counterpart of are kept at
    their "none" value: mm_features (images / audio), pooling_params (pooling
    models), lora_request, prompt_embeds / prompt_is_token_ids (embeddings as
    the prompt), prefill_token_ids (vLLM's V2 model runner). Keyword-only: the
    defaults of those sit between the fields a worker reads.
    """
    req_id: str
    prompt_token_ids: list[int]
    mm_features: list = []
    sampling_params: SamplingParams
    pooling_params: None = None
    # One list per KV-cache group (we have exactly one group: full attention).
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: None = None
    prompt_embeds: Any = None
    prompt_is_token_ids: None = None
    prefill_token_ids: list[int] | None = None

    @classmethod
    def from_request(cls, request, block_ids: tuple[list[int], ...],
                     prefill_token_ids: list[int] | None = None) -> "NewRequestData":
        return cls(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            prefill_token_ids=prefill_token_ids,
        )

    def __repr__(self) -> str:
        return self._repr(f"prompt_token_ids={self.prompt_token_ids}")

    def anon_repr(self) -> str:
        """repr without the prompt's tokens (for logs)."""
        num = len(self.prompt_token_ids) if self.prompt_token_ids is not None else None
        return self._repr(f"prompt_token_ids_len={num}")

    def _repr(self, prompt: str) -> str:
        shape = self.prompt_embeds.shape if self.prompt_embeds is not None else None
        return (f"NewRequestData(req_id={self.req_id},{prompt},mm_features={self.mm_features},"
                f"sampling_params={self.sampling_params},block_ids={self.block_ids},"
                f"num_computed_tokens={self.num_computed_tokens},lora_request={self.lora_request},"
                f"prompt_embeds_shape={shape})")


class CachedRequestData(msgspec.Struct, omit_defaults=True, gc=False):
    """The per-step diff for requests the worker already caches. Parallel lists."""
    req_ids: list[str]
    # For these, new_block_ids *replaces* the worker's block table row (they
    # were preempted and lost their blocks) instead of being appended to it.
    resumed_req_ids: set[str]
    # Sampled tokens sent back to the worker: only pipeline parallelism needs
    # them (its first stage never sees the sampler); empty here, as in v0.27.1
    # without PP.
    new_token_ids: list[list[int]]
    # The full token list (prompt + outputs) of each request that was not
    # scheduled in the previous step: the worker re-adds it to its persistent
    # batch and recovers its outputs from here.
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls([], set(), [], {}, [], [], [])


class SchedulerOutput(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One step's decisions, for the workers. Keyword-only: vLLM's field order, with the
    fields of features this engine lacks defaulted to their none value between the
    ones it fills (defaults are left out on the wire and in the trace)."""
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens scheduled for it this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Speculative decoding: req_id -> the draft tokens scheduled for it this step
    # (counted in its num_scheduled_tokens, after its last verified token);
    # requests without drafts are absent.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # NOTE: vLLM's multimodal encoder inputs to run, and cascade attention's shared
    # prefix (per KV-cache group); none here, so empty.
    scheduled_encoder_inputs: dict[str, list[int]] = {}
    num_common_prefix_blocks: list[int] = []
    # Requests finished between the previous step and this one: workers drop their state.
    finished_req_ids: set[str]
    # NOTE: encoder-cache entries the workers may free (multimodal); none here.
    free_encoder_mm_hashes: list[str] = []
    # Requests preempted since the previous step (by schedule() or
    # reset_prefix_cache; informational: the worker also notices they are
    # simply not scheduled).
    # NOTE: default set() (vLLM: None): vLLM's scheduler always sends a set, which
    # consumers iterate; an empty one equals the default and is left out on the wire.
    preempted_req_ids: set[str] | None = set()
    # Whether any scheduled request samples under a grammar this step
    # (EngineCore asks the scheduler for a bitmask only then).
    has_structured_output_requests: bool = False
    # Async scheduling: a structured request's previous token is still in
    # flight, so its grammar cannot say yet what this step may sample; the
    # engine samples this step only after that token is processed.
    pending_structured_output_tokens: bool = False
    # Async scheduling + speculative decoding: req_id -> how many of its scheduled
    # drafts its grammar refused (replaced by -1; Scheduler.update_draft_token_ids_in_output).
    num_invalid_spec_tokens: dict[str, int] | None = None
    # NOTE: a KV connector's per-step plan (loads / saves); none here.
    kv_connector_metadata: None = None
    # Teaching extra (not in vLLM): which step this is. NOTE: the trace
    # context does not ride here: the executor carries it beside the call
    # (in-process: the current span; to a worker process: the RPC envelope).
    step_id: int = 0

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                   num_scheduled_tokens={}, total_num_scheduled_tokens=0, finished_req_ids=set())


class GrammarOutput(msgspec.Struct, array_like=True, gc=False):
    """The structured-output bitmask of one step: what sample_tokens receives.

    Rows follow structured_output_request_ids (the scheduler's order), not the
    worker's batch rows: apply_grammar_bitmask maps one onto the other.
    NOTE: a numpy array crosses the shared-memory queue as raw bytes
    (engine/serial_utils.py: ndarray hooks), as vLLM prefers it to a tensor.
    """
    # ids of structured output requests.
    structured_output_request_ids: list[str]
    # [num_structured_reqs, ceil(vocab_size / 32)] int32: bit t of a row = token t allowed.
    grammar_bitmask: np.ndarray
