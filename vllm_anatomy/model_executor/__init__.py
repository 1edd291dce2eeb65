"""The model: Llama-family networks, their layers, the weight loader and the sampler.

Mirrors vllm/model_executor/ (models/, layers/, model_loader/) and vllm/v1/sample/.
"""
