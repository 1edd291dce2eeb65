"""Model layers: embeddings, (tensor-parallel) linear layers, RMSNorm, rotary embedding, activation.

Mirrors vllm/model_executor/layers/.
"""
