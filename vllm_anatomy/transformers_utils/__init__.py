"""The Hugging Face side: a model directory's tokenizer, and the default model fetched and converted once.

Mirrors vllm/transformers_utils/, where vLLM resolves and fetches a model, and vllm/tokenizers/.
"""
