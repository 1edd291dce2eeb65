"""Triton kernels (installed as vllm_anatomy.kernels); each beside its plain-torch reference."""
