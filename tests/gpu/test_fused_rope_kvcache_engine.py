"""The whole engine on the GPU with Llama's RoPE + KV-cache write in one launch
(kernels/fused_rope_kvcache.py, compilation/rope_kvcache_fusion.py), the default model's
attention shape (SmolLM2-135M: 9 q heads over 3 KV heads of 64): the same greedy tokens with
VLLM_ANATOMY_FUSE_ROPE_KVCACHE=1 and =0 and with the torch backend, fp32, CUDA graphs on; the
first step (> 256 tokens) keeps reshape_and_cache, the decodes take the fused launch; at trace
level full its kernel span stands for the cache write."""
import pytest
import torch

from tests.gpu.test_fused_qk_norm_rope_kvcache_engine import (
    _tokens,
    assert_fused_write_spans,
    assert_switch_matches_unfused_and_torch,
)
from vllm_anatomy.tracing.recorder import InMemoryRecorder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_switch_matches_unfused_and_torch_backend(tiny_smollm2_dir, monkeypatch):
    from vllm_anatomy.kernels import fused_rope_kvcache as frkv
    assert_switch_matches_unfused_and_torch(tiny_smollm2_dir, monkeypatch, "VLLM_ANATOMY_FUSE_ROPE_KVCACHE",
                                            frkv, "fused_rope_kvcache")


def test_full_trace_times_the_fused_write(tiny_smollm2_dir, monkeypatch):
    """Eager steps at level full: a step of <= 256 tokens has one fused_rope_kvcache span per layer
    (attributes naming the slot_mapping write) and no reshape_and_cache; the first step (> 256
    tokens) one reshape_and_cache per layer. Tokens as untraced."""
    monkeypatch.setenv("VLLM_ANATOMY_FUSE_ROPE_KVCACHE", "1")
    rec = InMemoryRecorder("full")
    num_layers, traced = _tokens(tiny_smollm2_dir, recorder=rec, enforce_eager=True)
    assert traced == _tokens(tiny_smollm2_dir)[1]
    assert_fused_write_spans(rec, num_layers, "fused_rope_kvcache", ["rotary_embedding", "reshape_and_cache"])
