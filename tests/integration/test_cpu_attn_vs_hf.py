"""The CPU attention backend (the fast path) passes the reference's checks against transformers.

The same two checks as test_model_vs_hf.py — logits at every position through
a paged cache with shuffled blocks (prefill chunks, decodes around a chunk
with context), and greedy generation of up to 32 tokens equal to
transformers' `generate` — with the model built on the "cpu" backend.
"""
import pytest
import torch

from tests.helpers import PagedSequences
from tests.integration.test_model_vs_hf import (  # noqa: F401  (the fixtures and tests, re-run here)
    hf_model,
    prompts,
    test_greedy_generation_matches_hf,
    test_paged_logits_match_hf,
    tokenizer,
)
from vllm_anatomy.config import ModelConfig
from vllm_anatomy.model_executor.loader import get_model

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model(default_model_dir):
    model = get_model(ModelConfig(model=default_model_dir), backend="cpu")
    assert model.attn_backend.name == "cpu"
    return model


def test_forward_restores_the_thread_count(model):
    """Small attention calls run on one thread; the caller's thread count comes back."""
    threads = torch.get_num_threads()
    PagedSequences(model, num_blocks=16, block_size=16, seed=3).step([("p", list(range(100, 140)))])
    assert torch.get_num_threads() == threads
