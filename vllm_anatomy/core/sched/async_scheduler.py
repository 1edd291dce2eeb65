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
"""
from __future__ import annotations

from vllm_anatomy.core.request import Request, RequestStatus
from vllm_anatomy.core.sched.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING    # NOTE: read per request per step (see Request.is_finished)


class AsyncScheduler(Scheduler):

    # _update_after_schedule: each step that will sample a request's token adds
    # a placeholder for it (vLLM overrides the method; here it is one class attribute).
    placeholders_per_sampling_step = 1

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
