"""The waiting queue: FCFSRequestQueue.

Mirrors vllm/v1/core/sched/request_queue.py. Simplified: only the FCFS policy
(vLLM also has PriorityRequestQueue, a heap ordered by (priority, arrival_time)).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from vllm_anatomy.core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"   # not implemented here


class RequestQueue(ABC):
    """What the scheduler needs from a waiting queue."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None: ...

    @abstractmethod
    def prepend_requests(self, requests: RequestQueue) -> None: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue(deque, RequestQueue):
    """First come, first served: a deque of requests."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        """Put a request at the front. NOTE: preempted requests go here, so the
        oldest work resumes first and FCFS order is kept."""
        self.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        """Put a queue's requests at the front. NOTE: the scheduler fills its
        per-step skip queue with prepend_request, so it holds them newest first;
        extendleft reverses that back into arrival order."""
        self.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        filtered = [req for req in self if req not in to_remove]
        self.clear()
        self.extend(filtered)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    raise ValueError(f"Scheduling policy {policy.value!r} is not implemented here (only 'fcfs').")
