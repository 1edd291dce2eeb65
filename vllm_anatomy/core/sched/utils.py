"""check_stop: has this request just finished? (called once per appended token)

Mirrors vllm/v1/core/sched/utils.py. Stop *strings* are not checked here: they
need text, and the frontend's detokenizer finds them and aborts the request.
Simplified: no repetition detection (FINISHED_REPETITION is never produced).
"""
from __future__ import annotations

from vllm_anatomy.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set request.status (and stop_reason) and return True if it must stop now."""
    sampling_params = request.sampling_params
    num_output_tokens = request.num_output_tokens

    if num_output_tokens < sampling_params.min_tokens:
        # NOTE: before min_tokens nothing but the context limit stops a request.
        # (vLLM returns False here unconditionally and relies on the frontend
        # to reject prompt + min_tokens > max_model_len; we stay safe anyway.)
        if request.num_tokens >= max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    last_token_id = request.output_token_ids[-1]
    # NOTE: the frontend leaves eos_token_id None when ignore_eos; the extra
    # ignore_eos test keeps hand-built SamplingParams honest too.
    if not sampling_params.ignore_eos and last_token_id == sampling_params.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True

    if last_token_id in (sampling_params.stop_token_ids or ()):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    # NOTE: vLLM merges generation_config's extra EOS ids into stop_token_ids
    # (unless ignore_eos); our SamplingParams keeps them in all_stop_token_ids.
    if not sampling_params.ignore_eos and last_token_id in (sampling_params.all_stop_token_ids or ()):
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True

    if request.num_tokens >= max_model_len or (
            request.max_tokens is not None and num_output_tokens >= request.max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
