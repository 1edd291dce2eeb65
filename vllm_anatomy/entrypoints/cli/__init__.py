"""The `vllm-anatomy` command: serve, generate, dashboard, download, export, lesson.

Mirrors vllm/entrypoints/cli/ (the `vllm` command).
"""
from vllm_anatomy.entrypoints.cli.main import main

__all__ = ["main"]
