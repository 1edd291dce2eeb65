"""Arithmetic of splitting a layer across ranks.

Mirrors vllm/distributed/utils.py (ensure_divisibility, divide).
"""
from __future__ import annotations

import os

# NOTE: NVLink multicast (NVLS) off: the shared GPU machines this project measures on
# require it (a program that uses multicast can take the host's GPUs out of service).
# NCCL then all-reduces over NVLink without it. The GPU tests and bench/tp.py set these
# before any rank starts; the worker processes inherit the environment.
NO_NVLINK_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}


def disable_nvlink_multicast() -> None:
    """Set NO_NVLINK_MULTICAST in this process's environment (a value already set stays)."""
    for key, value in NO_NVLINK_MULTICAST.items():
        os.environ.setdefault(key, value)


def ensure_divisibility(numerator: int, denominator: int) -> None:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, which must be exact (each rank gets the same share)."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator
