"""The breakable capture (piecewise graphs): pieces replay, eager breaks run with the replay's arguments."""
import gc

import pytest
import torch

from vllm_anatomy.compilation.breakable_cudagraph import (
    BreakableCUDAGraphCapture,
    eager_break_during_capture,
    weak_ref_tensor,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@eager_break_during_capture
def _scale_into(x: torch.Tensor, out: torch.Tensor, *, factor: float) -> None:
    out.copy_(x * factor)            # a host value (factor) a graph could not change: eager


def test_pieces_replay_and_breaks_take_the_replay_arguments():
    x = torch.zeros(64, device="cuda")

    def forward(factor):
        a = x + 1                    # piece 0
        out = torch.empty_like(a)    # allocated in piece 0: the break writes into it
        _scale_into(a, out, factor=factor)
        return out * 2 + 3           # piece 1

    forward(1.0)                     # warm-up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), BreakableCUDAGraphCapture() as capture:
        result = forward(1.0)
    torch.cuda.current_stream().wait_stream(stream)
    assert (capture.num_graphs, capture.num_eager_breaks) == (2, 1)
    # Outside a capture the op is a plain call.
    assert BreakableCUDAGraphCapture.current() is None
    for value, factor in [(5.0, 1.0), (-2.0, 10.0), (0.5, 0.0)]:
        x.fill_(value)
        capture.replay(factor=factor)
        torch.cuda.synchronize()
        assert torch.equal(result, torch.full_like(x, (value + 1) * factor * 2 + 3))


def test_weak_ref_tensor_views_without_owning():
    t = torch.arange(4 * 6, device="cuda", dtype=torch.bfloat16).view(4, 6)[:, 1:5]   # strided view
    weak = weak_ref_tensor(t)
    assert weak.shape == t.shape and weak.stride() == t.stride() and weak.dtype == t.dtype
    assert weak.data_ptr() == t.data_ptr() and torch.equal(weak, t)
    t.add_(1)
    assert torch.equal(weak, t)                     # the same memory
    base = t.untyped_storage()
    refs = base._weak_ref() if hasattr(base, "_weak_ref") else None
    del t, base
    gc.collect()
    if refs is not None:                            # the weak view did not keep the storage alive
        assert torch.UntypedStorage._expired(refs)
