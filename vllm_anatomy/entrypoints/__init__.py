"""Entry points: the offline LLM class, the OpenAI-compatible server and the `vllm-anatomy` CLI.

Mirrors vllm/entrypoints/.
"""
