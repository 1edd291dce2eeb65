from vllm_anatomy.entrypoints.cli.main import main

__all__ = ["main"]
