"""Attention backends: torch_ref (CPU, the readable reference) and triton_attn (GPU, the Triton kernels).

Mirrors vllm/v1/attention/backends/, where vLLM's TRITON_ATTN backend is triton_attn.py too.
"""
