"""The engine: the frontend (LLMEngine, AsyncLLM, input and output processing) and EngineCore's step loop.

Mirrors vllm/v1/engine/: EngineCore, its process (EngineCoreProc) and the clients that reach it.
"""
