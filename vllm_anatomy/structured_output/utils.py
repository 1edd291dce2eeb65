"""apply_grammar_bitmask: the scheduler's grammar bitmask onto the worker's logits.

Mirrors vllm/v1/structured_output/utils.py (apply_grammar_bitmask, choice_as_grammar).
Runs in the worker, in GPUModelRunner.sample_tokens, just before the sampler:
every token the request's grammar forbids gets logit -inf, so no sampling
rule (greedy, temperature, top-k/p, min-p) can pick it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm_anatomy.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm_anatomy.worker.gpu_input_batch import InputBatch


def apply_grammar_bitmask(scheduler_output: SchedulerOutput, grammar_output: GrammarOutput,
                          input_batch: InputBatch, logits: torch.Tensor) -> None:
    """Mask `logits` [R, V] in place with the rows of grammar_output.grammar_bitmask.

    NOTE: the bitmask's rows follow the scheduler's order of structured
    requests; the logits' rows follow the worker's persistent batch (which
    condense() reorders). The rows are re-sorted here into a [R, V/32] mask
    whose other rows are all ones (-1: every token allowed), the way vLLM
    does it. With speculative decoding a request with K drafts has 1 + K
    logits rows (each draft position, then the bonus) and as many bitmask rows:

        batch   [a (2 drafts), b (none), c (1 draft)]      a, c structured
        logits  a0 a1 a2 | b0 | c0 c1
        bitmask a0 a1 a2 c0 c1          -> rows 0 1 2, 4 5 of the sorted mask
    """
    import xgrammar as xgr          # NOTE: imported only by steps that carry a grammar

    bitmask = grammar_output.grammar_bitmask                                   # [S + drafts, ceil(V / 32)] int32
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    # Without drafts a request's logits row is its batch row.
    first_logit_rows = _logit_rows(scheduler_output, input_batch) if spec_tokens else input_batch.req_id_to_index
    sorted_bitmask = np.full((logits.shape[0], bitmask.shape[1]), -1, dtype=np.int32)   # [R, ceil(V / 32)]
    out_indices = []
    cumulative_index = 0
    for req_id in grammar_output.structured_output_request_ids:
        num_spec_tokens = len(spec_tokens.get(req_id, ()))
        # NOTE: a request that failed to join the batch has no rows (its bitmask rows are skipped)
        if (first_row := first_logit_rows.get(req_id)) is not None:
            for i in range(1 + num_spec_tokens):
                sorted_bitmask[first_row + i] = bitmask[cumulative_index + i]
                out_indices.append(first_row + i)
        cumulative_index += 1 + num_spec_tokens
    mask = torch.from_numpy(sorted_bitmask)
    if logits.is_cuda:
        mask = mask.pin_memory().to(logits.device, non_blocking=True)
    # NOTE: with every row masked, xgrammar needs no index list (one kernel over all rows).
    indices = None if len(out_indices) == logits.shape[0] else out_indices
    xgr.apply_token_bitmask_inplace(logits, mask, indices=indices)


def _logit_rows(scheduler_output: SchedulerOutput, input_batch: InputBatch) -> dict[str, int]:
    """req_id -> its first logits row: each earlier request's drafts have logits rows before it."""
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    rows, offset = {}, 0
    for batch_index, req_id in enumerate(input_batch.req_ids):
        rows[req_id] = batch_index + offset
        offset += len(spec_tokens.get(req_id, ()))
    return rows


def choice_as_grammar(choice: list[str]) -> str:
    """A choice between strings as an EBNF grammar: root ::= "a" | "b" (vLLM's helper)."""
    def escape_ebnf_string(s: str) -> str:
        return s.replace("\\", "\\\\").replace('"', '\\"')
    return "root ::= " + " | ".join(f'"{escape_ebnf_string(c)}"' for c in choice)
