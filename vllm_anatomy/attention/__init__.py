"""Attention: the layer a model calls and the backend that reads and writes the paged KV cache.

Mirrors vllm/v1/attention/ (the selector, the backends' interface) and vllm/model_executor/layers/attention/ (the layer).
"""
