"""The waiting queue: FCFSRequestQueue, or PriorityRequestQueue (--scheduling-policy priority).

Mirrors vllm/v1/core/sched/request_queue.py. Under FCFS the queue is a deque
in arrival order, and a preempted request goes back to its front. Under the
priority policy it is a heap ordered like Request.__lt__: lower `priority`
first, then earlier arrival_time, then request id; "prepending" a request is
just adding it (the heap puts it where its priority says).
"""
from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from vllm_anatomy.core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


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
    def __bool__(self) -> bool: ...

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

    def __bool__(self) -> bool:
        return len(self) > 0

    def __len__(self) -> int:
        return deque.__len__(self)

    def __iter__(self) -> Iterator[Request]:
        return deque.__iter__(self)


class PriorityRequestQueue(RequestQueue):
    """A heap of requests: the smallest (priority, arrival_time, request_id) first."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from empty heap")
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from empty heap")
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        """NOTE: a heap has no front: the request goes where its priority puts it
        (a preempted request keeps its arrival_time, so it is still ahead of
        later arrivals of its priority)."""
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = requests if isinstance(requests, set) else set(requests)
        self._heap = [req for req in self._heap if req not in to_remove]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In priority order (pops a copy of the heap)."""
        heap = self._heap[:]
        while heap:
            yield heapq.heappop(heap)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    if policy == SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    raise ValueError(f"Unknown scheduling policy: {policy}")
