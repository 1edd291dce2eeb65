"""Model definitions: the Llama / Qwen2 / Qwen3 family, written with vLLM's layers.

Mirrors vllm/model_executor/models/.
"""
