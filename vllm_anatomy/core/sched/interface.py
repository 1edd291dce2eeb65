"""SchedulerInterface: what EngineCore needs from a scheduler.

Mirrors vllm/v1/core/sched/interface.py (the subset this project uses).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_anatomy.core.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm_anatomy.core.request import Request, RequestStatus
    from vllm_anatomy.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm_anatomy.engine.protocol import EngineCoreOutputs, SchedulerStats


class SchedulerInterface(ABC):

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide which requests run this step and how many tokens each computes."""

    @abstractmethod
    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask of the step's structured-output requests (None if it has none)."""

    @abstractmethod
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        """Apply the sampled tokens; return the outputs per frontend client."""

    @abstractmethod
    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Speculative decoding: the drafts proposed for each request, to verify next step."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: RequestStatus) -> list[Request]:
        """Finish requests from outside (aborts; None: all); unknown ids are ignored.
        Returns the requests it finished."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """Finished requests whose news has not reached the workers/clients yet."""

    def has_requests(self) -> bool:
        """True while a step would do something (EngineCore.step skips otherwise)."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def get_request_counts(self) -> tuple[int, int]:
        """(num_running, num_waiting)."""

    @abstractmethod
    def make_stats(self, spec_decoding_stats=None) -> SchedulerStats | None: ...

    @abstractmethod
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget the cached blocks (with reset_running_requests: preempting the running requests first)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release what the scheduler started (the KV event publisher)."""

    @abstractmethod
    def snapshot(self, kv_cache: dict[str, Any] | None = None) -> dict[str, Any]:
        """Plain data of the scheduler's state (teaching extra, not in vLLM).
        kv_cache: the KV manager's snapshot if the caller built it (None: its plain snapshot())."""
