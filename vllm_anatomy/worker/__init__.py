"""The worker: one per device; its GPUModelRunner turns a SchedulerOutput into tensors, a forward and tokens.

Mirrors vllm/v1/worker/ (Worker, GPUModelRunner, InputBatch, BlockTable).
"""
