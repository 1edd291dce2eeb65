"""The pure core: Request, the KV cache manager and its block pool (paged memory, prefix caching).

Mirrors vllm/v1/core/ and vllm/v1/request.py; nothing here imports tracing or torch.
"""
