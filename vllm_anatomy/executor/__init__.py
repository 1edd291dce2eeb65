"""Executors: how EngineCore reaches its workers, a plain call in one process or RPC over shared memory.

Mirrors vllm/v1/executor/ (UniProcExecutor, MultiprocExecutor and its message queue).
"""
