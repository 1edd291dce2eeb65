"""Helpers shared by the kernel tests: device choice, tolerances, paged batches."""
from __future__ import annotations

import random

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

# GPU-only tests carry @pytest.mark.gpu and @requires_cuda: skipped without a
# CUDA device, with the reason shown by `pytest -rs`.
requires_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of |x| in `dtype` (x in fp32)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - MANTISSA_BITS[dtype])


def assert_close_ulp(out: torch.Tensor, ref: torch.Tensor, ulps: float = 1.0,
                     atol: float = 1e-6) -> None:
    """|out - ref| <= ulps * ulp(max(|out|, |ref|)) + atol, elementwise; never NaN.

    NOTE: kernel and reference add in different orders, so their fp32 results
    differ in the last fp32 bits, and rounding to fp16/bf16 can then land one
    ulp apart (the interpreter also truncates fp32 -> bf16 where torch rounds).
    """
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "NaN in output"
    o, r = out.float(), ref.float()
    tol = ulps * ulp(torch.maximum(o.abs(), r.abs()), ref.dtype) + atol
    bad = (o - r).abs() > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements off by more than "
                           f"{ulps} ulp; max abs err {float((o - r).abs().max()):.3g}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN fails any threshold."""
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm())


def shuffled_blocks(num_blocks: int, seed: int) -> list[int]:
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return ids


def block_tables_for(seq_lens: list[int], block_size: int, num_blocks: int, width: int,
                     seed: int) -> torch.Tensor:
    """Rows of shuffled block ids; the unused tail of each row holds other, random ids."""
    free = shuffled_blocks(num_blocks, seed)
    gen = random.Random(seed + 1)
    rows = []
    for seq_len in seq_lens:
        n = -(-seq_len // block_size)
        rows.append([free.pop() for _ in range(n)] + [gen.randrange(num_blocks)
                                                      for _ in range(width - n)])
    return torch.tensor(rows, dtype=torch.int32).reshape(len(seq_lens), width)


def forward_through_backends(backends, heads, num_blocks, block_size, dtype, writes, query, **forward_kwargs):
    """Each backend on its own zeroed cache: write each (key, value, metadata) of `writes`
    in order, then attend `query` with the last write's metadata (output starts NaN).
    heads = (num_heads, head_dim, num_kv_heads). Returns (outputs, impls)."""
    from vllm_anatomy.attention.selector import get_attn_backend
    num_heads, head_dim, num_kv_heads = heads
    outs, impls = [], []
    for backend in backends:
        impl = get_attn_backend(backend).get_impl_cls()(num_heads, head_dim, num_kv_heads, head_dim ** -0.5)
        cache = torch.zeros(get_attn_backend(backend).get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=DEVICE)
        for key, value, meta in writes:
            impl.do_kv_cache_update(key, value, cache, meta.slot_mapping)
        outs.append(impl.forward(query, cache, writes[-1][2], torch.full_like(query, float("nan")),
                                 **forward_kwargs))
        impls.append(impl)
    return outs, impls
