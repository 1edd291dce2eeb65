"""Arithmetic of splitting a layer across ranks.

Mirrors vllm/distributed/utils.py (ensure_divisibility, divide).
"""
from __future__ import annotations


def ensure_divisibility(numerator: int, denominator: int) -> None:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, which must be exact (each rank gets the same share)."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator
