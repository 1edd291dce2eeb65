"""AsyncScheduler: schedule step N+1 before step N's tokens are known.

Mirrors vllm/v1/core/sched/async_scheduler.py. With async scheduling the
engine (EngineCore.step_with_batch_queue) schedules and launches the next step
while the device still runs the current one, so the host's Python work —
update_from_output, output processing, schedule, prepare_inputs — overlaps the
forward pass instead of leaving the GPU idle between steps.

The scheduler then plans with tokens it has not seen: each step that will
sample a token for a request adds one *output placeholder*. A decode's next
step computes the position of that placeholder; its value (the sampled id) is
still on the device, and the worker splices it into input_ids there
(GPUModelRunner._prepare_inputs, `prev_sampled_token_ids`). When the output
arrives one step later, the placeholder is replaced by the real token.

    step:      k-1            k              k+1
    device:  [ fwd k-1 ][   fwd k   ][   fwd k+1  ]
    host:    sched k | launch k | update k-1 | sched k+1 | launch k+1 | update k ...

Everything else is the plain Scheduler: its schedule() already reads
num_output_placeholders (0 without async scheduling).

Speculative decoding (method draft_model, as v0.27.1): the drafts of step N+1
are proposed on the device after step N's sampling, so the scheduler never
sees them. _update_after_schedule gives each request that will sample K
-1 placeholder drafts (`spec_token_ids`), which the next schedule() schedules
like real drafts, and counts the step's own drafts as output placeholders,
as if all will be accepted. update_from_output rolls both back over the
rejected ones (Scheduler.update_from_output). The worker puts the real drafts
where the -1s stand (worker/async_spec_decode.py).

    after step N is scheduled (K = 2, step N verifies 2 drafts):
        num_computed_tokens  c + 3      (t, d1, d2 of step N)
        placeholders         1 + 2      (its sampled token and both drafts, optimistically)
        spec_token_ids       [-1, -1]   (step N+1's drafts, still to be proposed)
"""
from __future__ import annotations

from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.output import SchedulerOutput
from vllm_anatomy.core.sched.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING    # NOTE: read per request per step (see Request.is_finished)


class AsyncScheduler(Scheduler):

    # _update_after_schedule: each step that will sample a request's token adds
    # a placeholder for it (vLLM overrides the method; here it is one class attribute).
    placeholders_per_sampling_step = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A reusable, read-only list of -1 draft placeholders (speculative decoding).
        self._spec_token_placeholders: list[int] = [-1] * self.num_spec_tokens

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        if not self.num_spec_tokens:
            return
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        for req_id in num_scheduled_tokens:
            request = self.requests[req_id]
            if request.is_prefill_chunk:
                continue
            # The step's drafts are outputs too, until the rejection sampler says otherwise
            # (the sampled token's placeholder: super()).
            request.num_output_placeholders += len(spec_decode_tokens.get(req_id, ()))
            # NOTE: a structured request's drafts too: EngineCore validates them
            # against its grammar before this step's bitmask (update_draft_token_ids_in_output).
            request.spec_token_ids = self._spec_token_placeholders
        # NOTE: ours: the worker proposes drafts only for the requests of the step it
        # just ran, so a running request left out of this one has none to fill its
        # placeholders with: it decodes one token without drafts when it comes back.
        for request in self.running:
            if request.spec_token_ids and request.request_id not in num_scheduled_tokens:
                request.spec_token_ids = []

    def _update_request_with_output(self, request: Request, new_token_ids: list[int],
                                    is_stale: bool = False) -> tuple[list[int], bool]:
        status_before_update = request.status
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        # The placeholder has its value now. NOTE: preemption zeroed the
        # placeholders; a stale delivery has none left to fill.
        if not is_stale:
            request.num_output_placeholders -= len(new_token_ids)
            assert request.num_output_placeholders >= 0
        if status_before_update == _RUNNING:
            # NOTE: allocate_slots only caches blocks whose tokens are all known;
            # under async scheduling the last one becomes known here, a step
            # later. Blocks still being written by an in-flight step are left
            # for next time (vLLM: num_computed_tokens - num_in_flight_tokens).
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders)
        return new_token_ids, stopped
