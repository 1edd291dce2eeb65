"""The scheduler: one token budget per step, RUNNING first, then WAITING; SchedulerOutput is its answer.

Mirrors vllm/v1/core/sched/.
"""
