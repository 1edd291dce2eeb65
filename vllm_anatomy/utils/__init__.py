"""Small helpers shared across the engine (vLLM: vllm/utils/)."""
